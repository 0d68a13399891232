"""One request on a connection: its body as it arrives, and its one response."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING, Any

from .exchange import HeaderList, Scope
from .wire import CONTINUE, LAST_CHUNK, STATUS_LINES, error_body

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger("turnout.http")


class HttpExchange:
    """One request on a connection: its body as it arrives, and its response."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_continue",
        "_disconnect",
        "_extra_head",
        "_waiter",
        "buffered",
        "chunked",
        "eof",
        "finished",
        "keep_alive",
        "received",
        "scope",
        "started",
        "task",
    )

    def __init__(
        self, conn: Connection, scope: Scope, *, keep_alive: bool, expect_continue: bool
    ) -> None:
        self._conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self._continue = expect_continue
        self._chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        #: Body bytes that came (read by the route or not).
        self.received = 0
        self.eof = False
        self._waiter: asyncio.Future[None] | None = None
        self._extra_head = b""
        self._disconnect: asyncio.Future[None] | None = None
        self.started = False
        self.chunked = False
        self.finished = False
        self.task: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- body (from the parser)

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self.buffered += len(data)
        self.received += len(data)
        self._wake()

    def feed_eof(self) -> None:
        self.eof = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_connection_lost(self, exc: BaseException) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        gone = self._disconnect
        if gone is not None and not gone.done():
            gone.set_result(None)

    # ---------------------------------------------------------------- body (for the route)

    async def __call__(self) -> bytes:
        if self.eof and not self._continue:  # all here already (most requests): no iterator
            chunks = self._chunks
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self.buffered = 0
            self._conn.maybe_resume_reading()
            return body
        parts = [part async for part in self]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def __aiter__(self) -> Any:
        conn = self._conn
        if self._continue:
            self._continue = False
            if not self.eof and not conn.closed:
                conn.write(CONTINUE)
        while True:
            while self._chunks:
                data = self._chunks.popleft()
                self.buffered -= len(data)
                conn.maybe_resume_reading()
                yield data
            if self.eof:
                return
            if conn.closed:
                raise conn.lost
            self._waiter = conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def client_disconnect(self) -> asyncio.Future[None]:
        """A future resolved when the client goes (shared: never cancel it)."""
        if self._disconnect is None:
            self._disconnect = self._conn.loop.create_future()
            if self._conn.closed:
                self._disconnect.set_result(None)
        return self._disconnect

    # ---------------------------------------------------------------- response

    def _head(self, status: int, headers: HeaderList, framing: bytes) -> bytes:
        conn = self._conn
        if conn.closing or conn.unread_body_exceeds_allowance(self):
            self.keep_alive = False
        line = STATUS_LINES.get(status) or f"HTTP/1.1 {status} Status\r\n".encode("latin-1")
        parts = [line, conn.server.date.get(), self._extra_head]
        for name, value in headers:
            parts.append(f"{name}: {value}\r\n".encode("latin-1"))
        parts.append(framing)
        parts.append(b"\r\n" if self.keep_alive else b"connection: close\r\n\r\n")
        return b"".join(parts)

    def add_response_header(self, name: str, value: str) -> None:
        self._extra_head += f"{name}: {value}\r\n".encode("latin-1")

    def response_bytes(self, status: int, headers: HeaderList, body: bytes) -> None:
        conn = self._conn
        if conn.closed:  # nobody to answer (the server may have answered already)
            self.started = self.finished = True
            return
        if self.started:
            raise RuntimeError("the response was already started")
        self.started = self.finished = True
        head = self._head(status, headers, b"content-length: %d\r\n" % len(body))
        if len(body) < 16384:
            conn.write_now(head + body)
        else:
            conn.write_now(head)
            conn.write_now(body)

    def response_empty(self, status: int, headers: HeaderList) -> None:
        self.response_bytes(status, headers, b"")

    def response_stream(self, status: int, headers: HeaderList) -> HttpExchange:
        if self.started:
            raise RuntimeError("the response was already started")
        self.started = True
        conn = self._conn
        if conn.closed:
            raise conn.lost
        # HTTP/1.0 has no chunked encoding: its streamed bodies end with the connection.
        self.chunked = self.scope.http_version != "1.0"
        if not self.chunked:
            self.keep_alive = False
        framing = b"transfer-encoding: chunked\r\n" if self.chunked else b""
        conn.write(self._head(status, headers, framing))
        return self

    async def send_bytes(self, data: bytes) -> None:
        """One piece of a streamed body; waits while the client's socket is full."""
        conn = self._conn
        if conn.closed:
            raise conn.lost
        if not data:
            return  # an empty chunk would end the body
        conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        if conn.write_paused or conn.pending > conn.limits.write_high_water:
            conn.flush()
            if conn.write_paused:
                await conn.drain()

    def finish(self) -> None:
        """End the response (after the route returned)."""
        if self.finished:
            return
        self.finished = True
        conn = self._conn
        if not self.started and conn.closed:
            self.started = True  # the client left before an answer: nobody to answer
            return
        if not self.started:
            log.error("%s %s: the route returned no response", self.scope.method,
                      self.scope.path)  # fmt: skip
            self.started = True
            self.keep_alive = False
            body = error_body("the server produced no response", "internal_error")
            self.response_bytes_unchecked(500, body)
            return
        if self.chunked and not conn.closed:
            conn.write(LAST_CHUNK)

    def response_bytes_unchecked(self, status: int, body: bytes) -> None:
        """Write a JSON error response whatever the route did (server-side failures)."""
        head = self._head(
            status,
            [("content-type", "application/json")],
            b"content-length: %d\r\n" % len(body),
        )
        self._conn.write(head + body)
