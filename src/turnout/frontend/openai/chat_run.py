"""A chat request run for a surface that writes its own shapes (the Responses API, Anthropic
messages): the same preprocessing, routing, migration and output parsing as chat completions,
delivered as :class:`~.choice_output.ChoicePiece` s.

Use::

    run = await ChatRun.start(pipeline, chat_request, ctx, metrics)  # raises before any output
    try:
        async for piece in run.pieces():   # mid-stream failures raise HttpError
            ...
        run.finish_reason, run.usage       # once pieces() is exhausted
    finally:
        await run.aclose()                  # always: stops the work on the worker
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import msgspec

from turnout.frontend.http.errors import HttpError, to_http_error, worker_error
from turnout.frontend.metrics.frontend import FrontendMetrics, ModelMetrics, StreamTimer
from turnout.frontend.models.pipeline import Generation, TokensPipeline
from turnout.frontend.openai.choice_output import (
    ChoiceOutput,
    ChoicePiece,
    WholeChoice,
    choice_output,
)
from turnout.frontend.openai.chunk_writer import JSON_HEADERS, SSE_HEADERS, make_usage
from turnout.llm.backend import DecodedDelta
from turnout.protocols.llm import FinishReason
from turnout.protocols.openai import ChatCompletionRequest, Usage
from turnout.router.push_router import check_pinned
from turnout.runtime.context import RequestContext
from turnout.runtime.http import Exchange

_json = msgspec.json.Encoder()


class ChatRun:
    """One running chat request (one choice)."""

    __slots__ = ("_first", "_metrics", "_reason", "_timer", "generation", "output", "request")

    def __init__(
        self,
        request: ChatCompletionRequest,
        generation: Generation,
        output: ChoiceOutput,
        first: DecodedDelta,
        metrics: ModelMetrics,
        timer: StreamTimer,
    ) -> None:
        self.request = request
        self.generation = generation
        self.output = output
        self._first: DecodedDelta | None = first
        self._metrics = metrics
        self._timer = timer
        self._reason = FinishReason.STOP

    @classmethod
    async def start(
        cls,
        pipeline: TokensPipeline,
        request: ChatCompletionRequest,
        ctx: RequestContext,
        metrics: FrontendMetrics,
        session_id: str | None = None,
    ) -> ChatRun:
        """Preprocess, route and await the first output: every failure until then raises
        (and becomes the response's status)."""
        pre = await pipeline.preprocess(request)
        pre.session_id = session_id
        if pre.backend_instance_id is not None:
            check_pinned(pipeline.client, pre.backend_instance_id, f"model {request.model}")
        model_metrics = metrics.model(request.model)
        model_metrics.input_tokens.observe(len(pre.token_ids))
        timer = StreamTimer(model_metrics)
        output = choice_output(pipeline, request, pre)
        generation = pipeline.generate(pre, ctx)
        try:
            first = await anext(generation.__aiter__())
            if first.finish_reason is FinishReason.ERROR and not first.token_ids:
                raise worker_error(first.error or "")
        except BaseException:
            await generation.aclose()
            raise
        return cls(request, generation, output, first, model_metrics, timer)

    async def pieces(self) -> AsyncIterator[ChoicePiece]:
        """The choice's pieces (never empty ones), the parser's held text last."""
        delta = self._first
        self._first = None
        deltas = self.generation.__aiter__()
        while delta is not None:
            if delta.text or delta.token_ids:
                piece = self.output.take(delta)
                if piece:
                    self._timer.on_tokens()
                    yield piece
            if delta.finish_reason is not None:
                if delta.finish_reason is FinishReason.ERROR:
                    raise worker_error(delta.error or "")
                self._reason = delta.finish_reason
                break
            delta = await anext(deltas, None)
        tail = self.output.end()
        if tail:
            yield tail

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish reason (``tool_calls`` once the model called a tool)."""
        return self.output.finish_reason(self._reason)

    @property
    def stopped_by_limit(self) -> bool:
        return self._reason is FinishReason.LENGTH

    @property
    def usage(self) -> Usage:
        decoder = self.generation.decoder
        return make_usage(
            len(self.generation.request.token_ids),
            decoder.num_output_tokens,
            decoder.cached_tokens,
        )

    def whole(self) -> WholeChoice:
        """Everything the choice said (after ``pieces()`` is exhausted)."""
        return self.output.whole(self._reason)

    async def aclose(self) -> None:
        await self.generation.aclose()
        decoder = self.generation.decoder
        self._metrics.output_tokens.observe(decoder.num_output_tokens)
        if decoder.cached_tokens:
            self._metrics.cached_tokens.inc(decoder.cached_tokens)
        self._metrics.duration.observe(time.perf_counter() - self._timer.start)


class EventWriter(Protocol):
    """A surface's writer: it turns pieces into its own body or events. ``events`` holds the
    encoded events not sent yet (None: a whole response, no events)."""

    events: list[bytes] | None

    def add(self, piece: ChoicePiece) -> None: ...

    def fail(self, err: HttpError) -> None: ...


async def write_run(
    proto: Exchange,
    run: ChatRun,
    writer: EventWriter,
    *,
    start: Callable[[], None],
    finish: Callable[[], dict[str, Any] | Awaitable[dict[str, Any]]],
) -> None:
    """Answer with ``run`` through ``writer``: whole, the body ``finish`` returns; streamed,
    ``start``'s events at once, each piece's as it comes, then ``finish``'s (or, when the run
    fails midway, ``fail``'s). ``finish`` may be a coroutine function: what it awaits (the
    response store's write) comes before the final body or event goes out."""
    events = writer.events
    if events is None:
        async for piece in run.pieces():
            writer.add(piece)
        proto.response_bytes(200, JSON_HEADERS, _json.encode(await _settled(finish())))
        return
    send = proto.response_stream(200, SSE_HEADERS).send_bytes

    async def flush() -> None:
        for event in events:
            await send(event)
        events.clear()

    start()
    await flush()
    try:
        async for piece in run.pieces():
            writer.add(piece)
            await flush()
        await _settled(finish())
    except Exception as exc:  # mid-stream failure: tell the client in-band
        writer.fail(to_http_error(exc))
    await flush()


async def _settled(body: dict[str, Any] | Awaitable[dict[str, Any]]) -> dict[str, Any]:
    return await body if inspect.isawaitable(body) else body
