"""Every OpenAI-shaped body the test suite receives, checked against the official ``openai``
client's own types, strictly (pydantic strict mode: exact types, every required field).

``tests/conftest.py`` wraps ``Client.send`` and ``AsyncClient.send`` of ``httpx`` and of
``httpx2`` (the fork the ``openai`` client is built on) for every test: responses from
``/v1/`` routes are checked as they are read, whole bodies at once and streamed ones event
by event, and the test fails at teardown with every violation seen. A test that means to
receive a malformed body says so with ``@pytest.mark.no_conformance``.

One leniency, OpenAI's own: a legacy completions stream sends ``finish_reason: null`` until
its last chunk, while ``openai.types.Completion`` (shared by the whole body and the chunks)
types it non-null; such chunks are checked with the null read as "not finished yet".

``/v1/embeddings`` bodies are checked as ``CreateEmbeddingResponse``, with a base64 vector
(``encoding_format: base64``, the client's default) read as the little-endian float32s the
client decodes it into (a string that is not such base64 is a violation).

``/v1/responses`` bodies are checked as ``Response``, its stream events as
``ResponseStreamEvent`` (the union the client parses them into). The response store's routes
are told apart by method and path shape (``_route``) and checked as the type the client casts
each to (``_STORE_TYPES``): ``Response``, ``ResponseItemList``, ``Conversation``,
``ConversationDeletedResource``, ``ConversationItemList``, ``ConversationItem``; a deleted
response, which the client reads as nothing, as OpenAI's reference shows it
(``_ResponseDeleted``). Anthropic's
``/v1/messages`` and ``/v1/messages/count_tokens`` against the ``anthropic`` client's
``Message``, ``RawMessageStreamEvent``, ``MessageTokensCount`` and ``ErrorResponse``. One
leniency there too: Anthropic documents ``request_too_large`` as the type of a 413's error,
which the client's error union lacks; a 413 with it is checked as the union's shape.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import struct
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any, Literal

import httpx
import pydantic
from anthropic.types import ErrorResponse as AnthropicError
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from openai.types import Completion, CreateEmbeddingResponse, ErrorObject, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.conversations import (
    Conversation,
    ConversationDeletedResource,
    ConversationItem,
    ConversationItemList,
)
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MODELS = "/v1/models"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
EMBEDDINGS = "/v1/embeddings"
_MESSAGE_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RawMessageStreamEvent)
_RESPONSE_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)


class _ResponseDeleted(pydantic.BaseModel):
    """``DELETE /v1/responses/{id}``'s body in OpenAI's API reference (the client discards
    it: it has no type of its own)."""

    id: str
    object: Literal["response.deleted"]
    deleted: bool


#: The store's routes (``_route``'s keys) and the types their bodies must be.
_STORE_TYPES: dict[str, pydantic.TypeAdapter[Any]] = {
    route: pydantic.TypeAdapter(kind)
    for route, kind in {
        "GET /v1/responses/{id}": Response,
        "DELETE /v1/responses/{id}": _ResponseDeleted,
        "GET /v1/responses/{id}/input_items": ResponseItemList,
        "POST /v1/conversations": Conversation,
        "GET /v1/conversations/{id}": Conversation,
        "POST /v1/conversations/{id}": Conversation,
        "DELETE /v1/conversations/{id}": ConversationDeletedResource,
        "GET /v1/conversations/{id}/items": ConversationItemList,
        "POST /v1/conversations/{id}/items": ConversationItemList,
        "GET /v1/conversations/{id}/items/{item}": ConversationItem,
        "DELETE /v1/conversations/{id}/items/{item}": Conversation,
    }.items()
}
_CONVERSATION_ROUTES = (
    "/v1/conversations",
    "/v1/conversations/{id}",
    "/v1/conversations/{id}/items",
    "/v1/conversations/{id}/items/{item}",
)


def _route(method: str, path: str) -> str:
    """A store route's ``_STORE_TYPES`` key (method and path template); other paths as they
    are."""
    if path.startswith(RESPONSES + "/"):
        tail = "/input_items" if path.endswith("/input_items") else ""
        return f"{method} {RESPONSES}/{{id}}{tail}"
    depth = path.count("/") - 2  # /v1/conversations: 0
    if path.startswith("/v1/conversations") and 0 <= depth < len(_CONVERSATION_ROUTES):
        return f"{method} {_CONVERSATION_ROUTES[depth]}"
    return path


class Conformance:
    """The violations seen during one test."""

    def __init__(self) -> None:
        self.violations: list[str] = []

    def watch(self, response: Any, http: ModuleType = httpx) -> None:
        """Check ``response`` (of the ``http`` module: ``httpx`` or ``httpx2``) as it is
        read, if it comes from a ``/v1/`` route."""
        path = response.request.url.path
        if not path.startswith("/v1/") or response.headers.get("content-encoding"):
            return
        path = _route(response.request.method, path)
        response.stream = _checked_stream_type(http)(
            response.stream, self, path, response.status_code, sse=_is_stream(response)
        )

    def check_body(self, path: str, status: int, body: bytes) -> None:
        try:
            data = json.loads(body)
        except ValueError:
            self._fail(path, f"a {status} body that is not JSON: {body[:120]!r}")
            return
        if path in (MESSAGES, COUNT_TOKENS):
            if status >= 400:
                self._validate(path, AnthropicError, _too_large_as_known(status, data))
            else:
                self._validate(path, Message if path == MESSAGES else MessageTokensCount, data)
            return
        if status >= 400:
            self._check_error(path, data)
            return
        store_type = _STORE_TYPES.get(path)
        if store_type is not None:
            self._adapt(path, store_type, path, data)
        elif path == CHAT:
            self._validate(path, ChatCompletion, data)
        elif path == COMPLETIONS:
            self._validate(path, Completion, data)
        elif path == RESPONSES:
            self._validate(path, Response, data)
        elif path == EMBEDDINGS:
            self._validate(path, CreateEmbeddingResponse, self._base64_as_floats(path, data))
        elif path == MODELS:
            if not isinstance(data, dict) or data.get("object") != "list":
                self._fail(path, f"a model list without object 'list': {str(data)[:200]}")
                return
            for model in data.get("data") or []:
                self._validate(path, Model, model)
        elif path.startswith(MODELS + "/"):
            self._validate(path, Model, data)

    def check_event(self, path: str, payload: bytes) -> None:
        """One SSE ``data:`` payload of a stream from ``path``."""
        if payload == b"[DONE]":
            return
        try:
            data = json.loads(payload)
        except ValueError:
            self._fail(path, f"an SSE event that is not JSON: {payload[:120]!r}")
            return
        if path == MESSAGES:
            if isinstance(data, dict) and data.get("type") == "error":
                self._validate(path, AnthropicError, data)
            else:
                self._adapt(path, _MESSAGE_EVENT, "RawMessageStreamEvent", data)
        elif isinstance(data, dict) and "error" in data:
            self._check_error(path, data)
        elif path == CHAT:
            self._validate(path, ChatCompletionChunk, data)
        elif path == COMPLETIONS:
            self._validate(path, Completion, _unfinished_as_stop(data))
        elif path == RESPONSES:
            self._adapt(path, _RESPONSE_EVENT, "ResponseStreamEvent", data)

    def _base64_as_floats(self, path: str, data: Any) -> Any:
        for item in data.get("data") or [] if isinstance(data, dict) else []:
            vector = item.get("embedding") if isinstance(item, dict) else None
            if not isinstance(vector, str):
                continue
            try:
                raw = base64.b64decode(vector, validate=True)
            except binascii.Error:
                raw = b"?"
            if len(raw) % 4:
                self._fail(path, f"an embedding that is not base64 float32s: {vector[:60]!r}")
                continue
            item["embedding"] = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        return data

    def _adapt(self, path: str, adapter: pydantic.TypeAdapter[Any], name: str, data: Any) -> None:
        try:
            adapter.validate_python(data, strict=True)
        except pydantic.ValidationError as exc:
            self._fail(path, f"not a valid {name}: {exc}\n  event: {str(data)[:300]}")

    def _check_error(self, path: str, data: Any) -> None:
        error = data.get("error") if isinstance(data, dict) else None
        if not isinstance(error, dict):
            self._fail(path, f"an error body without an 'error' object: {str(data)[:200]}")
            return
        self._validate(path, ErrorObject, error)

    def _validate(self, path: str, model: type[pydantic.BaseModel], data: Any) -> None:
        try:
            model.model_validate(data, strict=True)
        except pydantic.ValidationError as exc:
            self._fail(path, f"not a valid {model.__name__}: {exc}\n  body: {str(data)[:300]}")

    def _fail(self, path: str, message: str) -> None:
        self.violations.append(f"{path}: {message}")


def _too_large_as_known(status: int, data: Any) -> Any:
    """A 413's ``request_too_large`` error read as a type the client's union has."""
    error = data.get("error") if isinstance(data, dict) else None
    if status != 413 or not isinstance(error, dict) or error.get("type") != "request_too_large":
        return data
    return {**data, "error": {**error, "type": "invalid_request_error"}}


def _is_stream(response: Any) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


def _unfinished_as_stop(data: Any) -> Any:
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        return data
    choices = [
        {**c, "finish_reason": "stop"}
        if isinstance(c, dict) and c.get("finish_reason") is None
        else c
        for c in data["choices"]
    ]
    return {**data, "choices": choices}


class _SseParser:
    """Splits bytes into SSE events and hands each ``data:`` payload on."""

    def __init__(self, conformance: Conformance, path: str) -> None:
        self._conformance = conformance
        self._path = path
        self._buffer = b""

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._conformance.check_event(self._path, line[5:].strip())


@functools.cache
def _checked_stream_type(http: ModuleType) -> type:
    """``_CheckedStream`` as a byte stream of ``http`` (its responses insist on their own)."""
    return type("CheckedStream", (_CheckedStream, http.AsyncByteStream, http.SyncByteStream), {})


class _CheckedStream:
    """A response stream checked as the reader receives it: event by event (SSE), or whole
    once read to the end."""

    def __init__(
        self, inner: Any, conformance: Conformance, path: str, status: int, *, sse: bool
    ) -> None:
        self._inner = inner
        self._conformance = conformance
        self._path = path
        self._status = status
        self._parser = _SseParser(conformance, path) if sse else None
        self._body: list[bytes] = []

    def _feed(self, chunk: bytes) -> None:
        if self._parser is not None:
            self._parser.feed(chunk)
        else:
            self._body.append(chunk)

    def _done(self) -> None:
        if self._parser is None:
            self._conformance.check_body(self._path, self._status, b"".join(self._body))

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._feed(chunk)
            yield chunk
        self._done()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._feed(chunk)
            yield chunk
        self._done()

    def close(self) -> None:
        self._inner.close()

    async def aclose(self) -> None:
        await self._inner.aclose()
