"""Building OpenAI responses (whole and streamed) from decoded deltas.

The per-token SSE chunk is the hottest path of the frontend, so ``ChunkWriter`` pre-renders
each chunk's constant JSON around the text and only encodes the text itself per token; the
first and last chunks, rare, go through the typed structs.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import msgspec

from turnout.errors import WorkerProtocolError
from turnout.frontend.openai.choice_output import ChoicePiece, WholeChoice
from turnout.protocols.openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
    ToolCallChunk,
    Usage,
)

_json = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"
JSON_HEADERS = [("content-type", "application/json")]
SSE_HEADERS = [
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache"),
    ("x-accel-buffering", "no"),
]


#: Ids are a random per-process prefix and a counter: unique within the process (and across
#: processes with overwhelming odds), the shape of ``uuid4().hex``, at a tenth of its cost
#: (``uuid4`` is a syscall plus an int round trip, twice per request on the hot path).
_ID_PREFIX = os.urandom(8).hex()
_id_counter = itertools.count()


#: The header a client names its request with, sent back on every response to a generation
#: route (the client's value, else the id turnout gave the request).
REQUEST_ID_HEADER = "x-request-id"
#: Longest client request id taken.
MAX_REQUEST_ID_CHARS = 128


def valid_request_id(value: str) -> bool:
    """Whether a client's ``x-request-id`` can name a request: 1 to ``MAX_REQUEST_ID_CHARS``
    visible ASCII characters (it is echoed in a header and written in every log line)."""
    return (
        0 < len(value) <= MAX_REQUEST_ID_CHARS
        and value.isascii()
        and value.isprintable()
        and " " not in value
    )


def new_request_id() -> str:
    """A fresh 32-hex-digit id (see ``_ID_PREFIX``)."""
    return f"{_ID_PREFIX}{next(_id_counter):016x}"


def new_response_id(is_chat: bool) -> str:
    return ("chatcmpl-" if is_chat else "cmpl-") + new_request_id()


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> Usage:
    """Usage as OpenAI reports it: ``prompt_tokens_details`` always an object (0 cached when
    the engine does not say), streamed or not."""
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens or 0),
    )


def answered_service_tier(request: object) -> str | None:
    """The ``service_tier`` a response names: ``default`` when its chat request named a tier
    (the preprocessor refuses any but ``auto`` and ``default``: turnout serves one), else
    none."""
    return "default" if getattr(request, "service_tier", None) is not None else None


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class ChunkWriter:
    """Renders the SSE events of one streamed response."""

    __slots__ = (
        "_prefix",
        "_suffix",
        "created",
        "index",
        "is_chat",
        "model",
        "response_id",
        "service_tier",
    )

    def __init__(
        self,
        model: str,
        is_chat: bool,
        response_id: str | None = None,
        *,
        index: int = 0,
        created: int | None = None,
        service_tier: str | None = None,
    ) -> None:
        """``index``: the choice this writer writes (the choices of one response share its
        ``response_id`` and ``created``); ``service_tier``: every chunk's (chat only)."""
        self.model = model
        self.service_tier = service_tier if is_chat else None
        self.is_chat = is_chat
        self.index = index
        self.response_id = response_id or new_response_id(is_chat)
        self.created = int(time.time()) if created is None else created
        head = (
            b'data: {"id":' + _json.encode(self.response_id)
            + b',"object":' + (b'"chat.completion.chunk"' if is_chat else b'"text_completion"')
            + b',"created":' + str(self.created).encode()
            + b',"model":' + _json.encode(model)
        )  # fmt: skip
        if self.service_tier is not None:
            head += b',"service_tier":' + _json.encode(self.service_tier)
        if is_chat:
            self._prefix = head + b',"choices":[{"index":%d,"delta":{"content":' % index
            self._suffix = b'},"finish_reason":null}]}\n\n'
        else:
            self._prefix = head + b',"choices":[{"index":%d,"text":' % index
            self._suffix = b',"finish_reason":null}]}\n\n'

    def text(self, text: str) -> bytes:
        """One content chunk (the per-token path)."""
        return self._prefix + _json.encode(text) + self._suffix

    def piece(self, piece: ChoicePiece) -> bytes:
        """A chunk with more than text (reasoning, tool calls, log probabilities): the typed,
        slower path, for requests that parse their output or ask for log probs."""
        calls = None
        if piece.tool_calls:
            calls = [
                ToolCallChunk(
                    index=c.index,
                    id=c.id,
                    type="function" if c.id is not None else None,
                    function=FunctionCall(name=c.name, arguments=c.arguments),
                )
                for c in piece.tool_calls
            ]
        return self._event(
            content=piece.content if piece.content or not self.is_chat else None,
            reasoning=piece.reasoning or None,
            tool_calls=calls,
            logprobs=piece.logprobs,
        )

    def role(self) -> bytes:
        """The chat stream's opening chunk, announcing the assistant role."""
        return self._event(role="assistant", content="")

    def finish(self, finish_reason: str, nvext: dict[str, Any] | None = None) -> bytes:
        return self._event(finish_reason=finish_reason, nvext=nvext)

    def usage(self, usage: Usage) -> bytes:
        """The extra chunk with ``choices: []`` that ``stream_options.include_usage`` asks for."""
        return self._event(usage=usage, choice=False)

    def _event(
        self,
        *,
        content: str | None = None,
        role: str | None = None,
        reasoning: str | None = None,
        tool_calls: list[ToolCallChunk] | None = None,
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        nvext: dict[str, Any] | None = None,
        usage: Usage | None = None,
        choice: bool = True,
    ) -> bytes:
        """One chunk through the typed structs (the rare chunks, and those with log probs)."""
        chunk: Any
        if self.is_chat:
            delta = ChatDelta(
                role=role, content=content, reasoning_content=reasoning, tool_calls=tool_calls
            )
            chunk = ChatCompletionChunk(
                id=self.response_id, created=self.created, model=self.model,
                choices=[
                    ChatChunkChoice(
                        index=self.index, delta=delta, finish_reason=finish_reason,
                        logprobs=logprobs,
                    )
                ] if choice else [],
                usage=usage, service_tier=self.service_tier, nvext=nvext,
            )  # fmt: skip
        else:
            chunk = CompletionResponse(
                id=self.response_id, created=self.created, model=self.model,
                choices=[
                    CompletionChoice(
                        index=self.index, text=content or "", finish_reason=finish_reason,
                        logprobs=logprobs,
                    )
                ] if choice else [],
                usage=usage, nvext=nvext,
            )  # fmt: skip
        return sse(_json.encode(chunk))


