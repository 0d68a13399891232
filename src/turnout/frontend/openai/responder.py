"""One chat or completions request's HTTP response: streamed (SSE) or whole, from a
Tokens-input pipeline (run by ``ChatRun``; this module writes OpenAI's shapes) or relayed from
a Text-input worker.

The first output is awaited before the status line goes out, so a failure before generation
starts gets its own status and body; after that, a failure is an SSE ``error`` event. A
relayed response's tokens are charged to its tenant from the usage its chunks report
(``RelayMeter``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from turnout.frontend.access.accounting import ACCOUNT_METADATA, TenantAccount
from turnout.frontend.http.errors import HttpError, to_http_error
from turnout.frontend.metrics.frontend import FrontendMetrics
from turnout.frontend.models.pipeline import TextPipeline, TokensPipeline
from turnout.frontend.openai.chat_run import ChatRun, Choice, respond
from turnout.frontend.openai.choice_output import ChoicePiece
from turnout.frontend.openai.chunk_writer import (
    JSON_HEADERS,
    SSE_DONE,
    SSE_HEADERS,
    ChunkWriter,
    aggregate_chunks,
    answered_service_tier,
    sse,
    whole_response,
)
from turnout.protocols.openai import ChatCompletionRequest, CompletionRequest
from turnout.router.push_router import PIN_METADATA
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
        writer: ChunkStream | WholeBody = (
            ChunkStream(request) if request.stream else WholeBody(request)
        )
        run = await ChatRun.start(
            pipeline, request, ctx, self.metrics, session_id, keep=not request.stream
        )
        await respond(proto, run, writer)

    async def relay_text(
        self,
        proto: Exchange,
        pipeline: TextPipeline,
        body: bytes,
        request: ChatCompletionRequest | CompletionRequest,
        ctx: RequestContext,
    ) -> None:
        nvext = request.nvext
        if nvext is not None and nvext.pinned_instance is not None:
            # The router cannot read the raw body it forwards: hand it the pin.
            ctx.metadata[PIN_METADATA] = nvext.pinned_instance
        account = ctx.metadata.get(ACCOUNT_METADATA)
        meter = RelayMeter(account) if account is not None else None
        chunks = pipeline.generate(body, ctx)
        try:
            first = await anext(chunks)
            refused = text_refusal(first)
            if refused is not None:
                raise refused
            if meter is not None:
                meter.see(first)
            if not request.stream:
                collected = [first]
                async for chunk in chunks:
                    if meter is not None:
                        meter.see(chunk)
                    collected.append(chunk)
                proto.response_bytes(
                    200, JSON_HEADERS, aggregate_chunks(collected, is_chat=pipeline.is_chat)
                )
                return
            transport = proto.response_stream(200, SSE_HEADERS)
            await transport.send_bytes(sse(first))
            try:
                async for chunk in chunks:
                    if meter is not None:
                        meter.see(chunk)
                    await transport.send_bytes(sse(chunk))
            except Exception as exc:  # mid-stream failure: tell the client in-band
                await transport.send_bytes(sse(to_http_error(exc).body()))
            await transport.send_bytes(SSE_DONE)
        finally:
            if meter is not None:
                meter.settle()
            await chunks.aclose()  # type: ignore[attr-defined]


class _CachedTokens(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _CachedTokens | None = None


class _UsageOf(msgspec.Struct):
    """The one field of an OpenAI chunk a ``RelayMeter`` reads."""

    usage: _Usage | None = None


_usage_decoder = msgspec.json.Decoder(_UsageOf)


class RelayMeter:
    """Charges a relayed (Text-input) response's tokens to its tenant's account from the
    ``usage`` its worker's chunks carry. OpenAI's usage is cumulative (the last chunk's, or
    every chunk's when the server reports it as it goes), so each report charges what it
    adds to the ones before, prompt included (``TenantAccount.charge_relayed``: debt, never
    refused, as the worker is streaming by then); ``settle`` records the last report as the
    request's usage. A chunk that does not mention ``usage`` is not decoded. A worker that
    reports no usage charges nothing: its tokens are unknown to the frontend."""

    __slots__ = ("_account", "_charged", "_usage")

    def __init__(self, account: TenantAccount) -> None:
        self._account = account
        self._charged = 0
        self._usage: _Usage | None = None

    def see(self, raw: bytes) -> None:
        """Charge what ``raw`` (one chunk's JSON) reports beyond the reports before it."""
        if b'"usage"' not in raw:
            return
        try:
            usage = _usage_decoder.decode(raw).usage
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # the client gets the chunk as it is; it carries no usage to charge
        if usage is None:
            return
        self._usage = usage
        total = max(0, usage.prompt_tokens or 0) + max(0, usage.completion_tokens or 0)
        if total > self._charged:
            self._account.charge_relayed(total - self._charged)
            self._charged = total

    def settle(self) -> None:
        """Record the last usage reported as the request's (nothing when none was)."""
        usage = self._usage
        if usage is None:
            return
        details = usage.prompt_tokens_details
        cached = details.cached_tokens if details is not None else None
        self._account.settle(
            prompt=max(0, usage.prompt_tokens or 0),
            cached=max(0, cached or 0),
            output=max(0, usage.completion_tokens or 0),
        )


def response_nvext(
    request: ChatCompletionRequest | CompletionRequest, ctx: RequestContext
) -> dict[str, Any] | None:
    """The ``nvext`` a response carries: the facts ``nvext.extra_fields`` asks for, as the
    pipeline recorded them on the (choice's) context."""
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


class ChunkStream:
    """A streamed chat or completions response: one ``ChunkWriter`` per choice (one
    response id and ``created`` for all), chunks naming their choice's ``index``."""

    __slots__ = ("_lead", "_request", "_writers")

    stream = True

    def __init__(self, request: ChatCompletionRequest | CompletionRequest) -> None:
        self._request = request
        is_chat = isinstance(request, ChatCompletionRequest)
        tier = answered_service_tier(request)
        lead = self._lead = ChunkWriter(request.model, is_chat, service_tier=tier)
        self._writers = [lead]
        for i in range(1, request.n or 1):
            writer = ChunkWriter(
                request.model, is_chat, lead.response_id, index=i, created=lead.created,
                service_tier=tier,
            )  # fmt: skip
            self._writers.append(writer)

    def head(self, run: ChatRun) -> bytes:
        """Chat: each choice's role chunk; completions: the echoed prompt, if asked for."""
        if self._lead.is_chat:
            writers = self._writers
            if len(writers) == 1:
                return writers[0].role()
            return b"".join([writer.role() for writer in writers])
        return self._lead.text(run.echo) if run.echo else b""

    def plain_text(self, index: int) -> Callable[[str], bytes]:
        return self._writers[index].text

    def piece(self, index: int, piece: ChoicePiece) -> bytes:
        return self._writers[index].piece(piece)

    def end(self, choice: Choice) -> bytes:
        nvext = response_nvext(self._request, choice.ctx)
        return self._writers[choice.index].finish(choice.finish_reason, nvext)

    async def tail(self, run: ChatRun) -> bytes:
        opts = self._request.stream_options
        if opts is not None and opts.include_usage:
            return self._lead.usage(run.usage) + SSE_DONE
        return SSE_DONE

    def error(self, err: HttpError) -> bytes:
        return sse(err.body()) + SSE_DONE


class WholeBody:
    """A whole chat or completions response: the choices' output stages keep what they say
    (the run is started with ``keep``), read once every choice has ended."""

    __slots__ = ("_request",)

    stream = False

    def __init__(self, request: ChatCompletionRequest | CompletionRequest) -> None:
        self._request = request

    def head(self, run: ChatRun) -> bytes:
        return b""

    def plain_text(self, index: int) -> Callable[[str], bytes]:
        raise AssertionError("a whole response takes no streamed text")

    def piece(self, index: int, piece: ChoicePiece) -> bytes:
        return b""

    def end(self, choice: Choice) -> bytes:
        return b""

    async def tail(self, run: ChatRun) -> bytes:
        request = self._request
        return whole_response(
            model=request.model,
            is_chat=isinstance(request, ChatCompletionRequest),
            choices=[c.whole(run.echo) for c in run.choices],
            usage=run.usage,
            nvext=response_nvext(request, run.choices[0].ctx),
            service_tier=answered_service_tier(request),
        )

    def error(self, err: HttpError) -> bytes:
        return b""


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
