"""Per-model generation pipelines (built by ``models.factory`` for the model watcher).

Tokens-input models get the full pipeline::

    preprocessor -> backend (detokenize, stop) -> migration -> prefill router -> router -> worker

The prefill router (``router.prefill_router``) stays out of the way until the model's first
prefill worker appears (disaggregated serving).

Text-input models do their own pre/post-processing; the frontend only routes the OpenAI
request to a worker and relays the OpenAI chunks it streams back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from turnout.errors import NoInstanceAvailable
from turnout.llm.backend import Backend, DecodedDelta, StreamDecoder
from turnout.llm.migration import Migration, deadline_stream
from turnout.llm.preprocessor import Preprocessor
from turnout.protocols.llm import FinishReason, PreprocessedRequest
from turnout.protocols.model import ModelDeploymentCard
from turnout.protocols.openai import ChatCompletionRequest, CompletionRequest
from turnout.router.push_router import InstanceSource, PushRouter
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

    async def preprocess(
        self, request: ChatCompletionRequest | CompletionRequest
    ) -> PreprocessedRequest:
        if isinstance(request, ChatCompletionRequest):
            pre = await self.preprocessor.preprocess_chat(request)
        else:
            pre = await self.preprocessor.preprocess_completion(request)
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

    def generate(self, body: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        if self.gate is not None:
            self.gate.check()
        if self.request_timeout > 0:
            # ``RequestTimedOut`` past it: 504 before the first chunk, an SSE error event
            # after (``http.errors.to_http_error``).
            return deadline_stream(self.router.generate(body, ctx), self.request_timeout, ctx)
        return self.router.generate(body, ctx)