def whole_response(
    *,
    model: str,
    is_chat: bool,
    choices: list[WholeChoice],
    usage: Usage,
    nvext: dict[str, Any] | None = None,
    service_tier: str | None = None,
) -> bytes:
    """The body of a whole response; ``choices`` in index order; ``service_tier`` (chat
    only): see ``answered_service_tier``."""
    created = int(time.time())
    if is_chat:
        return _json.encode(
            ChatCompletionResponse(
                id=new_response_id(True),
                created=created,
                model=model,
                choices=[
                    ChatChoice(
                        index=i,
                        message=_message(c),
                        finish_reason=c.finish_reason,
                        logprobs=c.logprobs,
                    )
                    for i, c in enumerate(choices)
                ],
                usage=usage,
                service_tier=service_tier,
                nvext=nvext,
            )
        )
    return _json.encode(
        CompletionResponse(
            id=new_response_id(False),
            created=created,
            model=model,
            choices=[
                CompletionChoice(
                    index=i, text=c.text, finish_reason=c.finish_reason, logprobs=c.logprobs
                )
                for i, c in enumerate(choices)
            ],
            usage=usage,
            nvext=nvext,
        )
    )


def _message(choice: WholeChoice) -> ChatResponseMessage:
    """A whole chat choice's message: ``content`` is null when the model only called tools."""
    calls = [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in choice.tool_calls
    ]
    return ChatResponseMessage(
        role="assistant",
        content=choice.text if choice.text or not calls else None,
        reasoning_content=choice.reasoning or None,
        tool_calls=calls or None,
    )


def aggregate_chunks(chunks: list[bytes], *, is_chat: bool) -> bytes:
    """Fold a Text-input worker's streamed OpenAI chunks into one whole response."""
    texts: list[str] = []
    finish_reason: str | None = None
    usage: Any = None
    first: dict[str, Any] = {}
    for raw in chunks:
        try:
            chunk = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise WorkerProtocolError(f"a worker's chunk is not JSON: {exc}") from exc
        if not isinstance(chunk, dict):
            raise WorkerProtocolError(f"a worker's chunk is not a JSON object: {raw[:80]!r}")
        first = first or chunk
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            piece = delta.get("content") if is_chat else choice.get("text")
            if piece:
                texts.append(piece)
            finish_reason = choice.get("finish_reason") or finish_reason
    text = "".join(texts)
    body: dict[str, Any] = {
        "id": first.get("id") or new_response_id(is_chat),
        "object": "chat.completion" if is_chat else "text_completion",
        "created": first.get("created") or int(time.time()),
        "model": first.get("model", ""),
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text},
             "finish_reason": finish_reason}
            if is_chat
            else {"index": 0, "text": text, "finish_reason": finish_reason}
        ],
    }  # fmt: skip
    if usage:
        body["usage"] = usage
    return _json.encode(body)
