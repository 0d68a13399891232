"""The OpenAI-compatible HTTP service: the application ``runtime.http.HttpServer`` runs.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``
(``embeddings``), ``POST /v1/tensor`` (``tensor``), ``POST /v1/responses``,
``POST /v1/messages`` and ``/v1/messages/count_tokens`` (surfaces of their own),
``GET /v1/models``,
``GET /health``, ``GET /live``, ``GET /metrics``, ``GET /openapi.json`` (``openapi``),
``GET``/``POST /busy_threshold`` (``admission.busy_threshold``), and the response store's
routes under ``/v1/responses/{id}`` and ``/v1/conversations`` (``responses.store_routes``).
This module decodes, resolves, admits and accounts for requests; ``openai.responder`` writes a
generation's response.

Routing is one dict lookup by (method, path). Paths that carry ids (the store's) cannot be
keys, so they are served by prefix, looked for only when the lookup misses: the generation
routes never pay for them.

A request is validated and preprocessed before any byte is sent, and the first output is
awaited before the status line goes out, so every failure that happens before generation
starts (bad input, unknown model, no instance, a worker dying before answering) gets its own
status and an OpenAI-style body. A failure after streaming started is sent as an SSE
``error`` event (OpenAI clients raise it). A client that disconnects cancels its request:
the handler task is cancelled, which closes the pipeline and sends a cancel to the worker.

A request's session (the KV router's soft routing hint, ``session_id_from``) is named by a
session header, or else by the body's ``prompt_cache_key`` (OpenAI's cache-routing hint, on
chat completions and the Responses API): the header wins, since a gateway or an agent harness
that sets it speaks for the whole conversation, where a client library fills the body field
per call.

Admission (``admission.AdmissionController``) comes after the body is decoded and the model
resolved (a 400 or 404 never takes a slot or a place in the queue) and before preprocessing
(tokenizing is work worth bounding); the slot is held until the response's last byte.

Access (``access_gate``): with credentials configured, every route but the open ones needs
a key, checked before the body is read, and the control routes (``http.admin``) an admin's. A
generation request opens its tenant's account before the admission queue, which orders it by
the tenant's priority; the response store's routes run under one too. The describing routes
(``/v1/models``, ``/health`` and the like) are ``info_routes``.

A request's body goes to the prompt log (``runtime.redact``, ``--log-prompts``) once read:
at debug level, and not even formatted when prompt logging is off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from functools import partial
from typing import Any

import msgspec

from turnout.errors import FrontendOverloaded, NoInstanceAvailable, TurnoutError
from turnout.frontend.access.accounting import (
    TenantAccount,
    TenantAdmission,
    request_priority,
)
from turnout.frontend.access.audit import AuditLog
from turnout.frontend.access.authenticator import Authenticator
from turnout.frontend.access.principal import DEFAULT_TENANT, Principal
from turnout.frontend.access.usage import TenantUsage
from turnout.frontend.admission.busy_threshold import BusyThresholds
from turnout.frontend.admission.limiter import AdmissionController
from turnout.frontend.anthropic.api import count_tokens_surface, messages_surface
from turnout.frontend.http.access_gate import AccessGate
from turnout.frontend.http.admin import BUSY_THRESHOLD, USAGE, AdminRoutes, Handler
from turnout.frontend.http.errors import HttpError, to_http_error, unavailable
from turnout.frontend.http.info_routes import InfoRoutes
from turnout.frontend.http.openapi import build_openapi
from turnout.frontend.http.surface import (
    MAX_SESSION_ID_CHARS,
    Pipeline,
    Surface,
    SurfaceRequest,
    body_session_key,
    decode_json,
)
from turnout.frontend.metrics.frontend import UNKNOWN_MODEL, FrontendMetrics
from turnout.frontend.models.manager import ModelKind, ModelManager
from turnout.frontend.models.pipeline import TextPipeline, TokensPipeline
from turnout.frontend.openai.chunk_writer import (
    JSON_HEADERS,
    MAX_REQUEST_ID_CHARS,
    REQUEST_ID_HEADER,
    new_request_id,
    valid_request_id,
)
from turnout.frontend.openai.responder import Responder
from turnout.frontend.responses.api import responses_surface
from turnout.frontend.responses.history import ResponseHistory
from turnout.frontend.responses.store_routes import (
    CONVERSATIONS,
    CONVERSATIONS_PREFIX,
    RESPONSES_PREFIX,
    STORE_ROUTES,
    StoreRoutes,
)
from turnout.frontend.unary.embeddings import embeddings_surface
from turnout.frontend.unary.tensor import tensor_surface
from turnout.llm.limits import RequestLimits
from turnout.protocols.openai import (
    ChatCompletionRequest,
    CompletionRequest,
)
from turnout.runtime import tracing
from turnout.runtime.context import EXPLAIN_ROUTING_METADATA, RequestContext
from turnout.runtime.http import ClientDisconnected, Exchange, Scope, discard_body
from turnout.runtime.log_context import MODEL_METADATA, TENANT_METADATA, bind_request
from turnout.runtime.redact import log_prompt

log = logging.getLogger("turnout.frontend")

_json = msgspec.json.Encoder()
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
#: Headers that name a conversation, in order of precedence: ours, then those coding agents
#: send by themselves (Claude Code; Codex, in its current and legacy spelling; OpenCode).
SESSION_HEADERS = (
    "x-session-id",
    "x-claude-code-session-id",
    "session-id",
    "session_id",
    "x-opencode-session",
)


def session_id_from(headers: Any) -> str | None:
    """The request's session id (a soft routing hint for the KV router), or None."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            if len(value) > MAX_SESSION_ID_CHARS:
                raise HttpError(
                    400,
                    f"header '{name}' is longer than {MAX_SESSION_ID_CHARS} characters",
                    param=name,
                )
            return str(value)
    return None


