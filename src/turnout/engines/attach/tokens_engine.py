"""One attached server in tokens mode: an ``Engine`` whose ``generate`` relays token ids to
the server's own token-in/token-out API and streams the ids it answers.

What the engine does per request::

    PreprocessedRequest ── refusal? ──▶ ERROR bad_request (never sent)
         │
         ▼ api.make_body                 Upstream.stream_lines (deadlines, pool)
    POST {generate_path} ───────────────▶ server ──▶ SSE lines ──▶ api decoder ──▶ TokenStream
                                                                              (stop ids, usage)

How a failure ends the stream, and what the frontend then does:

* the server refused the request (HTTP 4xx, or a client error in-band): ``bad_request``
  with the server's message and URL (400 to the client, never retried);
* the server failed (5xx, no connection, a connection cut mid-stream, a deadline passed, an
  answer that is not its API's): ``engine_failed``, so the frontend migrates the request
  (prompt plus the tokens already streamed) to another instance; and a health check runs
  at once, so a dead server leaves discovery within one probe;
* too many requests in flight (``pool_size`` relayed + ``max_waiting`` waiting for a
  connection): ``overloaded`` (503).

Leaving early (the client went, a stop id arrived) closes the upstream connection: the
server stops generating (llama.cpp frees the slot, vLLM and SGLang abort the request).

Background tasks, started by ``start``: the health check (``health_path`` every
``health_interval``; one unanswered connection, or two failed checks in a row, is the
engine's failure: the worker takes the instance out of discovery and the supervisor waits
for the server to come back) and the load poll (the server's metrics every
``load_interval``, under the probe deadline, published as ``LoadReport``). With native KV
events configured, a subscriber per publisher feeds the router (``kv_events``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from turnout.protocols.kv import KvEventBatch, KvSnapshot, LoadReport
from turnout.protocols.llm import (
    CompletionUsage,
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
)
from turnout.protocols.model import ModelDeploymentCard
from turnout.runtime import tracing
from turnout.runtime.context import RequestContext

from ..base import Engine
from .api_base import TokensApi, TokenStream
from .kv_events import KvEventsFeed
from .upstream import Deadlines, Unreachable, Upstream, UpstreamError, UpstreamStatus, sse_payload

log = logging.getLogger("turnout.attach")

#: Failed health checks in a row that set the server aside (an unanswered connection: one).
HEALTH_FAILURES = 2


class AttachedEngine(Engine):
    """Relays requests to the server at ``url`` through ``api`` (see the module doc).

    ``card`` is the card to publish (built by the supervisor from the server's description
    and ``--tokenizer``); ``kv`` the native KV-events feed, when configured.
    """

    def __init__(
        self,
        *,
        url: str,
        api: TokensApi,
        card: ModelDeploymentCard,
        served_name: str,
        deadlines: Deadlines,
        pool_size: int = 64,
        max_waiting: int = 256,
        health_interval: float = 2.0,
        load_interval: float = 1.0,
        kv: KvEventsFeed | None = None,
    ) -> None:
        if health_interval <= 0 or load_interval <= 0:
            raise ValueError("health_interval and load_interval must be positive")
        self.url = url
        self.api = api
        self.card = card
        self.served_name = served_name
        self.upstream = Upstream(url, deadlines, pool_size=pool_size)
        #: Requests in flight past which new ones are refused as overloaded.
        self.bound = pool_size + max_waiting
        self.health_interval = health_interval
        self.load_interval = load_interval
        self.kv = kv
        self.in_flight = 0
        self.worker_id: int | None = None
        self._sink: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._check_now = asyncio.Event()
        self._load_warned = False

    # ------------------------------------------------------------ lifecycle

    def set_event_sink(self, sink: Any) -> None:
        """Where load reports (and translated KV events) go: the worker's event plane."""
        self._sink = sink

    def bind_instance(self, instance_id: int) -> None:
        self.worker_id = instance_id
        if self.kv is not None:
            self.kv.bind(instance_id)

    def model_card_template(self) -> ModelDeploymentCard:
        return self.card

    async def start(self) -> None:
        await self.upstream.open()
        if self.kv is not None:
            await self.kv.start(self._publish_kv)
        self._spawn(self._health_loop(), "health")
        self._spawn(self._load_loop(), "load")

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if self.kv is not None:
            await self.kv.stop()
        await self.upstream.close()

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro, name=f"attach-{what}"))

    def kv_snapshot(self, dp_rank: int = 0) -> KvSnapshot:
        """The router's resync: the blocks the KV feed holds for ``dp_rank``."""
        if self.kv is None:
            return KvSnapshot(worker_id=self.worker_id or 0, dp_rank=dp_rank, next_event_id=0,
                              events=[])  # fmt: skip
        return self.kv.snapshot(dp_rank)

    def _publish_kv(self, batch: KvEventBatch) -> None:
        if self._sink is not None and self.worker_id is not None:
            self._sink.publish_kv(batch)

    # ------------------------------------------------------------ health and load

    def check_soon(self) -> None:
        """Run a health check now (a request to the server just failed)."""
        self._check_now.set()

    async def check_health(self) -> str | None:
        """One health check: None when the server answered 2xx, else why not."""
        try:
            await self.upstream.call("GET", self.api.health_path)
        except UpstreamError as exc:
            return str(exc)
        return None

    async def _health_loop(self) -> None:
        failures = 0
        while self.failure is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.health_interval):
                    await self._check_now.wait()
            self._check_now.clear()
            try:
                await self.upstream.call("GET", self.api.health_path)
            except Unreachable as exc:
                self.report_failure(f"{self.url} does not answer ({exc.detail})")
                return
            except UpstreamError as exc:
                failures += 1
                if failures >= HEALTH_FAILURES:
                    self.report_failure(f"{self.url} failed its health check ({exc.detail})")
                    return
                continue
            failures = 0

    async def _load_loop(self) -> None:
        while True:
            try:
                numbers = await self.api.load(self.upstream)
            except UpstreamError as exc:
                if not self._load_warned:
                    self._load_warned = True
                    log.warning("%s: cannot read the server's load (%s)", self.url, exc.detail)
            else:
                self._publish_load(numbers.num_running, numbers.num_waiting, numbers.kv_usage,
                                   numbers.total_kv_blocks)  # fmt: skip
            await asyncio.sleep(self.load_interval)

    def _publish_load(self, running: int, waiting: int, kv_usage: float, blocks: int) -> None:
        if self._sink is None or self.worker_id is None:
            return
        report = LoadReport(
            worker_id=self.worker_id,
            num_running=running,
            num_waiting=waiting,
            kv_usage=kv_usage,
            total_kv_blocks=blocks or (self.card.runtime_config.total_kv_blocks or 0),
            busy=self.in_flight >= self.bound,
        )
        try:
            self._sink.publish_load(report)
        except Exception:  # a sink's failure must not stop the poll
            log.exception("%s: publishing a load report failed", self.url)

    # ------------------------------------------------------------ requests

    def _max_tokens(self, request: PreprocessedRequest) -> int:
        room = max(1, self.card.context_length - len(request.token_ids))
        asked = request.stop_conditions.max_tokens
        return room if asked is None else max(0, min(asked, room))

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        n_prompt = len(request.token_ids)
        refusal = self.api.refusal(request)
        if refusal is not None:
            yield _error(f"{self.api.label} at {self.url} cannot honour {refusal}",
                         ErrorKind.BAD_REQUEST, n_prompt)  # fmt: skip
            return
        if self.failure is not None:
            yield _error(self.failure, ErrorKind.ENGINE_FAILED, n_prompt)
            return
        max_tokens = self._max_tokens(request)
        if max_tokens == 0:
            yield LLMEngineOutput(
                finish_reason=FinishReason.LENGTH,
                usage=CompletionUsage(prompt_tokens=n_prompt, completion_tokens=0),
            )
            return
        if self.in_flight >= self.bound:
            yield _error(f"{self.in_flight} requests in flight to {self.url}; try again later",
                         ErrorKind.OVERLOADED, n_prompt)  # fmt: skip
            return
        body = self.api.make_body(
            request, served_name=self.served_name, max_tokens=max_tokens, rid=ctx.request_id
        )
        decoder = self.api.decoder(request)
        stream = TokenStream(request)
        self.in_flight += 1
        path = self.api.generate_path
        span = (
            None
            if ctx.trace is None
            else tracing.start_span(
                ctx,
                "upstream",
                {"http.request.method": "POST", "url.full": self.url + path},
                client=True,
            )
        )
        # The frontend's attempt, or this worker's upstream span: the server's spans join.
        lines = self.upstream.stream_lines(path, body, ctx.traceparent)
        failure: UpstreamError | None = None
        try:
            async for line in lines:
                event = sse_payload(line)
                if event is None:
                    continue
                piece = decoder.feed(*event)
                if piece is None:
                    continue
                for output in stream.push(piece):
                    yield output
                if stream.finished:
                    return
            yield _error(f"{self.url} ended the stream without a final event",
                         ErrorKind.ENGINE_FAILED, n_prompt, stream)  # fmt: skip
        except UpstreamStatus as exc:
            failure = exc
            if 400 <= exc.status < 500:
                yield _error(f"{self.api.label} at {self.url} refused the request: "
                             f"HTTP {exc.status}: {exc.message}",
                             ErrorKind.BAD_REQUEST, n_prompt, stream)  # fmt: skip
            else:
                self.check_soon()
                yield _error(str(exc), ErrorKind.ENGINE_FAILED, n_prompt, stream)
        except UpstreamError as exc:
            # Unreachable, cut, past a deadline, garbage: the frontend moves the request
            # on; a health check now decides whether the server is set aside.
            failure = exc
            log.warning("request %s: %s", ctx.request_id, exc)
            self.check_soon()
            yield _error(str(exc), ErrorKind.ENGINE_FAILED, n_prompt, stream)
        finally:
            self.in_flight -= 1
            await lines.aclose()
            tracing.end_span(span, failure)


def _error(
    message: str, kind: ErrorKind, n_prompt: int, stream: TokenStream | None = None
) -> LLMEngineOutput:
    usage = stream.usage() if stream is not None else CompletionUsage(prompt_tokens=n_prompt)
    return LLMEngineOutput(
        finish_reason=FinishReason.ERROR, error=message, error_kind=kind.value, usage=usage
    )


__all__ = ["HEALTH_FAILURES", "AttachedEngine"]
