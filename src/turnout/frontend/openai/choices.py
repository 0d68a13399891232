"""``n`` > 1: one request, several choices, for every engine.

The frontend fans the preprocessed request out into ``n`` sub-requests that differ only in
their sampling seed (the request's ``seed`` + i, or a random base), each with its own context
(its own id: routers book, and workers run, each on its own), routed like any request (they
share the prompt, so KV routing sends them where it is cached). Their decoded deltas meet in
one bounded queue and become one response: whole, with ``choices`` in index order, or
streamed, each chunk naming its ``index`` and each choice finishing on its own. Usage counts
the prompt once and the completion tokens of all choices.

A choice that fails before any choice produced a token fails the request (a status and an
error body); later, the failure is an in-band SSE error. The client leaving, or any early end,
cancels every sub-request.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import msgspec

from turnout.frontend.http.errors import to_http_error, worker_error
from turnout.frontend.metrics.frontend import StreamTimer
from turnout.frontend.models.pipeline import Generation, TokensPipeline
from turnout.frontend.openai.choice_output import ChoiceOutput, WholeChoice, choice_output
from turnout.frontend.openai.chunk_writer import (
    JSON_HEADERS,
    SSE_DONE,
    SSE_HEADERS,
    ChunkWriter,
    answered_service_tier,
    make_usage,
    sse,
    whole_response,
)
from turnout.llm.backend import DecodedDelta
from turnout.protocols.llm import FinishReason, PreprocessedRequest
from turnout.protocols.openai import ChatCompletionRequest, CompletionRequest
from turnout.runtime.context import RequestContext
from turnout.runtime.http import Exchange

#: Deltas buffered per choice before the slowest reader holds the choices back.
_QUEUE_PER_CHOICE = 16


@dataclass(slots=True)
class _Choice:
    index: int
    generation: Generation
    ctx: RequestContext
    output: ChoiceOutput
    finish: FinishReason | None = None


#: What a pump sends: a delta, its choice's end (None), or the exception that ended it.
_Event = tuple[int, DecodedDelta | BaseException | None]


async def serve_choices(
    proto: Exchange,
    pipeline: TokensPipeline,
    request: ChatCompletionRequest | CompletionRequest,
    pre: PreprocessedRequest,
    ctx: RequestContext,
    timer: StreamTimer,
    nvext: Any,
) -> int:
    """Answer ``request`` (``n`` > 1) with its choices; returns the output tokens of all.

    ``nvext`` builds the response's ``nvext`` from a context (the first choice's)."""
    n = request.n or 1
    seed = pre.sampling_options.seed
    base = seed if seed is not None else random.getrandbits(31)
    choices: list[_Choice] = []
    for i in range(n):
        sampling = msgspec.structs.replace(pre.sampling_options, seed=base + i)
        sub = msgspec.structs.replace(pre, sampling_options=sampling)
        sub_ctx = RequestContext(f"{ctx.request_id}-{i}")
        output = choice_output(pipeline, request, sub, keep=not request.stream)
        choices.append(_Choice(i, pipeline.generate(sub, sub_ctx), sub_ctx, output))
    queue: asyncio.Queue[_Event] = asyncio.Queue(maxsize=_QUEUE_PER_CHOICE * n)
    pumps = [asyncio.create_task(_pump(c, queue)) for c in choices]
    try:
        if request.stream:
            await _stream(proto, request, choices, queue, timer, nvext)
        else:
            await _whole(proto, request, choices, queue, timer, nvext)
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for choice in choices:
            if choice.finish is None:
                choice.ctx.cancel()
            await choice.generation.aclose()
    return sum(c.generation.decoder.num_output_tokens for c in choices)


async def _pump(choice: _Choice, queue: asyncio.Queue[_Event]) -> None:
    try:
        async for delta in choice.generation:
            await queue.put((choice.index, delta))
            if delta.finish_reason is not None:
                break
        await queue.put((choice.index, None))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # handed to the writer, which answers it
        await queue.put((choice.index, exc))


def _usage(choices: list[_Choice]) -> Any:
    first = choices[0].generation
    return make_usage(
        len(first.request.token_ids),
        sum(c.generation.decoder.num_output_tokens for c in choices),
        first.decoder.cached_tokens,
    )


async def _whole(
    proto: Exchange,
    request: ChatCompletionRequest | CompletionRequest,
    choices: list[_Choice],
    queue: asyncio.Queue[_Event],
    timer: StreamTimer,
    nvext: Any,
) -> None:
    open_choices = len(choices)
    while open_choices:
        index, event = await queue.get()
        choice = choices[index]
        if isinstance(event, BaseException):
            raise event
        if event is None:
            open_choices -= 1
            choice.finish = choice.finish or FinishReason.STOP
            continue
        if event.text:
            timer.on_tokens()
        choice.output.take(event)
        if event.finish_reason is FinishReason.ERROR:
            raise worker_error(event.error or "")
        if event.finish_reason is not None:
            choice.finish = event.finish_reason
    body = whole_response(
        model=request.model,
        is_chat=isinstance(request, ChatCompletionRequest),
        choices=[_whole_choice(c) for c in choices],
        usage=_usage(choices),
        nvext=nvext(choices[0].ctx),
        service_tier=answered_service_tier(request),
    )
    proto.response_bytes(200, JSON_HEADERS, body)


async def _stream(
    proto: Exchange,
    request: ChatCompletionRequest | CompletionRequest,
    choices: list[_Choice],
    queue: asyncio.Queue[_Event],
    timer: StreamTimer,
    nvext: Any,
) -> None:
    is_chat = isinstance(request, ChatCompletionRequest)
    tier = answered_service_tier(request)
    lead = ChunkWriter(request.model, is_chat, service_tier=tier)
    writers = [
        ChunkWriter(
            request.model, is_chat, lead.response_id, index=i, created=lead.created,
            service_tier=tier,
        )
        for i in range(len(choices))
    ]  # fmt: skip
    # The status line waits for the first event: a failure before any token is a status.
    first = await queue.get()
    index, event = first
    if isinstance(event, BaseException):
        raise event
    if isinstance(event, DecodedDelta) and event.finish_reason is FinishReason.ERROR:
        raise worker_error(event.error or "")
    send = proto.response_stream(200, SSE_HEADERS).send_bytes
    if is_chat:
        for writer in writers:
            await send(writer.role())
    open_choices = len(choices)
    pending: tuple[int, DecodedDelta | BaseException | None] | None = first
    while open_choices:
        index, event = pending if pending is not None else await queue.get()
        pending = None
        choice, writer = choices[index], writers[index]
        if isinstance(event, BaseException):
            await send(sse(to_http_error(event).body()))
            await send(SSE_DONE)
            return
        if event is None:
            if choice.finish is None:
                await _finish(send, choice, writer, FinishReason.STOP, nvext)
            open_choices -= 1
            continue
        output = choice.output
        if output.plain:
            if event.text:
                timer.on_tokens()
                await send(writer.text(event.text))
        elif event.text or event.token_ids:
            piece = output.take(event)
            if piece:
                timer.on_tokens()
                await send(writer.piece(piece))
        if event.finish_reason is FinishReason.ERROR:
            await send(sse(worker_error(event.error or "").body()))
            await send(SSE_DONE)
            return
        if event.finish_reason is not None:
            await _finish(send, choice, writer, event.finish_reason, nvext)
    opts = request.stream_options
    if opts is not None and opts.include_usage:
        await send(lead.usage(_usage(choices)))
    await send(SSE_DONE)


def _whole_choice(choice: _Choice) -> WholeChoice:
    choice.output.end()
    return choice.output.whole(choice.finish or FinishReason.STOP)


async def _finish(
    send: Any, choice: _Choice, writer: ChunkWriter, reason: FinishReason, nvext: Any
) -> None:
    """A streamed choice's last chunks: what its parser held, then its finish reason."""
    choice.finish = reason
    tail = choice.output.end()
    if tail:
        await send(writer.piece(tail))
    await send(writer.finish(choice.output.finish_reason(reason), nvext(choice.ctx)))