class HttpService:
    def __init__(
        self,
        manager: ModelManager,
        metrics: FrontendMetrics,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        admission: AdmissionController | None = None,
        reject_status: int = 503,
        busy_thresholds: BusyThresholds | None = None,
        prefill: Callable[[str], dict[str, Any] | None] | None = None,
        limits: RequestLimits | None = None,
        history: ResponseHistory | None = None,
        auth: Authenticator | None = None,
        public_routes: Collection[str] = (),
        tenants: TenantAdmission | None = None,
        usage: TenantUsage | None = None,
        audit: AuditLog | None = None,
    ) -> None:
        """``limits``: what one request may ask for (the preprocessors check them; surfaces
        that translate another API's request check the costly parts before translating).
        ``history``: the Responses API's store (None: none, as ``--response-store off``).
        ``auth``: who may call (None: anyone, as ``ANONYMOUS``); ``public_routes``: of
        ``PUBLIC_ROUTE_CHOICES``, those open without a key. ``tenants``: the tenants' limits
        (None: unlimited); ``usage``: where each tenant's tokens are counted (None: nowhere;
        a ``snapshot`` method serves ``/admin/usage``)."""
        self.manager = manager
        self.metrics = metrics
        self._responder = Responder(metrics)
        self.max_body_bytes = max_body_bytes
        #: None: no admission limits (every request runs at once).
        self.admission = admission
        #: The status of admission rejections (``--reject-status``: 429, 503 or 529).
        self.reject_status = reject_status
        if admission is not None:
            metrics.watch_admission(lambda: admission.queued)
        audit = audit if audit is not None else AuditLog()
        self.access = AccessGate(
            auth,
            audit,
            public_routes=public_routes,
            admin_paths={BUSY_THRESHOLD, USAGE},
            tenants=tenants,
            usage=usage,
        )
        #: None: the frontend has no routers to tune (e.g. a bare service in tests).
        self.busy_thresholds = busy_thresholds
        openapi_body = _json.encode(
            build_openapi(
                busy_thresholds=busy_thresholds is not None,
                usage=usage is not None,
                open_paths=self.access.open_paths if auth is not None else None,
            )
        )
        #: Set when the frontend drains (SIGTERM): ``/health`` answers 503 and generation
        #: requests are refused with a 503 while those in flight finish.
        self.draining = False
        self._routes: dict[tuple[str, str], Handler] = InfoRoutes(
            manager, metrics, openapi_body, prefill, draining=lambda: self.draining
        ).routes()
        admin = AdminRoutes(self._read_body, audit, busy_thresholds=busy_thresholds, usage=usage)
        self._routes.update(admin.routes())
        history = history if history is not None else ResponseHistory(None)
        store = self._store = StoreRoutes(history, self._read_body)
        self._routes[("POST", CONVERSATIONS)] = self._create_conversation
        self._paths = {path for _, path in self._routes}
        #: (prefix, handler(scope, proto, path, principal)): routes whose paths carry ids,
        #: tried in order when no exact route matches.
        self._prefix_routes = (
            (RESPONSES_PREFIX, store.responses),
            (CONVERSATIONS_PREFIX, store.conversations),
        )
        #: Each surface's error body by path (OpenAI's elsewhere): its 405s have its shape too.
        self._error_bodies: dict[str, Callable[[HttpError], bytes]] = {}
        #: Each generation route's ``endpoint`` metric label by path (refusals are counted).
        self._endpoints: dict[str, str] = {}
        self.add_surface("POST", "/v1/chat/completions", self._openai_surface(is_chat=True))
        self.add_surface("POST", "/v1/completions", self._openai_surface(is_chat=False))
        self.add_surface("POST", "/v1/responses", responses_surface(metrics, limits, history))
        self.add_surface("POST", "/v1/messages", messages_surface(metrics))
        self.add_surface("POST", "/v1/messages/count_tokens", count_tokens_surface())
        self.add_surface("POST", "/v1/embeddings", embeddings_surface())
        self.add_surface("POST", "/v1/tensor", tensor_surface())

    def add_routes(self, routes: dict[tuple[str, str], Handler]) -> None:
        """Serve more exact routes (``(method, path)`` to handler), under the same access rules
        as the describing routes: a credential when auth is on, unless the path is public."""
        self._routes.update(routes)
        self._paths.update(path for _, path in routes)

    @property
    def routes(self) -> set[tuple[str, str]]:
        """(method, path) of every route served; paths with ids as OpenAPI templates."""
        return set(self._routes) | set(STORE_ROUTES)

    # ------------------------------------------------------------------ dispatch

    async def __call__(self, scope: Scope, proto: Exchange) -> None:
        path = scope.path.rstrip("/") or "/"
        try:
            principal = self.access.caller(scope, path)
            handler = self._routes.get((scope.method, path))
            if handler is not None:
                await handler(scope, proto, principal)
                return
            for prefix, routed in self._prefix_routes:
                if path.startswith(prefix):
                    await self.access.accounted(
                        principal, partial(routed, scope, proto, path, principal)
                    )
                    return
            if path in self._paths:
                raise HttpError(
                    405, f"method {scope.method} not allowed on {path}", code="method_not_allowed"
                )
            raise HttpError(404, f"no route for {scope.method} {path}", code="unknown_url")
        except HttpError as exc:
            endpoint = self._endpoints.get(path)
            if endpoint is not None:  # a generation request refused before it was read
                self.metrics.count_request(UNKNOWN_MODEL, endpoint, False, exc.status)
            self._send_error(proto, exc, self._error_bodies.get(path))

    @staticmethod
    def _send_error(
        proto: Exchange,
        err: HttpError,
        error_body: Callable[[HttpError], bytes] | None = None,
    ) -> None:
        body = error_body(err) if error_body is not None else err.body()
        proto.response_bytes(err.status, JSON_HEADERS + err.headers, body)

    async def _read_body(self, scope: Scope, proto: Exchange) -> bytes:
        declared = scope.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await discard_body(proto, _DRAIN_BYTES)
            raise HttpError(
                413,
                f"request body of {declared} bytes exceeds the limit of "
                f"{self.max_body_bytes} bytes",
                code="request_too_large",
            )
        if declared is not None:
            return await proto()
        parts: list[bytes] = []
        size = 0
        async for part in proto:
            size += len(part)
            if size > self.max_body_bytes:
                await discard_body(proto, _DRAIN_BYTES)
                raise HttpError(
                    413,
                    f"request body exceeds the limit of {self.max_body_bytes} bytes",
                    code="request_too_large",
                )
            parts.append(part)
        return b"".join(parts)

    # ------------------------------------------------------------------ generation

    def add_surface(self, method: str, path: str, surface: Surface) -> None:
        """Serve another generation route (another API's shapes over the same pipelines)."""
        self._routes[(method, path)] = self._bind(surface)
        self._paths.add(path)
        self._error_bodies[path] = surface.error_body
        self._endpoints[path] = surface.endpoint

    def _bind(self, surface: Surface) -> Handler:
        async def handler(scope: Scope, proto: Exchange, principal: Principal) -> None:
            await self._generate(scope, proto, surface, principal)

        return handler

    def _openai_surface(self, *, is_chat: bool) -> Surface:
        def decode(body: bytes) -> SurfaceRequest:
            request: ChatCompletionRequest | CompletionRequest = (
                decode_json(_chat_decoder, body)
                if is_chat
                else decode_json(_completion_decoder, body)
            )
            nvext = request.nvext
            priority = nvext.priority if nvext is not None else None
            key = getattr(request, "prompt_cache_key", None)
            return SurfaceRequest(
                request.model, request.stream, request, priority,
                body_session_key(key, "prompt_cache_key"),
            )  # fmt: skip

        async def serve(
            proto: Exchange,
            pipeline: TokensPipeline | TextPipeline,
            req: SurfaceRequest,
            body: bytes,
            ctx: RequestContext,
            session_id: str | None,
        ) -> None:
            if isinstance(pipeline, TextPipeline):
                await self._responder.relay_text(proto, pipeline, body, req.request, ctx)
            else:
                nvext = req.request.nvext
                if nvext is not None and nvext.extra_fields and "routing" in nvext.extra_fields:
                    ctx.metadata[EXPLAIN_ROUTING_METADATA] = True
                await self._responder.serve_tokens(proto, pipeline, req.request, ctx, session_id)

        endpoint = "chat_completions" if is_chat else "completions"
        return Surface(
            endpoint, ModelKind.CHAT if is_chat else ModelKind.COMPLETIONS, decode, serve
        )

    async def _serve_on_served_card(
        self,
        surface: Surface,
        proto: Exchange,
        pipeline: Pipeline,
        request: SurfaceRequest,
        body: bytes,
        ctx: RequestContext,
        session_id: str | None,
    ) -> None:
        """``surface.serve``, started again on the model's pipeline of the moment when the
        request found no instance of its own card before anything was sent.

        During a rolling upgrade a request is preprocessed with the card the model served when
        it arrived; if that card's last instances leave while it is being routed, the model
        has switched to the new card, whose instances the request may not reach (its tokens
        and limits are the old card's). It is not lost: it runs again from the start with the
        new card's pipeline (templating and tokenization included). Bounded: a switch per try.
        """
        for attempt in range(1 + _CARD_SWITCH_RETRIES):
            try:
                await surface.serve(proto, pipeline, request, body, ctx, session_id)
                return
            except NoInstanceAvailable:
                if attempt == _CARD_SWITCH_RETRIES or ctx.is_cancelled:
                    raise
                try:
                    current = self.manager.get_engine(surface.serves, request.model)
                except TurnoutError:  # the model itself is gone: the first answer stands
                    current = pipeline
                if current is pipeline:
                    raise
                log.info(
                    "request %s: its card has no instance left and %s switched cards; "
                    "running it on the served card",
                    ctx.request_id,
                    request.model,
                )
                pipeline = current

    @staticmethod
    def _request_span(scope: Scope, ctx: RequestContext) -> Any:
        """The request's server span (tracing is on); its route span then says why, so the
        routers explain their decision."""
        path = scope.path.rstrip("/")
        span = tracing.start_request_span(
            ctx,
            f"{scope.method} {path}",
            scope.headers,
            {"http.request.method": scope.method, "http.route": path,
             "turnout.request_id": ctx.request_id},
        )  # fmt: skip
        if span is not None:
            ctx.metadata[EXPLAIN_ROUTING_METADATA] = True
        return span

    async def _generate(
        self, scope: Scope, proto: Exchange, surface: Surface, principal: Principal
    ) -> None:
        endpoint = surface.endpoint
        # The metrics label: a served model's name once resolved, never a client's string.
        model = UNKNOWN_MODEL
        stream = False
        status = 200
        # A client's x-request-id is sent back as it came and starts the id every log line of
        # the request carries, in every process; it is never trusted to be unique: ids key the
        # router's bookings, and two requests sharing one would share (and free) one booking.
        client_id = scope.headers.get("x-request-id")
        bad_client_id = client_id is not None and not valid_request_id(client_id)
        if bad_client_id:
            client_id = None
        ctx = RequestContext(f"{client_id}.{new_request_id()}" if client_id else new_request_id())
        proto.add_response_header(REQUEST_ID_HEADER, client_id or ctx.request_id)
        bind_request(ctx)
        span = self._request_span(scope, ctx) if tracing.enabled() else None
        started = time.perf_counter()
        task = asyncio.current_task()
        assert task is not None
        client_gone = False

        def on_disconnect(_: object) -> None:
            nonlocal client_gone
            client_gone = True
            ctx.cancel()
            task.cancel()

        disconnect = proto.client_disconnect()
        disconnect.add_done_callback(on_disconnect)
        account: TenantAccount | None = None
        try:
            if bad_client_id:
                raise HttpError(
                    400,
                    f"the x-request-id header must be 1 to {MAX_REQUEST_ID_CHARS} visible "
                    "ASCII characters",
                    param=REQUEST_ID_HEADER,
                )
            if self.draining:
                raise unavailable("this frontend is shutting down; send the request to another")
            body = await self._read_body(scope, proto)
            log_prompt("body", ctx.request_id, body)
            request = surface.decode(body)
            stream = request.stream
            pipeline = self.manager.get_engine(surface.serves, request.model)
            model = request.model
            ctx.metadata[MODEL_METADATA] = model
            if span is not None:
                span.set_attribute("gen_ai.request.model", model)
                span.set_attribute("turnout.stream", stream)
            if principal.tenant != DEFAULT_TENANT:
                ctx.metadata[TENANT_METADATA] = principal.tenant
            metrics = self.metrics.model(model)
            account = self.access.open_account(principal, ctx)
            ticket = None
            if self.admission is not None:
                priority = request_priority(
                    request.priority, principal.policy, authenticated=self.access.auth is not None
                )
                with tracing.traced(ctx, "admission"):
                    ticket = await self.admission.acquire(model, priority)
                metrics.queue_wait.observe(ticket.waited)
            inflight = metrics.inflight
            inflight.inc()
            try:
                session_id = session_id_from(scope.headers) or request.session_key
                if session_id is not None and principal.tenant != DEFAULT_TENANT:
                    # Sessions are a tenant's own: no other tenant can steer to, or evict,
                    # its bindings by sending the same id.
                    session_id = f"{principal.tenant}\0{session_id}"
                await self._serve_on_served_card(
                    surface, proto, pipeline, request, body, ctx, session_id
                )
            finally:
                inflight.dec()
                if ticket is not None:
                    ticket.release()
        except asyncio.CancelledError:
            if not client_gone:
                raise
            status = 499
            task.uncancel()
            log.debug("request %s: client disconnected; work cancelled", ctx.request_id)
        except ClientDisconnected as exc:  # gone (or stalled) while its response was written
            status = exc.status
            ctx.cancel()
            log.debug("request %s: %s; work cancelled", ctx.request_id, exc)
        except Exception as exc:  # every failure becomes one HTTP error
            err = to_http_error(exc, reject_status=self.reject_status)
            status = err.status
            if isinstance(exc, FrontendOverloaded):
                self.metrics.rejections.labels(model, exc.reason).inc()
                if exc.waited:
                    self.metrics.model(model).queue_wait.observe(exc.waited)
            elif status in (503, 429):
                self.metrics.rejections.labels(model, "unavailable").inc()
            proto.response_bytes(err.status, JSON_HEADERS + err.headers, surface.error_body(err))
        finally:
            disconnect.remove_done_callback(on_disconnect)
            self.metrics.count_request(model, endpoint, stream, status)
            self.access.close(account, principal, status)
            if span is not None:
                span.set_attribute("http.response.status_code", status)
                tracing.end_span(
                    span, RuntimeError(f"answered {status}") if status >= 500 else None
                )
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "request %s: %s%s answered %d in %.3f s",
                    ctx.request_id,
                    scope.path,
                    " (stream)" if stream else "",
                    status,
                    time.perf_counter() - started,
                )

    # ------------------------------------------------------------------ response store

    async def _create_conversation(
        self, scope: Scope, proto: Exchange, principal: Principal
    ) -> None:
        """``POST /v1/conversations``, under its tenant's account (``AccessGate.accounted``)."""
        store = self._store
        await self.access.accounted(
            principal, partial(store.create_conversation, scope, proto, principal)
        )


#: How much of a refused (too large) body is read and dropped before the 413 goes out: a
#: server that closes with the client's bytes unread makes the kernel reset the connection,
#: and the client sees a reset instead of the 413. Past this, the reset is the lesser cost.
_DRAIN_BYTES = 4 << 20

#: How many times one request may follow its model to another card (``_serve_on_served_card``).
_CARD_SWITCH_RETRIES = 2
