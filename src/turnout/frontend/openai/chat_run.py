"""One generation request run through a Tokens-input pipeline, for every surface: chat
completions, completions (``n`` >= 1), the Responses API and Anthropic messages.

``ChatRun`` owns the sequence every surface shares::

    preprocess -> pin check -> metrics -> each choice's output stage -> generate
    -> the first output (any failure until then raises: the response's status)
    -> every choice's deltas, as text or pieces, into the surface's writer
    -> close: stop the work on the workers, record the request's metrics

A surface only writes its own shapes, through a :class:`RunWriter` (``respond`` drives it):
whole, the body once every choice has ended; streamed, the writer's events as the choices
go, and a failure after the status line is an in-band error event.

``n`` > 1: the preprocessed request fans out into ``n`` sub-requests that differ only in
their sampling seed (the request's ``seed`` + i, or a random base), each with its own
context (its own id: routers book, and workers run, each on its own), routed like any
request (they share the prompt, so KV routing sends them where it is cached). Their deltas
meet in one bounded queue; each choice ends on its own. Usage counts the prompt once and the
completion tokens of all choices. Closing the run cancels every unfinished sub-request.

Tenants (``access.accounting``): when the request's context holds its tenant's account, the
prompt is charged once tokenized (past the tenant's token budget: refused, before any work
is routed), each delta's tokens as they come, and the usage (prompt, cached, output tokens)
is settled when the run closes.

Timing: the request's clock starts with the run (the request admitted, before templating
and tokenization, which the client waits for too, as Dynamo's frontend counts them); the
first token (``turnout_time_to_first_token_seconds``) and the gaps between tokens
(``..._inter_token_latency_seconds``) are taken when a delta brings tokens, before any
parser: every surface, whole or streamed, reports the same latencies for the same
generation, however long a parser holds text back.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec

from turnout.frontend.access.accounting import ACCOUNT_METADATA, TenantAccount
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
from turnout.protocols.llm import FinishReason, PreprocessedRequest
from turnout.protocols.openai import ChatCompletionRequest, CompletionRequest, Usage
from turnout.router.push_router import check_pinned
from turnout.runtime.context import EXPLAIN_ROUTING_METADATA, RequestContext
from turnout.runtime.http import ClientDisconnected, Exchange

#: Deltas buffered per choice (``n`` > 1) before the slowest reader holds the choices back.
_QUEUE_PER_CHOICE = 16

#: Sends bytes to the client (a streamed response's transport).
Send = Callable[[bytes], Awaitable[None]]
#: What a choice's pump hands over (``n`` > 1): its index and a delta, or what failed it.
_Event = tuple[int, DecodedDelta | Exception]


@dataclass(slots=True)
class Choice:
    """One choice of a run: its generation (a request of its own when ``n`` > 1), its
    context and its output stage."""

    index: int
    generation: Generation
    ctx: RequestContext
    output: ChoiceOutput
    #: How the generation ended (None: not yet).
    reason: FinishReason | None = None
    #: Streamed plain text: the writer's function for this choice's text, which takes the
    #: decoded text as it is (the per-token path); None: pieces through the output stage.
    plain_text: Callable[[str], bytes] | None = None

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish reason (``tool_calls`` once the model called a tool)."""
        return self.output.finish_reason(self.reason or FinishReason.STOP)

    def whole(self, prefix: str = "") -> WholeChoice:
        """The ended choice, as a whole response reports it (its output stage kept what it
        said: ``ChatRun.start``'s ``keep``); ``prefix`` starts its text."""
        return self.output.whole(self.reason or FinishReason.STOP, prefix)

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the choice, if one did."""
        return self.generation.decoder.matched_stop


class RunWriter(Protocol):
    """A surface's response to a run. Streamed (``stream``), every call returns the bytes to
    send at once (``b""``: nothing yet); whole, only ``tail`` counts (the body)."""

    stream: bool

    def head(self, run: ChatRun) -> bytes:
        """The stream's first events, before any output."""
        ...

    def plain_text(self, index: int) -> Callable[[str], bytes]:
        """What writes choice ``index``'s plain text (a streamed choice without parser or
        log probabilities): asked once per choice, called per delta (the per-token path)."""
        ...

    def piece(self, index: int, piece: ChoicePiece) -> bytes:
        """A non-empty piece of choice ``index``."""
        ...

    def end(self, choice: Choice) -> bytes:
        """``choice`` has ended (``choice.reason`` set, its parser's tail already given)."""
        ...

    async def tail(self, run: ChatRun) -> bytes:
        """Every choice has ended: the stream's last events, or the whole body."""
        ...

    def error(self, err: HttpError) -> bytes:
        """The run failed after the stream started: the in-band error events."""
        ...


