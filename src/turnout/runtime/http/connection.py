"""One client connection: parsing, the request queue, deadlines, flow control."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
from typing import TYPE_CHECKING

import httptools

from .exchange import ClientDisconnected, Headers, Scope
from .limits import MalformedRequest, RequestTimeout
from .request import HttpExchange
from .wire import STATUS_LINES, error_body

if TYPE_CHECKING:
    from .server import HttpServer

log = logging.getLogger("turnout.http")

#: Request body bytes a connection reads and drops after a route answered without reading
#: them. When the rest of the body fits, the connection stays open and drops it; when it
#: does not, the answer says ``connection: close`` and at most this much more is read while
#: the answer reaches a client that is still sending, instead of the whole declared body.
DRAIN_ALLOWANCE = 256 * 1024
#: Seconds a closing connection keeps dropping such a body before it closes.
LINGER_SECONDS = 2.0


class _Phase:
    """Where a connection's reading is (what its timer stands for)."""

    IDLE = 0  # between requests (or just opened): keep-alive / first-byte deadline
    HEADERS = 1  # a request's first byte came, its headers have not ended
    BODY = 2  # headers done, the body has not ended


class Connection(asyncio.Protocol):
    """One client connection: parses requests, runs them one at a time, enforces the
    deadlines and bounds of ``HttpLimits``."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = server.loop
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        #: Set by ``stop``: close after the response in flight.
        self.closing = False
        self.lost: ClientDisconnected = ClientDisconnected("the client closed the connection")
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._stall: asyncio.TimerHandle | None = None
        self.read_paused = False
        self.phase = _Phase.IDLE
        self._timer: asyncio.TimerHandle | None = None
        self._url = b""
        self._headers = Headers()
        self._header_bytes = 0
        self._error: tuple[int, str, str] | None = None
        #: The request whose body is being parsed (None between requests).
        self._reading: HttpExchange | None = None
        #: Requests whose responses are not finished; the first one runs.
        self.queue: collections.deque[HttpExchange] = collections.deque()
        self.peer = ""
        #: Response bytes written in this turn of the event loop, sent together at its end
        #: (several SSE events ready at once cost one system call).
        self._out: list[bytes] = []
        self.pending = 0
        #: Body bytes a closing connection still drops (None: not closing that way).
        self._linger_left: int | None = None

    # ---------------------------------------------------------------- writing

    def write(self, data: bytes) -> None:
        """Queue ``data``; it goes out with whatever else is written in this turn of the
        event loop (one system call for several SSE events), or at once when the route is
        done (``finish``)."""
        if not self._out:
            self.loop.call_soon(self.flush)
        self._out.append(data)
        self.pending += len(data)

    def write_now(self, data: bytes) -> None:
        """Send ``data`` (after anything queued) without waiting for the loop's turn: a whole
        response has nothing to be coalesced with."""
        if self._out:
            self._out.append(data)
            self.flush()
        elif not self.closed:
            self.transport.write(data)

    def flush(self) -> None:
        out = self._out
        if not out:
            return
        self._out = []
        self.pending = 0
        if self.closed:
            return
        self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.transport.set_write_buffer_limits(high=self.limits.write_high_water)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = f"{peer[0]}:{peer[1]}"
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self.server.admit(self):
            return
        self._arm(self.limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._disarm()
        if self._stall is not None:
            self._stall.cancel()
        self.server.forget(self)
        lost = self.lost
        for exchange in self.queue:
            exchange.on_connection_lost(lost)
        if self._reading is not None and self._reading not in self.queue:
            self._reading.on_connection_lost(lost)
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_exception(lost)
        # Pipelined requests that never started are dropped with the connection.
        for exchange in list(self.queue)[1:]:
            if exchange.task is None:
                self.queue.remove(exchange)

    def eof_received(self) -> bool | None:
        return None  # close: a half-closed client gets no answer

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def data_received(self, data: bytes) -> None:
        if self._linger_left is not None:
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self._close_after_writes()
            return
        if self.phase == _Phase.IDLE:
            self.phase = _Phase.HEADERS
            if not self.queue:
                self._arm(self.limits.header_timeout)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported", "bad_request")
        except httptools.HttpParserError as exc:
            status, message, code = self._error or (
                400,
                f"malformed HTTP request: {exc}",
                "bad_request",
            )
            self._refuse(status, message, code)

    # ---------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self.phase = _Phase.HEADERS
        self._url = b""
        self._headers = Headers()
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._header_bytes += len(url)
        if self._header_bytes > self.limits.max_header_bytes:
            self._headers_too_large()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > self.limits.max_header_bytes:
            self._headers_too_large()
        self._headers.add(name.decode("latin-1").lower(), value.decode("latin-1"))

    def _headers_too_large(self) -> None:
        self._error = (
            431,
            f"request line and headers exceed {self.limits.max_header_bytes} bytes",
            "headers_too_large",
        )
        raise ValueError("headers too large")  # stops the parser: answered in data_received

    def on_headers_complete(self) -> None:
        parser = self.parser
        path, _, query = self._url.partition(b"?")
        headers = self._headers
        expect = headers.get("expect")
        scope = Scope(
            parser.get_method().decode("ascii"),
            path.decode("latin-1"),
            query.decode("latin-1"),
            headers,
            parser.get_http_version(),
            self.peer,
        )
        exchange = HttpExchange(
            self,
            scope,
            keep_alive=parser.should_keep_alive() and not self.closing,
            expect_continue=expect is not None and expect.lower() == "100-continue",
        )
        self._reading = exchange
        self.phase = _Phase.BODY
        self.queue.append(exchange)
        if len(self.queue) == 1:
            self._arm(self.limits.body_timeout)
            self._start(exchange)
        elif len(self.queue) > self.limits.max_pipelined:
            self._pause_reading()
        self.server.busy(self)

    def on_body(self, body: bytes) -> None:
        exchange = self._reading
        if exchange is None:
            return
        if exchange.finished:
            return  # the route answered without reading it: dropped
        exchange.feed(body)
        if exchange.buffered > self.limits.max_buffered_body:
            self._pause_reading()

    def on_message_complete(self) -> None:
        exchange = self._reading
        self._reading = None
        self.phase = _Phase.IDLE
        if exchange is not None:
            exchange.feed_eof()
        if self.queue and self.queue[0] is exchange:
            self._disarm()  # the request runs; no read deadline until it is answered
        elif not self.queue:
            self._became_idle()

    # ---------------------------------------------------------------- requests

    def _start(self, exchange: HttpExchange) -> None:
        exchange.task = self.loop.create_task(self._run(exchange))

    async def _run(self, exchange: HttpExchange) -> None:
        try:
            await self.server.app(exchange.scope, exchange)
        except ClientDisconnected:
            pass
        except asyncio.CancelledError:
            if not self.closed:
                raise
        except Exception:
            log.exception("%s %s failed", exchange.scope.method, exchange.scope.path)
            if not exchange.started and not self.closed:
                exchange.started = True
                exchange.keep_alive = False
                exchange.response_bytes_unchecked(
                    500, error_body("internal server error", "internal_error")
                )
            elif not exchange.finished:
                self._abort()
            exchange.finished = True
        finally:
            exchange.finish()
            self._done(exchange)

    def _done(self, exchange: HttpExchange) -> None:
        if self.queue and self.queue[0] is exchange:
            self.queue.popleft()
        if self.closed:
            return
        if not exchange.keep_alive:
            if self._reading is exchange:
                self._linger()
            else:
                self._close_after_writes()
            return
        if self._reading is exchange:
            # Its body is still arriving: it is dropped as it comes, under the body deadline.
            self._arm(self.limits.body_timeout)
        self.maybe_resume_reading()
        if self.queue:
            self._start(self.queue[0])
        elif self.phase == _Phase.IDLE:
            self._became_idle()

    def unread_body_exceeds_allowance(self, exchange: HttpExchange) -> bool:
        """Whether answering ``exchange`` now leaves more of its body to come than
        ``DRAIN_ALLOWANCE`` (a chunked body still arriving counts as more): then its answer
        closes the connection rather than have it read the rest."""
        if exchange.eof:
            return False
        declared = exchange.scope.headers.get("content-length")
        if declared is None or not declared.isdigit():
            return True
        return int(declared) - exchange.received > DRAIN_ALLOWANCE

    def _linger(self) -> None:
        """Close after the answer to a request whose body is still arriving: the answer
        goes out followed by the end of the stream, then up to ``DRAIN_ALLOWANCE`` bytes
        of the body are dropped for at most ``LINGER_SECONDS``, so a client still sending
        reads the answer rather than a reset; then the socket closes."""
        self._reading = None
        self._linger_left = DRAIN_ALLOWANCE
        self.flush()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._arm(LINGER_SECONDS)
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    # ---------------------------------------------------------------- flow control

    async def drain(self) -> None:
        """Until the socket's write buffer is under its low-water mark again."""
        self.flush()
        if not self.write_paused:
            return
        if self._drain is None or self._drain.done():
            self._drain = self.loop.create_future()
        if self._stall is None:
            self._stall = self.loop.call_later(self.limits.write_timeout, self._on_write_stall)
        await self._drain

    def _on_write_stall(self) -> None:
        self._stall = None
        self.lost = ClientDisconnected(
            f"the client read nothing for {self.limits.write_timeout:g} s"
        )
        log.debug("connection %s: client stopped reading; closed", self.peer)
        self.server.count_close("write_stall")
        self._abort()

    def _pause_reading(self) -> None:
        if not self.read_paused and not self.closed:
            self.read_paused = True
            self.transport.pause_reading()

    def maybe_resume_reading(self) -> None:
        if not self.read_paused or self.closed:
            return
        head = self.queue[0] if self.queue else None
        reading = self._reading
        if len(self.queue) > self.limits.max_pipelined:
            return
        if reading is not None and reading.buffered > self.limits.max_buffered_body // 2:
            return
        if head is not None and head is not reading and head.buffered:
            return
        self.read_paused = False
        self.transport.resume_reading()

    # ---------------------------------------------------------------- deadlines

    def _arm(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(seconds, self._on_timeout)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _became_idle(self) -> None:
        self._arm(self.limits.keepalive_timeout)
        self.server.idle(self)

    def _on_timeout(self) -> None:
        self._timer = None
        if self.closed:
            return
        if self._linger_left is not None:
            self._close_after_writes()
            return
        limits = self.limits
        if self.phase == _Phase.IDLE:
            self.server.count_close("idle_timeout")
            self._close_after_writes()
            return
        if self.phase == _Phase.HEADERS:
            reason, what, seconds = "header_timeout", "headers", limits.header_timeout
        else:
            reason, what, seconds = "body_timeout", "body", limits.body_timeout
        self.server.count_close(reason)
        message = f"the request's {what} did not arrive within {seconds:g} s"
        self._answer_and_close(408, message, "request_timeout", RequestTimeout(message))

    def _refuse(self, status: int, message: str, code: str) -> None:
        """A request that cannot be parsed."""
        self.server.count_close("bad_request")
        self._answer_and_close(status, message, code, MalformedRequest(message))

    def _answer_and_close(
        self, status: int, message: str, code: str, lost: ClientDisconnected
    ) -> None:
        """A request the server answers itself (unparseable, too slow): the answer goes out
        unless another response is already under way, then the connection closes. A route
        reading that request's body sees ``lost``."""
        log.debug("connection %s: %s", self.peer, message)
        self.lost = lost
        if self.closed:
            return
        head = self.queue[0] if self.queue else None
        if head is None or (head is self._reading and not head.started):
            if head is not None:
                head.started = head.finished = True
                head.keep_alive = False
            body = error_body(message, code)
            self.write(
                STATUS_LINES.get(status, STATUS_LINES[400])
                + b"content-type: application/json\r\nconnection: close\r\n"
                + b"content-length: %d\r\n\r\n" % len(body)
                + body
            )
        self._close_after_writes()

    def _close_after_writes(self) -> None:
        if not self.closed:
            self.flush()
            self.transport.close()

    def _abort(self) -> None:
        if not self.closed:
            self.transport.abort()

    def reject(self, status: int, message: str) -> None:
        """Refused at admission: one answer, then closed (nothing of it is read)."""
        self.closed = True
        body = error_body(message, "overloaded", "overloaded_error")
        self.transport.write(
            STATUS_LINES.get(status, STATUS_LINES[503])
            + b"content-type: application/json\r\nretry-after: 1\r\nconnection: close\r\n"
            + b"content-length: %d\r\n\r\n" % len(body)
            + body
        )
        self.transport.close()

    def evict(self) -> None:
        """Closed to make room for a new connection (it had no request in flight)."""
        self.server.count_close("evicted")
        self._close_after_writes()

    def shut(self) -> None:
        """Server stopping: close now if idle, else after the response in flight."""
        self.closing = True
        if not self.queue:
            self._close_after_writes()
