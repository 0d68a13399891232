"""Text mode: any OpenAI-compatible server, its chat and completions relayed as they are.

The card says ``Text`` input: the frontend does no templating or tokenizing for this model
and forwards the client's JSON body; the relay sends it to the server's
``/v1/chat/completions`` (a body with ``messages``) or ``/v1/completions``, always streamed
(the frontend folds the chunks into one answer for a client that did not ask for a stream),
and hands back each chunk's JSON untouched.

What the relay changes in the body: ``model`` (the server's own name for it: ``--model-name``
may publish another), ``stream`` and ``stream_options.include_usage`` (usage is always
counted), and turnout's own ``nvext`` is removed. ``cache_salt`` goes on as the frontend set
it (the tenant's space); the card says whether the server honours it (``text_card``). What it
refuses, before sending anything: ``n`` > 1 (the frontend folds one choice) and a body that is
not a JSON object.

Failures: a refusal, or an HTTP 4xx from the server, is the stream's only item: an OpenAI
error body with the status beside it (``{"error": {...}, "status": 400}``), which the
frontend answers as that 4xx (``frontend.openai.responder.text_refusal``). Anything else (no
connection, an HTTP 5xx, a broken stream) raises ``TextRelayFailed``, naming the server: a
500 before the first chunk, an SSE error event after.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from turnout.protocols.llm import PreprocessedRequest
from turnout.protocols.model import ModelCapabilities
from turnout.runtime.context import RequestContext

from .api_base import ChunkDecoder, LoadNumbers, ServerInfo, TokensApi, first_model
from .prometheus import parse_samples
from .upstream import Upstream, UpstreamError, UpstreamStatus, error_message, sse_payload

__all__ = ["SALT_PARTITIONING_OWNERS", "OpenAiApi", "TextRelayFailed", "refusal_chunk",
           "relay_handler"]  # fmt: skip

#: Load series of the servers that say (vLLM's and SGLang's); others report none.
_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
#: The servers (their ``/v1/models`` ``owned_by``) whose OpenAI routes partition the prefix
#: cache by the body's ``cache_salt``: vLLM's. SGLang's and llama.cpp's ignore it, so a text
#: card of theirs says it cannot, and the frontend refuses salted requests (tenants' among
#: them) rather than let them share one cache.
SALT_PARTITIONING_OWNERS = frozenset({"vllm"})


class TextRelayFailed(Exception):
    """The server failed the request (no connection, an HTTP 5xx, a broken stream)."""


class OpenAiApi(TokensApi):
    """An OpenAI-compatible server, as far as attach needs to know it in text mode: its
    model, health (``GET /v1/models`` answers) and load (vLLM's or SGLang's metrics when it
    has them). It takes no token requests."""

    name = "openai"
    label = "OpenAI-compatible server"
    generate_path = "/v1/completions"
    health_path = "/v1/models"

    def __init__(self, url: str) -> None:
        self.url = url
        self._metrics = True

    def capabilities(self) -> ModelCapabilities:
        return ModelCapabilities()

    async def describe(self, upstream: Upstream) -> ServerInfo:
        model = first_model(upstream.base_url, await upstream.get_json("/v1/models"))
        info = ServerInfo(api=self.name, served_name=str(model.get("id") or "model"))
        owner = model.get("owned_by")
        info.owned_by = owner if isinstance(owner, str) else None
        for key in ("max_model_len", "context_length", "context_window"):
            value = model.get(key)
            if isinstance(value, int) and value > 0:
                info.context_length = value
                break
        return info

    def refusal(self, request: PreprocessedRequest) -> str | None:
        return "token requests (this server is attached in text mode)"

    def make_body(
        self, request: PreprocessedRequest, *, served_name: str, max_tokens: int, rid: str
    ) -> dict[str, object]:
        raise TypeError("a text-mode server takes no token requests")

    def decoder(self, request: PreprocessedRequest) -> ChunkDecoder:
        raise TypeError("a text-mode server takes no token requests")

    async def tokenize(self, upstream: Upstream, text: str) -> list[int]:
        raise TypeError("text mode has no tokenizer check")

    async def load(self, upstream: Upstream) -> LoadNumbers:
        if not self._metrics:
            return LoadNumbers()
        try:
            samples = parse_samples(
                await upstream.get_text("/metrics"), (*_RUNNING, *_WAITING, *_KV)
            )
        except UpstreamStatus:
            self._metrics = False  # no metrics route: report no load from now on
            return LoadNumbers()
        return LoadNumbers(
            num_running=int(samples.total(*_RUNNING) or 0),
            num_waiting=int(samples.total(*_WAITING) or 0),
            kv_usage=min(1.0, max(0.0, samples.mean(*_KV) or 0.0)),
        )


def refusal_chunk(message: str, status: int = 400, param: str | None = None) -> bytes:
    """The item that answers a request with ``status`` (a 4xx) and ``message``."""
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return json.dumps({"error": error, "status": status}).encode()


def relay_handler(upstream: Upstream, served_name: str, on_broken: Any = None) -> Any:
    """The request-plane handler of a text-mode instance (see the module doc).
    ``on_broken()`` is called when the server failed a request (a health check follows)."""
    url = upstream.base_url

    async def handle(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        try:
            body = json.loads(payload)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            yield refusal_chunk("the request body is not a JSON object")
            return
        n = body.get("n")
        if n not in (None, 1):
            yield refusal_chunk(f"n={n}: a text-mode model ({url}) answers one choice per "
                                "request", param="n")  # fmt: skip
            return
        body.pop("nvext", None)
        body["model"] = served_name
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        # The frontend's attempt span: a server that traces continues the request's trace.
        lines = upstream.stream_lines(path, body, ctx.traceparent)
        try:
            async for line in lines:
                event = sse_payload(line)
                if event is None:
                    continue
                field, data = event
                if data == b"[DONE]":
                    return
                if field == "error" or data.startswith(b'{"error"'):
                    raise TextRelayFailed(f"{url} failed the request: {error_message(data)}")
                yield data
        except UpstreamStatus as exc:
            if 400 <= exc.status < 500:
                yield refusal_chunk(f"{url} refused the request: {exc.message}", exc.status)
                return
            if on_broken is not None:
                on_broken()
            raise TextRelayFailed(str(exc)) from None
        except UpstreamError as exc:
            if on_broken is not None:
                on_broken()
            raise TextRelayFailed(str(exc)) from None
        finally:
            await lines.aclose()

    return handle
