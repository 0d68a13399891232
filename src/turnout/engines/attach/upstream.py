"""HTTP to one attached server: a bounded keep-alive pool, deadlines on every call, and the
server's failures translated into a small hierarchy of errors.

Why aiohttp and not httpx: relaying a token stream costs the attach process one SSE line
per token. Measured on this machine (uvloop, 40 000 llama.cpp-sized ``data:`` lines read
from a local server): aiohttp 4.7 us of client CPU per line, httpx 12-14 us. At a few
thousand tokens per second per process the difference is a core.

Deadlines (``Deadlines``): ``connect`` for the TCP connection; ``first_byte`` from sending a
stream request to its first event (it covers the server's queue and the prompt's prefill);
``idle`` between two events of a stream (a server that hangs mid-stream); ``probe`` for
every whole call (health, metrics, tokenize, the server's description). The stream deadlines
are one timer per stream, re-armed lazily: each event costs one clock read.

Errors::

    UpstreamError                  the server did not serve the call; names the server
    ├── Unreachable                no connection (refused, reset, DNS, connect deadline)
    ├── UpstreamTimeout            a deadline passed (``phase``: first_byte, idle, probe)
    ├── UpstreamStatus             it answered an HTTP error (``status``, its ``message``)
    ├── UpstreamGarbage            it answered something that is not what its API sends
    └── StreamCut                  the connection broke in the middle of a stream

Leaving a stream early (the consumer closes the generator, or is cancelled) closes its
connection at once: the server sees the client gone and stops generating.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

__all__ = [
    "Deadlines",
    "StreamCut",
    "Unreachable",
    "Upstream",
    "UpstreamError",
    "UpstreamGarbage",
    "UpstreamStatus",
    "UpstreamTimeout",
]

#: aiohttp's read buffer per connection; a stream line longer than twice this (one SSE
#: event: a token with 20 alternatives is ~2 KB) is refused as garbage.
READ_BUFFER_BYTES = 512 * 1024
#: Largest whole body (metrics, a description) read from a server.
MAX_BODY_BYTES = 16 * 1024 * 1024
#: Stream requests are encoded with msgspec (a long token-id prompt costs the stdlib's
#: ``json`` several times more).
_encode = msgspec.json.Encoder().encode
_JSON = {"Content-Type": "application/json"}
#: How much of a server's error body is quoted in messages.
_QUOTE = 300


class UpstreamError(Exception):
    """The server at ``url`` did not serve a call; the message says how."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.detail = message


class Unreachable(UpstreamError):
    """No connection could be made (refused, reset before an answer, connect deadline)."""


class UpstreamTimeout(UpstreamError):
    """A deadline passed; ``phase`` is ``first_byte``, ``idle`` or ``probe``."""

    def __init__(self, url: str, phase: str, seconds: float) -> None:
        super().__init__(url, f"no answer within the {phase} deadline ({seconds:g} s)")
        self.phase = phase


class UpstreamStatus(UpstreamError):
    """The server answered with an HTTP error: ``status`` and the message of its body."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(url, f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class UpstreamGarbage(UpstreamError):
    """The server answered, but not in its API's shape (not JSON, a field of the wrong type)."""


class StreamCut(UpstreamError):
    """The connection broke after the stream began."""


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Seconds allowed for each phase of a call (see the module doc)."""

    connect: float = 3.0
    first_byte: float = 300.0
    idle: float = 30.0
    probe: float = 5.0

    def __post_init__(self) -> None:
        for name in ("connect", "first_byte", "idle", "probe"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"the {name} deadline must be a positive number, got {value}")


def error_message(body: bytes) -> str:
    """The human part of a server's error body: OpenAI's ``error.message``, vLLM's older
    top-level ``message``, FastAPI's ``detail``, else the start of the raw text."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if isinstance(data.get(key), str):
                return str(data[key])
    text = body[:_QUOTE].decode("utf-8", "replace").strip()
    return text or "(empty body)"


