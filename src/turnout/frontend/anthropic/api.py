"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API over the
chat pipelines, so the official ``anthropic`` client (and the tools built on it) work
against turnout.

A request becomes a chat request (``anthropic.request``) and runs as one (``ChatRun``); its
pieces become content blocks, in order: ``thinking`` (reasoning; its ``signature`` is empty,
turnout signs nothing), ``text``, ``tool_use`` (arguments parsed into ``input``). Streamed,
Anthropic's events::

    message_start, per block: content_block_start, content_block_delta (text_delta,
    thinking_delta then an empty signature_delta, input_json_delta), content_block_stop;
    message_delta (stop_reason, stop_sequence, usage), message_stop

and an ``error`` event for a failure after streaming started. Errors on these routes have
Anthropic's body, ``{"type": "error", "error": {"type", "message"}}``.

A tool call's block is sent once its arguments are complete (start, one ``input_json_delta``
with the whole input, stop): arguments that are not a JSON object (cut by the token limit, or
malformed) make a ``text`` block instead, streamed as whole, so the stream and the whole
message agree and the client's stream helper, which parses ``partial_json`` as it comes,
never meets a broken call. The parsers hand arguments over whole anyway, so nothing is
delayed in practice. ``stop_reason`` is ``tool_use`` only when a ``tool_use`` block remains.

Usage follows Anthropic's accounting: ``input_tokens`` are the prompt tokens not read from
the prefix cache, ``cache_read_input_tokens`` those that were (their sum is the prompt, what
``count_tokens`` answers).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec

from turnout.frontend.anthropic.request import CountTokensRequest, MessagesRequest, to_chat
from turnout.frontend.http.errors import HttpError
from turnout.frontend.http.surface import Pipeline, Surface, SurfaceRequest, decode_json
from turnout.frontend.metrics.frontend import FrontendMetrics
from turnout.frontend.models.manager import ModelKind
from turnout.frontend.models.pipeline import TextPipeline, TokensPipeline
from turnout.frontend.openai.chat_run import ChatRun, Choice, respond
from turnout.frontend.openai.choice_output import ChoicePiece
from turnout.frontend.openai.chunk_writer import JSON_HEADERS, new_request_id
from turnout.protocols.openai import Usage
from turnout.runtime.context import RequestContext
from turnout.runtime.http import Exchange

_json = msgspec.json.Encoder()
_messages_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)

#: HTTP status -> Anthropic's error type.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_error_body(err: HttpError) -> bytes:
    kind = _ERROR_TYPES.get(err.status, "api_error")
    return _json.encode({"type": "error", "error": {"type": kind, "message": err.message}})


