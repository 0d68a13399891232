"""Per-model generation pipelines (built by ``models.factory`` for the model watcher).

Tokens-input models get the full pipeline::

    preprocessor -> backend (detokenize, stop) -> migration -> prefill router -> router -> worker

The prefill router (``router.prefill_router``) stays out of the way until the model's first
prefill worker appears (disaggregated serving).

Text-input models do their own pre/post-processing; the frontend only routes the OpenAI
request to a worker and relays the OpenAI chunks it streams back.

Both keep tenants' prompts in their own cache spaces (``access.cache_space``): a tokens
pipeline salts the ``PreprocessedRequest`` it builds, a text pipeline sets the relayed body's
``cache_salt`` (which the server behind the worker reads: vLLM's partitions its prefix cache).
Both refuse a salt, the tenant's or the client's, to a model whose card says its engine cannot
partition its cache (``llm.cache_salt``), with the same messages.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from turnout.errors import NoInstanceAvailable, RequestError
from turnout.frontend.access.cache_space import CacheSpaces
from turnout.llm.backend import Backend, DecodedDelta, StreamDecoder
from turnout.llm.cache_salt import fields_cache_salt
from turnout.llm.migration import Migration, deadline_stream
from turnout.llm.preprocessor import Preprocessor
from turnout.protocols.llm import FinishReason, PreprocessedRequest
from turnout.protocols.model import ModelDeploymentCard
from turnout.protocols.openai import ChatCompletionRequest, CompletionRequest
from turnout.router.push_router import InstanceSource, PushRouter
from turnout.runtime import tracing
from turnout.runtime.context import RequestContext


class WorkerGate:
    """``--router-min-initial-workers``: a model answers 503 (with ``Retry-After``) until
    ``required`` of its instances have been up at once; from then on it stays open.

    Dynamo's watcher blocks the model's discovery while it waits; here the model is listed at
    once and refuses requests instead, so the watcher never stalls other models' events.
    """

    __slots__ = ("_client", "_open", "_required")

    def __init__(self, client: InstanceSource, required: int) -> None:
        self._client = client
        self._required = required
        self._open = False

    def check(self) -> None:
        if self._open:
            return
        up = len(self._client.instance_ids())
        if up >= self._required:
            self._open = True
            return
        raise NoInstanceAvailable(
            f"the model starts serving once {self._required} workers are up ({up} so far; "
            "--router-min-initial-workers)"
        )


class Generation:
    """One running request: its token-level request, the decoded deltas, and the decoder's
    counters (for usage). Always ``aclose()`` it, which stops the work on the worker."""

    __slots__ = ("_deltas", "decoder", "request")

    def __init__(
        self,
        request: PreprocessedRequest,
        decoder: StreamDecoder,
        deltas: AsyncIterator[DecodedDelta],
    ) -> None:
        self.request = request
        self.decoder = decoder
        self._deltas = deltas

    def __aiter__(self) -> AsyncIterator[DecodedDelta]:
        return self._deltas

    async def aclose(self) -> None:
        await self._deltas.aclose()  # type: ignore[attr-defined]


@dataclass(slots=True)
class TokensPipeline:
    """The full pipeline of one model for one request type (chat or completions)."""

    name: str
    card: ModelDeploymentCard
    preprocessor: Preprocessor
    backend: Backend
    migration: Migration
    client: InstanceSource
    is_chat: bool
    gate: WorkerGate | None = None
    #: Which cache space each request's prompt hashes into (its tenant's, by default).
    cache_spaces: CacheSpaces = field(default_factory=CacheSpaces)

    async def preprocess(
        self, request: ChatCompletionRequest | CompletionRequest, ctx: RequestContext | None
    ) -> PreprocessedRequest:
        """The request's token-level form, salted with its tenant's cache space (``ctx``
        None: the un-tenanted space, for a request that only counts its prompt's tokens)."""
        tenant = self.cache_spaces.tenant_of(ctx) if ctx is not None else None
        with tracing.traced(ctx, "preprocess") as span:
            if isinstance(request, ChatCompletionRequest):
                pre = await self.preprocessor.preprocess_chat(request, tenant)
            else:
                pre = await self.preprocessor.preprocess_completion(request, tenant)
            if span is not None:
                span.set_attribute("turnout.prompt_tokens", len(pre.token_ids))
        nvext = request.nvext
        if nvext is not None and nvext.request_timeout is not None:
            pre.request_timeout = nvext.request_timeout
        return pre

    def generate(self, request: PreprocessedRequest, ctx: RequestContext) -> Generation:
        decoder = self.backend.decoder(request)
        return Generation(request, decoder, self._run(request, decoder, ctx))

    async def _run(
        self, request: PreprocessedRequest, decoder: StreamDecoder, ctx: RequestContext
    ) -> AsyncIterator[DecodedDelta]:
        if self.gate is not None:
            self.gate.check()
        upstream = self.migration.generate(request, ctx)
        step = decoder.step
        try:
            async for output in upstream:
                delta = step(output)
                if delta.finish_reason is not None:
                    yield delta
                    return
                if delta.text or delta.log_probs:
                    # A token that ends mid-character has no text yet, but its log
                    # probability is owed to the client.
                    yield delta
            # The worker ended its stream without saying why: report it, don't invent "stop"
            # (``end`` also releases any text held back for a possible stop string).
            yield decoder.end(FinishReason.ERROR, "worker stream ended without a finish reason")
        finally:
            await upstream.aclose()  # type: ignore[attr-defined]


@dataclass(slots=True)
class TextPipeline:
    """Router only: the worker takes the OpenAI request and streams OpenAI chunks (JSON)."""

    name: str
    card: ModelDeploymentCard
    router: PushRouter[bytes, bytes]
    client: InstanceSource
    is_chat: bool
    gate: WorkerGate | None = None
    #: ``--request-timeout`` (0: none); the per-request ``nvext`` override is not read here
    #: (the body is relayed as it is).
    request_timeout: float = 0.0
    #: Which cache space each request's prompt hashes into (its tenant's, by default).
    cache_spaces: CacheSpaces = field(default_factory=CacheSpaces)

    def generate(self, body: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        if self.gate is not None:
            self.gate.check()
        tenant = self.cache_spaces.tenant_of(ctx)
        if tenant is not None or _may_salt(body):
            body = _salted_body(body, tenant, self.card)
        if self.request_timeout > 0:
            # ``RequestTimedOut`` past it: 504 before the first chunk, an SSE error event
            # after (``http.errors.to_http_error``).
            return deadline_stream(self.router.generate(body, ctx), self.request_timeout, ctx)
        return self.router.generate(body, ctx)


def _may_salt(body: bytes) -> bool:
    """Whether an un-tenanted body may carry a cache salt, so that ``_salted_body`` must read
    it; most do not, and are relayed unread. A key spelled with JSON escapes is not seen: its
    salt partitions only its own sender's prompts, unless it names a tenant's space, whose
    leading NUL JSON always escapes as ``\\u0000``."""
    return b"cache_salt" in body or b"\\u0000" in body


def _salted_body(body: bytes, tenant: str | None, card: ModelDeploymentCard) -> bytes:
    """A relayed OpenAI body with ``cache_salt`` set to ``tenant``'s cache space (None: the
    un-tenanted space), the client's own salt (``cache_salt`` or ``nvext.cache_salt``, which
    the relay drops with the rest of ``nvext``) within it. ``RequestError`` for a salt that
    ``fields_cache_salt`` refuses: a client's that could name another space, or any to a model
    that cannot partition its cache. A body that is not a JSON object goes as it is: the
    worker's relay refuses it."""
    try:
        doc: Any = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body
    if not isinstance(doc, dict):
        return body
    top = doc.get("cache_salt")
    nvext = doc.get("nvext")
    ext = nvext.get("cache_salt") if isinstance(nvext, dict) else None
    for param, value in (("cache_salt", top), ("nvext.cache_salt", ext)):
        if value is not None and not isinstance(value, str):
            raise RequestError(f"'{param}' must be a string", param=param)
    salt = fields_cache_salt(top, ext, tenant, card)
    if salt == top:
        return body
    doc["cache_salt"] = salt
    return msgspec.json.encode(doc)