class ChatRun:
    """One running request: ``n`` choices of one preprocessed prompt."""

    __slots__ = (
        "_account", "_first", "_metrics", "_pumps", "_queue", "_timer", "choices", "echo",
        "request",
    )  # fmt: skip

    def __init__(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        metrics: ModelMetrics,
        account: TenantAccount | None = None,
    ) -> None:
        self.request = request
        self._metrics = metrics
        #: The tenant's account the run charges (None: no tenant accounting).
        self._account = account
        self._timer = StreamTimer(metrics)
        self.choices: list[Choice] = []
        #: Completions' ``echo``: the prompt the text of the (only) choice starts with.
        self.echo = ""
        #: The first output (``_first_output``), where the choices' deltas start.
        self._first: _Event | None = None
        self._queue: asyncio.Queue[_Event] | None = None
        self._pumps: list[asyncio.Task[None]] = []

    @classmethod
    async def start(
        cls,
        pipeline: TokensPipeline,
        request: ChatCompletionRequest | CompletionRequest,
        ctx: RequestContext,
        metrics: FrontendMetrics,
        session_id: str | None = None,
        *,
        keep: bool = False,
    ) -> ChatRun:
        """Preprocess, route and await the first output: every failure until then raises
        (and becomes the response's status), including a first output that is already the
        worker's failure (nothing has reached the client: the status says it plainly).

        ``keep``: the choices are answered whole from their output stages
        (``ChoiceOutput.whole``), which then keep what they say; a surface that writes its
        own items (or streams) leaves it off, and a choice costs no memory per token."""
        model_metrics = metrics.model(request.model)
        account: TenantAccount | None = ctx.metadata.get(ACCOUNT_METADATA)
        run = cls(request, model_metrics, account)
        pre = await pipeline.preprocess(request, ctx)
        if account is not None:
            account.charge_prompt(len(pre.token_ids))
        pre.session_id = session_id
        if pre.backend_instance_id is not None:
            # Every router mode: an unknown pin is a 404 before any work, a known instance
            # that is down a 503.
            check_pinned(pipeline.client, pre.backend_instance_id, f"model {request.model}")
        model_metrics.input_tokens.observe(len(pre.token_ids))
        if isinstance(request, CompletionRequest) and request.echo:
            run.echo = _echoed_prompt(request, pipeline, pre.token_ids)
        n = request.n or 1
        if n == 1:
            output = choice_output(pipeline, request, pre, text_offset=len(run.echo), keep=keep)
            run.choices.append(Choice(0, pipeline.generate(pre, ctx), ctx, output))
        else:
            run._fan_out(pipeline, pre, ctx, n, keep)
        try:
            queue = run._queue
            if queue is None:
                first: _Event = (0, await anext(run.choices[0].generation.__aiter__()))
            else:
                run._pumps = [asyncio.create_task(_pump(c, queue)) for c in run.choices]
                first = await queue.get()
            delta = first[1]
            if isinstance(delta, Exception):
                raise delta
            if delta.finish_reason is FinishReason.ERROR:
                raise worker_error(delta.error or "")
            run._first = first
        except BaseException:
            await run.aclose()
            raise
        return run

    def _fan_out(
        self,
        pipeline: TokensPipeline,
        pre: PreprocessedRequest,
        ctx: RequestContext,
        n: int,
        keep: bool,
    ) -> None:
        seed = pre.sampling_options.seed
        base = seed if seed is not None else random.getrandbits(31)
        for i in range(n):
            sampling = msgspec.structs.replace(pre.sampling_options, seed=base + i)
            sub = msgspec.structs.replace(pre, sampling_options=sampling)
            sub_ctx = RequestContext(f"{ctx.request_id}-{i}")
            if EXPLAIN_ROUTING_METADATA in ctx.metadata:
                sub_ctx.metadata[EXPLAIN_ROUTING_METADATA] = ctx.metadata[EXPLAIN_ROUTING_METADATA]
            output = choice_output(pipeline, self.request, sub, keep=keep)
            self.choices.append(Choice(i, pipeline.generate(sub, sub_ctx), sub_ctx, output))
        self._queue = asyncio.Queue(maxsize=_QUEUE_PER_CHOICE * n)
        self._timer.per_choice(n)

    # ---------------------------------------------------------------- output

    async def drive(self, writer: RunWriter, send: Send | None) -> None:
        """Run every choice to its end through ``writer``; ``send``: streamed, each call's
        bytes go out as they come (None: whole, nothing is sent). A failure raises (a worker's
        error, a broken stream); the caller answers it."""
        choices = self.choices
        if send is not None:
            for choice in choices:
                if choice.output.plain:
                    choice.plain_text = writer.plain_text(choice.index)
        assert self._first is not None
        if self._queue is not None:
            await self._drive_many(self._queue, writer, send)
            return
        choice = choices[0]
        delta = self._first[1]
        assert isinstance(delta, DecodedDelta)
        deltas = choice.generation.__aiter__()
        plain_text = choice.plain_text
        if plain_text is not None and send is not None:
            # The per-token path (one choice, streamed plain text): the loop at its leanest.
            on_tokens = self._timer.on_tokens
            account = self._account
            while True:
                if account is not None and delta.token_ids:
                    account.charge_output(len(delta.token_ids))
                if delta.text:
                    on_tokens()
                    await send(plain_text(delta.text))
                elif delta.token_ids:
                    on_tokens()
                if delta.finish_reason is not None:
                    break
                delta = await anext(deltas)
        else:
            take = self._take
            while True:
                if delta.text or delta.token_ids:
                    out = take(choice, delta, writer)
                    if out and send is not None:
                        await send(out)
                if delta.finish_reason is not None:
                    break
                delta = await anext(deltas)
        out = self._end(choice, delta, writer)
        if out and send is not None:
            await send(out)

    async def _drive_many(
        self, queue: asyncio.Queue[_Event], writer: RunWriter, send: Send | None
    ) -> None:
        choices = self.choices
        open_choices = len(choices)
        assert self._first is not None
        index, delta = self._first
        while True:
            if isinstance(delta, Exception):
                raise delta
            choice = choices[index]
            if delta.text or delta.token_ids:
                out = self._take(choice, delta, writer)
                if out and send is not None:
                    await send(out)
            if delta.finish_reason is not None:
                out = self._end(choice, delta, writer)
                if out and send is not None:
                    await send(out)
                open_choices -= 1
                if not open_choices:
                    return
            index, delta = await queue.get()

    def _take(self, choice: Choice, delta: DecodedDelta, writer: RunWriter) -> bytes:
        """What a delta that brings tokens adds to ``choice``, as the writer writes it."""
        if self._account is not None and delta.token_ids:
            self._account.charge_output(len(delta.token_ids))
        if self._queue is None:
            self._timer.on_tokens()
        else:
            self._timer.on_choice_tokens(choice.index)
        if choice.plain_text is not None:
            return choice.plain_text(delta.text) if delta.text else b""
        piece = choice.output.take(delta)
        return writer.piece(choice.index, piece) if piece else b""

    def _end(self, choice: Choice, delta: DecodedDelta, writer: RunWriter) -> bytes:
        """``choice``'s last delta (its text already taken): its parser's tail, its end."""
        reason = delta.finish_reason
        assert reason is not None
        if reason is FinishReason.ERROR:
            raise worker_error(delta.error or "")
        choice.reason = reason
        tail = choice.output.end()
        out = writer.piece(choice.index, tail) if tail else b""
        return out + writer.end(choice)

    # ---------------------------------------------------------------- accounting

    @property
    def prompt_tokens(self) -> int:
        return len(self.choices[0].generation.request.token_ids)

    @property
    def output_tokens(self) -> int:
        """The completion tokens of every choice."""
        choices = self.choices
        if len(choices) == 1:
            return choices[0].generation.decoder.num_output_tokens
        return sum(c.generation.decoder.num_output_tokens for c in choices)

    @property
    def usage(self) -> Usage:
        """The prompt once, the completion tokens of every choice."""
        decoder = self.choices[0].generation.decoder
        return make_usage(self.prompt_tokens, self.output_tokens, decoder.cached_tokens)

    @property
    def finish_reason(self) -> str:
        """The first choice's (the only one, on surfaces without ``n``)."""
        return self.choices[0].finish_reason

    async def aclose(self) -> None:
        """Stop every choice's work on its worker and record the request's metrics (the
        prompt's cached tokens once, as its usage counts them). Always called (``start``
        calls it when it raises)."""
        choices = self.choices
        if self._pumps:
            for task in self._pumps:
                task.cancel()
            await asyncio.gather(*self._pumps, return_exceptions=True)
            for choice in choices:  # their own contexts: cancel what has not ended
                if choice.reason is None:
                    choice.ctx.cancel()
        for choice in choices:
            await choice.generation.aclose()
        metrics = self._metrics
        output = self.output_tokens
        metrics.output_tokens.observe(output)
        cached = choices[0].generation.decoder.cached_tokens
        if cached:
            metrics.cached_tokens.inc(cached)
        if self._account is not None:
            self._account.settle(prompt=self.prompt_tokens, cached=cached or 0, output=output)
        metrics.duration.observe(time.perf_counter() - self._timer.start)