class MessageWriter:
    """One message's content blocks and, when streamed, its events (``events``: the encoded
    events not sent yet; None for a whole message). It is the ``RunWriter`` of a run
    (``respond``)."""

    def __init__(self, model: str, *, stream: bool) -> None:
        self.model = model
        self.stream = stream
        self.id = "msg_" + new_request_id()
        self.events: list[bytes] | None = [] if stream else None
        #: Finished blocks, in order.
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._parts: list[str] = []
        self._call_index: int | None = None

    # ---------------------------------------------------------------- a run's writer

    def head(self, run: ChatRun) -> bytes:
        self.start(run.prompt_tokens)
        return self.drain()

    def plain_text(self, index: int) -> Callable[[str], bytes]:
        return self._plain_text

    def _plain_text(self, text: str) -> bytes:
        self._text_block("text", text)
        return self.drain()

    def piece(self, index: int, piece: ChoicePiece) -> bytes:
        self.add(piece)
        return self.drain()

    def end(self, choice: Choice) -> bytes:
        return b""

    async def tail(self, run: ChatRun) -> bytes:
        choice = run.choices[0]
        message = self.finish(choice.finish_reason, choice.matched_stop, run.usage)
        return self.drain() if self.stream else _json.encode(message)

    def error(self, err: HttpError) -> bytes:
        self.fail(err)
        return self.drain()

    def drain(self) -> bytes:
        """The events not sent yet, taken."""
        events = self.events
        if not events:
            return b""
        out = b"".join(events)
        events.clear()
        return out

    # ---------------------------------------------------------------- events

    def start(self, input_tokens: int) -> None:
        message = {**self._message([], None, None), "usage": _usage_of(input_tokens, 0, 0)}
        self._emit("message_start", message=message)

    def add(self, piece: ChoicePiece) -> None:
        if piece.reasoning:
            self._text_block("thinking", piece.reasoning)
        if piece.content:
            self._text_block("text", piece.content)
        for call in piece.tool_calls:
            if call.id is not None or call.index != self._call_index:
                self._close()
                # Held until its arguments are complete (see the module docstring).
                self._open = {"type": "tool_use", "id": "toolu_" + new_request_id(),
                              "name": call.name or "", "input": {}}  # fmt: skip
                self._parts = []
                self._call_index = call.index
            if call.arguments:
                self._parts.append(call.arguments)

    def finish(self, finish_reason: str, stop_sequence: str | None, usage: Usage) -> dict[str, Any]:
        """Close the open block; the whole message (and, streamed, its last events)."""
        self._close()
        reason = _STOP_REASONS.get(finish_reason, "end_turn")
        if stop_sequence is not None and finish_reason == "stop":
            reason = "stop_sequence"
        if reason == "tool_use" and not any(b["type"] == "tool_use" for b in self.blocks):
            reason = "end_turn"  # its only calls were not calls (see the module docstring)
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        cached = cached or 0
        usage_body = _usage_of(usage.prompt_tokens - cached, usage.completion_tokens, cached)
        self._emit(
            "message_delta",
            delta={"stop_reason": reason, "stop_sequence": stop_sequence},
            usage=usage_body,
        )
        self._emit("message_stop")
        return {**self._message(self.blocks, reason, stop_sequence), "usage": usage_body}

    def fail(self, err: HttpError) -> None:
        self._emit("error", error={"type": "api_error", "message": err.message})

    # ---------------------------------------------------------------- blocks

    def _text_block(self, kind: str, text: str) -> None:
        if self._open is None or self._open["type"] != kind:
            self._close()
            if kind == "thinking":
                self._begin({"type": "thinking", "thinking": "", "signature": ""})
            else:
                self._begin({"type": "text", "text": ""})
        self._parts.append(text)
        if kind == "thinking":
            self._delta({"type": "thinking_delta", "thinking": text})
        else:
            self._delta({"type": "text_delta", "text": text})

    def _begin(self, block: dict[str, Any]) -> None:
        """Send ``block``'s ``content_block_start`` (its index: the blocks before it)."""
        self._open = block
        self._parts = []
        self._emit("content_block_start", index=len(self.blocks), content_block=block)

    def _delta(self, delta: dict[str, Any]) -> None:
        self._emit("content_block_delta", index=len(self.blocks), delta=delta)

    def _close(self) -> None:
        block = self._open
        if block is None:
            return
        text = "".join(self._parts)
        if block["type"] == "thinking":
            self._delta({"type": "signature_delta", "signature": ""})
            block = {**block, "thinking": text}
        elif block["type"] == "text":
            block = {**block, "text": text}
        else:
            try:
                arguments = json.loads(text) if text else {}
            except ValueError:
                arguments = None
            if isinstance(arguments, dict):
                self._begin(block)
                block = {**block, "input": arguments}
                self._delta(
                    {"type": "input_json_delta", "partial_json": _json.encode(arguments).decode()}
                )
            else:  # arguments cut short (the token limit) or malformed: text, not a call
                block = {"type": "text", "text": text}
                self._begin({"type": "text", "text": ""})
                self._delta({"type": "text_delta", "text": text})
        self._emit("content_block_stop", index=len(self.blocks))
        self.blocks.append(block)
        self._open = None
        self._call_index = None
        self._parts = []

    def _message(
        self, content: list[dict[str, Any]], reason: str | None, stop: str | None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop,
        }

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.events is not None:
            data = _json.encode({"type": kind, **fields})
            self.events.append(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")


def _usage_of(input_tokens: int, output_tokens: int, cached: int) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _tokens_pipeline(pipeline: Pipeline, model: str) -> TokensPipeline:
    if isinstance(pipeline, TextPipeline):
        raise HttpError(
            400,
            f"model '{model}' is served by text-input workers, which speak chat completions "
            "only; /v1/messages needs a model the frontend tokenizes",
            param="model",
        )
    return pipeline


def messages_surface(metrics: FrontendMetrics) -> Surface:
    """The ``/v1/messages`` route's surface."""

    def decode(body: bytes) -> SurfaceRequest:
        request = decode_json(_messages_decoder, body)
        return SurfaceRequest(request.model, request.stream, request)

    async def serve(
        proto: Exchange,
        pipeline: Pipeline,
        req: SurfaceRequest,
        body: bytes,
        ctx: RequestContext,
        session_id: str | None,
    ) -> None:
        request: MessagesRequest = req.request
        tokens = _tokens_pipeline(pipeline, request.model)
        chat = to_chat(request, tokens.card, limits=tokens.preprocessor.limits)
        writer = MessageWriter(request.model, stream=request.stream)
        run = await ChatRun.start(tokens, chat, ctx, metrics, session_id)
        await respond(proto, run, writer)

    return Surface("messages", ModelKind.CHAT, decode, serve, anthropic_error_body)


def count_tokens_surface() -> Surface:
    """``/v1/messages/count_tokens``: the prompt tokens a message request would use, by the
    model's own template and tokenizer; nothing runs."""

    def decode(body: bytes) -> SurfaceRequest:
        request = decode_json(_count_decoder, body)
        return SurfaceRequest(request.model, False, request)

    async def serve(
        proto: Exchange,
        pipeline: Pipeline,
        req: SurfaceRequest,
        body: bytes,
        ctx: RequestContext,
        session_id: str | None,
    ) -> None:
        request: CountTokensRequest = req.request
        tokens = _tokens_pipeline(pipeline, request.model)
        chat = to_chat(request, tokens.card, max_tokens=1, limits=tokens.preprocessor.limits)
        pre = await tokens.preprocess(chat, None)
        proto.response_bytes(200, JSON_HEADERS, _json.encode({"input_tokens": len(pre.token_ids)}))

    return Surface("count_tokens", ModelKind.CHAT, decode, serve, anthropic_error_body)
