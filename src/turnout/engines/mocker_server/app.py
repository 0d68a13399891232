"""The HTTP application of a mocker-server: a route table on turnout's HTTP server, and the
helpers every route shares (JSON bodies, OpenAI-style errors, SSE, client disconnects).

Errors: every failure is one response with OpenAI's body ``{"error": {"message", "type",
"param", "code"}}`` (``HttpError``); a streamed response that fails after its first byte
ends with one ``data: {"error": ...}`` event instead, as vLLM's and SGLang's streams do.

A client that leaves mid-request (``client_disconnect``) cancels its route's task: the
generation it was running is closed, which aborts the mocker's request and frees its KV
blocks and batch slot at once (``backend.Generation``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from turnout.frontend.http.errors import SERVER_ERROR, HttpError
from turnout.runtime.http import ClientDisconnected, Exchange, Scope, discard_body

log = logging.getLogger("turnout.mocker_server")

JSON_HEADERS = [("content-type", "application/json")]
SSE_HEADERS = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
#: Largest request body read (a 1M-token prompt as JSON ids is about 7 MB).
MAX_BODY_BYTES = 16 << 20
#: Bytes of a refused body read and dropped before the 413, so the client sees it.
_DRAIN_BYTES = 4 << 20

Handler = Callable[[Scope, Exchange], Awaitable[None]]

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def send_json(exchange: Exchange, body: Any, status: int = 200) -> None:
    exchange.response_bytes(status, JSON_HEADERS, _encode(body))


def send_error(exchange: Exchange, err: HttpError) -> None:
    exchange.response_bytes(err.status, JSON_HEADERS + err.headers, err.body())


def error_event(err: HttpError) -> bytes:
    """An error as the last event of a stream that had already begun."""
    return b"data: " + err.body() + b"\n\n"


async def read_json(scope: Scope, exchange: Exchange) -> dict[str, Any]:
    """The request's JSON object; 413 past ``MAX_BODY_BYTES``, 400 for anything but an
    object."""
    declared = scope.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        await discard_body(exchange, _DRAIN_BYTES)
        raise HttpError(
            413,
            f"request body of {declared} bytes exceeds {MAX_BODY_BYTES} bytes",
            code="request_too_large",
        )
    parts: list[bytes] = []
    size = 0
    async for part in exchange:
        size += len(part)
        if size > MAX_BODY_BYTES:
            await discard_body(exchange, _DRAIN_BYTES)
            raise HttpError(
                413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large"
            )
        parts.append(part)
    try:
        body = _decode(b"".join(parts))
    except msgspec.DecodeError as exc:
        raise HttpError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "request body must be a JSON object")
    return body


class SseStream:
    """A ``text/event-stream`` response: ``data:`` events, then ``data: [DONE]``."""

    __slots__ = ("_out",)

    def __init__(self, exchange: Exchange) -> None:
        self._out = exchange.response_stream(200, SSE_HEADERS)

    async def send(self, event: Any) -> None:
        await self._out.send_bytes(b"data: " + _encode(event) + b"\n\n")

    async def send_raw(self, data: bytes) -> None:
        await self._out.send_bytes(data)

    async def done(self) -> None:
        await self._out.send_bytes(b"data: [DONE]\n\n")


class Routes:
    """``(method, path) -> handler``: the application the HTTP server runs."""

    def __init__(self) -> None:
        self._routes: dict[tuple[str, str], Handler] = {}
        self._paths: set[str] = set()

    def add(self, method: str, path: str, handler: Handler) -> None:
        self._routes[(method, path)] = handler
        self._paths.add(path)

    def paths(self) -> set[tuple[str, str]]:
        return set(self._routes)

    async def __call__(self, scope: Scope, exchange: Exchange) -> None:
        path = scope.path.rstrip("/") or "/"
        handler = self._routes.get((scope.method, path))
        if handler is None:
            if path in self._paths:
                err = HttpError(
                    405, f"method {scope.method} not allowed on {path}", code="method_not_allowed"
                )
            else:
                err = HttpError(404, f"no route for {scope.method} {path}", code="unknown_url")
            send_error(exchange, err)
            return
        try:
            await handler(scope, exchange)
        except HttpError as err:
            send_error(exchange, err)
        except ClientDisconnected:
            raise
        except Exception as exc:  # a bug here: one 500 with a body, and the traceback logged
            log.exception("%s %s failed", scope.method, path)
            send_error(
                exchange,
                HttpError(
                    500,
                    f"internal error: {type(exc).__name__}: {exc}",
                    type=SERVER_ERROR,
                    code="internal_error",
                ),
            )


async def until_disconnect(exchange: Exchange, work: Awaitable[None]) -> None:
    """Run ``work`` (a route's body) and cancel it if the client leaves first, so what it
    ran on the engine is aborted at once; a write to a gone client ends it the same way."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    def on_disconnect(_: object) -> None:
        nonlocal gone
        gone = True
        task.cancel()

    disconnect: Any = exchange.client_disconnect()
    disconnect.add_done_callback(on_disconnect)
    try:
        await work
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        log.debug("client disconnected; request aborted")
    except ClientDisconnected:
        log.debug("client disconnected while its response was written; request aborted")
    finally:
        disconnect.remove_done_callback(on_disconnect)


# ---------------------------------------------------------------- field readers


def get_int(
    body: dict[str, Any], name: str, default: int | None = None, *, minimum: int | None = None
) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise HttpError(400, f"{name} must be an integer, got {value!r}", param=name)
    if minimum is not None and value < minimum:
        raise HttpError(400, f"{name} must be >= {minimum}, got {value}", param=name)
    return value


def get_float(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HttpError(400, f"{name} must be a number, got {value!r}", param=name)
    return float(value)


def get_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HttpError(400, f"{name} must be true or false, got {value!r}", param=name)
    return value


def get_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise HttpError(400, f"{name} must be a string, got {value!r}", param=name)
    return value


def get_int_list(body: dict[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise HttpError(400, f"{name} must be a list of integers", param=name)
    return value


def get_stop_strings(body: dict[str, Any], name: str = "stop") -> list[str]:
    from turnout.engines.mocker_server.text import MAX_STOP_CHARS, MAX_STOP_STRINGS

    value = body.get(name)
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise HttpError(400, f"{name} must be a string or a list of strings", param=name)
    stops = [s for s in stops if s]
    if len(stops) > MAX_STOP_STRINGS:
        raise HttpError(400, f"at most {MAX_STOP_STRINGS} stop strings", param=name)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise HttpError(400, f"stop strings are at most {MAX_STOP_CHARS} characters", param=name)
    return stops