class _Watch:
    """One stream's deadline timer. It fires when the stream has waited for the server for
    ``limit`` seconds (since ``last``) and cancels the task; time the consumer spends
    elsewhere never counts (``waiting`` is False then). Re-armed lazily: when it fires early
    it moves to the next possible expiry, so a line costs one clock read and three
    attribute writes, and no timer."""

    __slots__ = ("_handle", "_task", "fired", "last", "limit", "loop", "waiting")

    def __init__(self, limit: float) -> None:
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self.limit = limit
        self.last = self.loop.time()
        self.waiting = True
        self.fired = False
        self._handle: asyncio.TimerHandle | None = self.loop.call_at(self.last + limit, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        due = self.last + self.limit if self.waiting else now + self.limit
        if now < due:
            self._handle = self.loop.call_at(due, self._check)
            return
        self._handle = None
        self.fired = True
        self._task.cancel()

    def set_limit(self, limit: float) -> None:
        """Change the allowed silence (first byte -> idle); a shorter one takes effect now."""
        self.limit = limit
        if self._handle is not None and self.last + limit < self._handle.when():
            self._handle.cancel()
            self._handle = self.loop.call_at(self.last + limit, self._check)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class Upstream:
    """HTTP/1.1 to one server (``base_url``), with at most ``pool_size`` connections kept
    alive. Open it (``open``) on the loop that uses it; ``close`` it when done."""

    def __init__(self, base_url: str, deadlines: Deadlines, *, pool_size: int = 64) -> None:
        if pool_size < 1:
            raise ValueError(f"pool_size must be at least 1, got {pool_size}")
        self.base_url = base_url.rstrip("/")
        self.deadlines = deadlines
        self.pool_size = pool_size
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        if self._session is not None:
            return
        connector = aiohttp.TCPConnector(
            limit=self.pool_size, limit_per_host=self.pool_size, keepalive_timeout=30.0
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.deadlines.connect),
            read_bufsize=READ_BUFFER_BYTES,
        )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _require(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(f"the HTTP client of {self.base_url} is not open")
        return self._session

    # ------------------------------------------------------------ whole calls

    async def get_json(self, path: str) -> Any:
        return _parse_json(self.base_url + path, await self.call("GET", path))

    async def post_json(self, path: str, body: Any) -> Any:
        return _parse_json(self.base_url + path, await self.call("POST", path, body))

    async def get_text(self, path: str) -> str:
        return (await self.call("GET", path)).decode("utf-8", "replace")

    async def call(self, method: str, path: str, body: Any = None) -> bytes:
        """One whole call under the probe deadline: the body of a 2xx answer, or an
        ``UpstreamError``."""
        session = self._require()
        url = self.base_url + path
        try:
            async with asyncio.timeout(self.deadlines.probe):
                async with session.request(method, url, json=body) as resp:
                    data = await _read_bounded(resp, url)
                    if resp.status >= 400:
                        raise UpstreamStatus(url, resp.status, error_message(data))
                    return data
        except TimeoutError:
            raise UpstreamTimeout(url, "probe", self.deadlines.probe) from None
        except aiohttp.ClientError as exc:
            raise _translate(url, exc, started=False) from exc

    # ------------------------------------------------------------ streams

    async def stream_lines(
        self, path: str, body: Any, traceparent: str = ""
    ) -> AsyncGenerator[bytes, None]:
        """POST ``body`` and yield the stream's non-empty lines (SSE ``data: ...`` and
        ``error: ...`` lines, without the line end). Raises ``UpstreamStatus`` for an HTTP
        error answer, ``UpstreamTimeout`` past the first-byte or idle deadline, ``Unreachable``
        before the answer began and ``StreamCut`` after. ``traceparent`` (W3C; "": none) goes
        with the request, so a server that traces (vLLM's or SGLang's OTLP flags) continues
        the request's trace."""
        session = self._require()
        url = self.base_url + path
        deadlines = self.deadlines
        watch = _Watch(deadlines.first_byte)
        started = False
        complete = False
        resp: aiohttp.ClientResponse | None = None
        headers = {**_JSON, "traceparent": traceparent} if traceparent else _JSON
        try:
            resp = await session.post(url, data=_encode(body), headers=headers)
            if resp.status >= 400:
                data = await _read_bounded(resp, url)
                raise UpstreamStatus(url, resp.status, error_message(data))
            content = resp.content
            while True:
                watch.waiting = True
                watch.last = watch.loop.time()
                line = await content.readline()
                watch.waiting = False
                if not line:
                    complete = True
                    return
                if not started:
                    started = True
                    watch.set_limit(deadlines.idle)
                line = line.rstrip(b"\r\n")
                if line:
                    yield line
        except asyncio.CancelledError:
            if watch.fired:
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                phase = "idle" if started else "first_byte"
                raise UpstreamTimeout(url, phase, watch.limit) from None
            raise
        except ValueError as exc:  # aiohttp: a line over twice READ_BUFFER_BYTES
            raise UpstreamGarbage(url, f"a stream line is too long: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise _translate(url, exc, started=resp is not None) from exc
        finally:
            watch.close()
            if resp is not None:
                if complete:
                    resp.release()  # read to its end: the connection goes back to the pool
                else:
                    # Closing (not releasing) a stream we leave early drops the connection:
                    # the server sees the client gone and stops generating.
                    resp.close()


def _translate(url: str, exc: aiohttp.ClientError, *, started: bool) -> UpstreamError:
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ServerTimeoutError):
        return Unreachable(url, f"cannot connect ({exc})")
    if isinstance(exc, aiohttp.ClientResponseError):
        return UpstreamGarbage(url, f"not a valid HTTP answer ({exc.message})")
    if started:
        return StreamCut(url, f"the connection broke ({type(exc).__name__}: {exc})")
    return Unreachable(url, f"the connection broke before an answer ({type(exc).__name__})")


async def _read_bounded(resp: aiohttp.ClientResponse, url: str) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise UpstreamGarbage(url, f"a body over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_json(url: str, data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        quoted = data[:80].decode("utf-8", "replace")
        raise UpstreamGarbage(url, f"the answer is not JSON: {quoted!r}") from None


def sse_payload(line: bytes) -> tuple[str, bytes] | None:
    """``(field, value)`` of an SSE line we act on (``data`` or ``error``); None for
    comments, ``event:``/``id:`` lines and the like."""
    field, sep, value = line.partition(b":")
    if not sep or field not in (b"data", b"error"):
        return None
    return field.decode(), value[1:] if value.startswith(b" ") else value
