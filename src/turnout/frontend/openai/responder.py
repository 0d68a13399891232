"""One generation request's HTTP response: streamed (SSE) or whole, from a Tokens-input
pipeline (the frontend detokenizes) or relayed from a Text-input worker.

The first output is awaited before the status line goes out, so a failure before generation
starts gets its own status and body; after that, a failure is an SSE ``error`` event.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from turnout.frontend.http.errors import HttpError, to_http_error, worker_error
from turnout.frontend.metrics.frontend import FrontendMetrics, StreamTimer
from turnout.frontend.models.pipeline import Generation, TextPipeline, TokensPipeline
from turnout.frontend.openai.choice_output import ChoiceOutput, choice_output
from turnout.frontend.openai.choices import serve_choices
from turnout.frontend.openai.chunk_writer import (
    JSON_HEADERS,
    SSE_DONE,
    SSE_HEADERS,
    ChunkWriter,
    aggregate_chunks,
    answered_service_tier,
    make_usage,
    sse,
    whole_response,
)
from turnout.protocols.llm import FinishReason
from turnout.protocols.openai import ChatCompletionRequest, CompletionRequest
from turnout.router.push_router import PIN_METADATA, check_pinned
from turnout.runtime.context import RequestContext
from turnout.runtime.http import Exchange


class Responder:
    """Serves generation requests whose model and pipeline are known (``HttpService`` has
    decoded, resolved and admitted them)."""

    def __init__(self, metrics: FrontendMetrics) -> None:
        self.metrics = metrics

    async def serve_tokens(
        self,
        proto: Exchange,
        pipeline: TokensPipeline,
        request: ChatCompletionRequest | CompletionRequest,
        ctx: RequestContext,
        session_id: str | None = None,
    ) -> None:
        pre = await pipeline.preprocess(request)
        pre.session_id = session_id
        if pre.backend_instance_id is not None:
            # Every router mode: an unknown pin is a 404 before any work, a known instance
            # that is down a 503.
            check_pinned(pipeline.client, pre.backend_instance_id, f"model {request.model}")
        metrics = self.metrics.model(request.model)
        metrics.input_tokens.observe(len(pre.token_ids))
        timer = StreamTimer(metrics)
        if (request.n or 1) > 1:
            try:
                total = await serve_choices(
                    proto, pipeline, request, pre, ctx, timer,
                    lambda choice_ctx: self._nvext(request, choice_ctx),
                )  # fmt: skip
                metrics.output_tokens.observe(total)
            finally:
                metrics.duration.observe(time.perf_counter() - timer.start)
            return
        echo = _echoed_prompt(request, pipeline, pre.token_ids)
        output = choice_output(
            pipeline, request, pre, text_offset=len(echo), keep=not request.stream
        )
        generation = pipeline.generate(pre, ctx)
        try:
            deltas = generation.__aiter__()
            first = await anext(deltas)
            if (
                first.finish_reason is FinishReason.ERROR
                and generation.decoder.num_output_tokens == 0
            ):
                raise worker_error(first.error or "")
            args = (proto, request, generation, first, timer, ctx, output, echo)
            if request.stream:
                await self._stream_tokens(*args)
            else:
                await self._whole_tokens(*args)
        finally:
            await generation.aclose()
            metrics.output_tokens.observe(generation.decoder.num_output_tokens)
            cached = generation.decoder.cached_tokens
            if cached:
                metrics.cached_tokens.inc(cached)
            metrics.duration.observe(time.perf_counter() - timer.start)

    def _nvext(
        self, request: ChatCompletionRequest | CompletionRequest, ctx: RequestContext
    ) -> dict[str, Any] | None:
        fields = request.nvext.extra_fields if request.nvext else None
        if not fields:
            return None
        out: dict[str, Any] = {}
        if "worker_id" in fields and "worker_instance_id" in ctx.metadata:
            out["worker_id"] = f"{ctx.metadata['worker_instance_id']:x}"
        if "routing" in fields and "routing" in ctx.metadata:
            out["routing"] = ctx.metadata["routing"]
        if "migrations" in fields:
            out["migrations"] = ctx.metadata.get("migrations", 0)
        return out or None

    async def _stream_tokens(
        self,
        proto: Exchange,
        request: ChatCompletionRequest | CompletionRequest,
        generation: Generation,
        first: Any,
        timer: StreamTimer,
        ctx: RequestContext,
        output: ChoiceOutput,
        echo: str = "",
    ) -> None:
        writer = ChunkWriter(
            request.model,
            isinstance(request, ChatCompletionRequest),
            service_tier=answered_service_tier(request),
        )
        transport = proto.response_stream(200, SSE_HEADERS)
        send = transport.send_bytes
        if writer.is_chat:
            await send(writer.role())
        if echo:
            await send(writer.text(echo))
        plain = output.plain
        delta = first
        deltas = generation.__aiter__()
        while True:
            if plain:
                if delta.text:
                    timer.on_tokens()
                    await send(writer.text(delta.text))
            elif delta.text or delta.token_ids:
                piece = output.take(delta)
                if piece:
                    timer.on_tokens()
                    await send(writer.piece(piece))
            if delta.finish_reason is not None:
                break
            try:
                delta = await anext(deltas)
            except StopAsyncIteration:
                break
            except Exception as exc:  # mid-stream failure: tell the client in-band
                err = to_http_error(exc)
                await send(sse(err.body()))
                await send(SSE_DONE)
                return
        reason = delta.finish_reason or FinishReason.STOP
        if reason is FinishReason.ERROR:
            await send(sse(worker_error(delta.error or "").body()))
            await send(SSE_DONE)
            return
        if not plain:
            tail = output.end()
            if tail:
                await send(writer.piece(tail))
        await send(writer.finish(output.finish_reason(reason), self._nvext(request, ctx)))
        opts = request.stream_options
        if opts is not None and opts.include_usage:
            decoder = generation.decoder
            await send(
                writer.usage(
                    make_usage(
                        len(generation.request.token_ids),
                        decoder.num_output_tokens,
                        decoder.cached_tokens,
                    )
                )
            )
        await send(SSE_DONE)

    async def _whole_tokens(
        self,
        proto: Exchange,
        request: ChatCompletionRequest | CompletionRequest,
        generation: Generation,
        first: Any,
        timer: StreamTimer,
        ctx: RequestContext,
        output: ChoiceOutput,
        echo: str = "",
    ) -> None:
        delta = first
        deltas = generation.__aiter__()
        while True:
            if delta.text:
                timer.on_tokens()
            output.take(delta)
            if delta.finish_reason is not None:
                break
            try:
                delta = await anext(deltas)
            except StopAsyncIteration:
                break
        reason = delta.finish_reason or FinishReason.STOP
        if reason is FinishReason.ERROR:
            raise worker_error(delta.error or "")
        output.end()
        decoder = generation.decoder
        usage = make_usage(
            len(generation.request.token_ids), decoder.num_output_tokens, decoder.cached_tokens
        )
        body = whole_response(
            model=request.model,
            is_chat=isinstance(request, ChatCompletionRequest),
            choices=[output.whole(reason, echo)],
            usage=usage,
            nvext=self._nvext(request, ctx),
            service_tier=answered_service_tier(request),
        )
        proto.response_bytes(200, JSON_HEADERS, body)

    async def relay_text(
        self,
        proto: Exchange,
        pipeline: TextPipeline,
        body: bytes,
        request: ChatCompletionRequest | CompletionRequest,
        ctx: RequestContext,
    ) -> None:
        nvext = request.nvext
        if nvext is not None and nvext.backend_instance_id is not None:
            # The router cannot read the raw body it forwards: hand it the pin.
            ctx.metadata[PIN_METADATA] = nvext.backend_instance_id
        chunks = pipeline.generate(body, ctx)
        try:
            first = await anext(chunks)
            refused = text_refusal(first)
            if refused is not None:
                raise refused
            if not request.stream:
                collected = [first]
                async for chunk in chunks:
                    collected.append(chunk)
                proto.response_bytes(
                    200, JSON_HEADERS, aggregate_chunks(collected, is_chat=pipeline.is_chat)
                )
                return
            transport = proto.response_stream(200, SSE_HEADERS)
            await transport.send_bytes(sse(first))
            try:
                async for chunk in chunks:
                    await transport.send_bytes(sse(chunk))
            except Exception as exc:  # mid-stream failure: tell the client in-band
                await transport.send_bytes(sse(to_http_error(exc).body()))
            await transport.send_bytes(SSE_DONE)
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]


def text_refusal(chunk: bytes) -> HttpError | None:
    """A text worker's first chunk that is an error body with a 4xx ``status`` beside it
    (``{"error": {...}, "status": 400}``: a request the worker cannot honour, or its server
    refused): that status and message instead of a 200 carrying the error."""
    if not chunk.startswith(b'{"error"'):
        return None
    try:
        body = msgspec.json.decode(chunk)
    except msgspec.DecodeError:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    status = body.get("status") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not isinstance(status, int) or not 400 <= status < 500:
        return None
    param = err.get("param")
    return HttpError(
        status,
        str(err.get("message") or "the worker refused the request"),
        param=param if isinstance(param, str) else None,
    )


def _echoed_prompt(
    request: ChatCompletionRequest | CompletionRequest, pipeline: TokensPipeline, ids: list[int]
) -> str:
    """Completions' ``echo``: the prompt as the client sent it (a string), or its tokens'
    text; the response's text starts with it. Empty when not asked for."""
    if not isinstance(request, CompletionRequest) or not request.echo:
        return ""
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    return pipeline.preprocessor.tokenizer.decode(ids, skip_special_tokens=False)