async def _pump(choice: Choice, queue: asyncio.Queue[_Event]) -> None:
    """Hand ``choice``'s deltas to the run, up to its finish (or what failed it)."""
    deltas = choice.generation.__aiter__()
    try:
        while True:
            delta = await anext(deltas)
            await queue.put((choice.index, delta))
            if delta.finish_reason is not None:
                return
    except Exception as exc:  # handed to the run, which answers it
        await queue.put((choice.index, exc))


async def respond(proto: Exchange, run: ChatRun, writer: RunWriter) -> None:
    """Answer with ``run`` through ``writer``, then close the run: whole, the body ``tail``
    returns once every choice has ended; streamed, ``head``'s events at once, the choices' as
    they come, then ``tail``'s (or, when the run fails midway, ``error``'s)."""
    try:
        if not writer.stream:
            await run.drive(writer, None)
            proto.response_bytes(200, JSON_HEADERS, await writer.tail(run))
            return
        send = proto.response_stream(200, SSE_HEADERS).send_bytes
        head = writer.head(run)
        if head:
            await send(head)
        try:
            await run.drive(writer, send)
            last = await writer.tail(run)
        except ClientDisconnected:
            raise
        except Exception as exc:  # mid-stream failure: tell the client in-band
            last = writer.error(to_http_error(exc))
        await send(last)
    finally:
        await run.aclose()


def _echoed_prompt(request: CompletionRequest, pipeline: TokensPipeline, ids: list[int]) -> str:
    """Completions' ``echo``: the prompt as the client sent it (a string), or its tokens'
    text; the response's text starts with it."""
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    return pipeline.preprocessor.tokenizer.decode(ids, skip_special_tokens=False)
