"""Server end of the ``tcp`` request plane: ``TcpServer`` and its per-connection state.

Each REQUEST runs its handler in a task that spends one credit per DATA frame and waits when it
has none; the client returns credit as it consumes, so a slow consumer stops its handler at
most ``WINDOW`` items ahead. Response items of one stream produced within an event-loop
iteration share one DATA frame, or several when together they would pass the frame bound
(``max_frame_bytes``, which the client's reader enforces); a single item over the bound
ends its stream with an ERROR naming the sizes, and the connection, shared with other
streams, stays up.

A connection is the client's to keep alive: one with open streams that hears nothing (no
request, no credit, no heartbeat: a frozen frontend) for ``idle_timeout`` is dropped and its
handlers cancelled, as the client drops a silent server. A REQUEST whose stream id is still
live on its connection is answered with an ERROR and the live stream goes on untouched.

With plane credentials (``plane_tls``) every connection runs mutual TLS, and gets its
request-plane protocol only once its peer showed a certificate the deployment CA signed;
refused peers are logged, rate-limited (``tls``).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import TYPE_CHECKING

from turnout.errors import RequestPlaneError
from turnout.protocols.model import TransportAddress
from turnout.runtime.addresses import format_host_port
from turnout.runtime.context import RequestContext
from turnout.runtime.log_context import bind_request
from turnout.runtime.request_plane.base import (
    Handler,
    RequestPlaneServer,
    as_bytes,
    drain_tasks,
)
from turnout.runtime.request_plane.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    FRAME_OVERHEAD,
    WINDOW,
    Frame,
    Kind,
    split_items,
)
from turnout.runtime.request_plane.tcp.connection import (
    _CREDIT,
    _DATA,
    HEARTBEAT_INTERVAL,
    IDLE_TIMEOUT,
    _Connection,
    logger,
)
from turnout.runtime.request_plane.tcp.tls import (
    TLS_HANDSHAKE_TIMEOUT,
    TlsAcceptor,
    tls_refusal_log,
)

if TYPE_CHECKING:
    from turnout.runtime.plane_tls import PlaneTls

#: Streams one server runs at once; more are refused (REJECT: the client tries elsewhere).
MAX_STREAMS = 4096


class _ServerStream:
    """One request being handled. ``credit`` is changed by the handler task (spends) and by
    CREDIT frames (returns); ``cancelled_by_client`` is set by CANCEL and connection loss."""

    __slots__ = (
        "cancelled_by_client",
        "credit",
        "ctx",
        "path",
        "pending",
        "stream_id",
        "task",
        "waiter",
    )

    def __init__(self, stream_id: int, path: str, ctx: RequestContext) -> None:
        self.stream_id = stream_id
        self.path = path
        self.ctx = ctx
        self.credit = WINDOW
        self.waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None
        self.cancelled_by_client = False
        #: Items produced since the last flush, written as one DATA frame (in order).
        self.pending: list[bytes] = []

    def add_credit(self, num: int) -> None:
        self.credit += num
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def cancel(self) -> None:
        self.cancelled_by_client = True
        self.pending = []  # nobody will read them
        self.ctx.cancel()
        if self.task is not None:
            self.task.cancel()


class _ServerConnection(_Connection):
    """Server end of one connection. Response items are not framed one by one: they wait in
    their stream's ``pending`` list until the flush, which frames each stream's batch once
    (a burst of items costs one frame; a steady token stream costs what framing each would).
    Any other frame of a stream is preceded by its pending items (``write_pending``), so order
    within a stream holds."""

    def __init__(self, server: TcpServer) -> None:
        super().__init__(server.max_frame_bytes, server.heartbeat_interval, server.idle_timeout)
        self.server = server
        self.streams: dict[int, _ServerStream] = {}
        #: Streams with pending items, in the order they got their first one since the flush.
        self._dirty: list[_ServerStream] = []

    def has_streams(self) -> bool:
        return bool(self.streams)

    def push(self, stream: _ServerStream, item: bytes) -> None:
        """Queue one response item of ``stream`` for the next flush."""
        pending = stream.pending
        pending.append(item)
        if len(pending) == 1:
            self._dirty.append(stream)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush)

    def write_pending(self, stream: _ServerStream) -> None:
        pending = stream.pending
        if pending:
            stream.pending = []
            if self._closing:
                return
            if len(pending) == 1:
                self._writer.append_data(stream.stream_id, pending[0])
                return
            budget = self.server.item_limit
            if sum(map(len, pending)) <= budget:
                self._writer.append(Frame(_DATA, stream.stream_id, pending))
                return
            for run in split_items(pending, budget):
                data = run[0] if len(run) == 1 else run
                self._writer.append(Frame(_DATA, stream.stream_id, data))

    def _flush(self) -> None:
        if self._dirty:
            dirty = self._dirty
            self._dirty = []
            for stream in dirty:
                self.write_pending(stream)
        super()._flush()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server._conns.add(self)

    def on_frame(self, frame: Frame) -> None:
        kind = frame.kind
        if kind == _CREDIT:
            stream = self.streams.get(frame.stream_id)
            if stream is not None:
                stream.add_credit(frame.num)
        elif kind == Kind.REQUEST:
            self.server._open(self, frame)
        elif kind == Kind.CANCEL:
            stream = self.streams.pop(frame.stream_id, None)
            if stream is not None:
                stream.cancel()

    def on_lost(self, exc: Exception | None) -> None:
        self.server._conns.discard(self)
        streams = list(self.streams.values())
        self.streams.clear()
        for stream in streams:
            stream.cancel()


class TcpServer(RequestPlaneServer):
    """Serves registered handlers on ``host`` (port 0: the OS picks one).

    The published address names ``advertise_host`` (default: the bound address), so a server
    bound to a wildcard can tell clients on other hosts where to dial.

    ``heartbeat_interval`` (seconds, 0: none) paces the HEARTBEAT frames of silent
    connections; ``idle_timeout`` (seconds, 0: never) is how long a connection with open
    streams may hear nothing from its client (which heartbeats every second while it waits)
    before it is dropped and its handlers cancelled; ``max_streams`` bounds the streams run
    at once (more get REJECT); ``max_frame_bytes`` bounds a frame either way: a larger request
    drops its connection, a larger reply item fails its stream. ``plane_tls``: mutual TLS,
    a client certificate signed by its CA required (``tls_handshake_timeout`` seconds to show
    it); the refused peers are counted in ``refusals``.
    """

    kind = "tcp"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise_host: str | None = None,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        idle_timeout: float = IDLE_TIMEOUT,
        max_streams: int = MAX_STREAMS,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        plane_tls: PlaneTls | None = None,
        tls_handshake_timeout: float = TLS_HANDSHAKE_TIMEOUT,
    ) -> None:
        super().__init__()
        #: The TLS server context (None: plain TCP), loaded once, here.
        self._tls: ssl.SSLContext | None = plane_tls.server_context() if plane_tls else None
        self.tls_handshake_timeout = tls_handshake_timeout
        #: Peers refused at the TLS handshake: counted, and logged rate-limited.
        self.refusals = tls_refusal_log()
        self._acceptor: TlsAcceptor | None = None
        self.heartbeat_interval = heartbeat_interval
        self.idle_timeout = idle_timeout
        self.max_streams = max_streams
        self.max_frame_bytes = max_frame_bytes
        #: The most bytes of items one DATA frame carries (the rest of it is framing).
        self.item_limit = max_frame_bytes - FRAME_OVERHEAD
        self.host = host
        self.port = port
        self.advertise_host = advertise_host
        self._inflight: set[_ServerStream] = set()
        self._conns: set[_ServerConnection] = set()
        self._server: asyncio.Server | None = None
        self._address: TransportAddress | None = None

    async def start(self) -> TransportAddress:
        if self._address is not None:
            return self._address
        if self._tls is None:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(
                lambda: _ServerConnection(self), self.host, self.port
            )
            host, port = self._server.sockets[0].getsockname()[:2]
        else:
            self._acceptor = TlsAcceptor(
                lambda: _ServerConnection(self),
                self._tls,
                self.refusals,
                handshake_timeout=self.tls_handshake_timeout,
            )
            host, port = self._acceptor.listen(self.host, self.port)
        self._accepting = True
        address = format_host_port(self.advertise_host or host, port)
        self._address = TransportAddress(kind=self.kind, address=address)
        return self._address

    async def stop(self, drain_timeout: float = 5.0) -> None:
        self._accepting = False
        if self._server is not None:
            self._server.close()
        if self._acceptor is not None:
            await self._acceptor.close()
            self._acceptor = None
        await drain_tasks([s.task for s in self._inflight if s.task], drain_timeout)
        conns = list(self._conns)
        for conn in conns:
            conn.close()
        if conns:
            await asyncio.wait([conn.closed for conn in conns], timeout=1.0)
            for conn in conns:
                if conn.transport is not None and not conn.closed.done():
                    conn.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def _open(self, conn: _ServerConnection, frame: Frame) -> None:
        sid = frame.stream_id
        path = frame.text
        if sid in conn.streams:
            # A client never reuses a live id: this one is broken or hostile. Refuse the
            # request by name; the live stream is not replaced (its handler goes on).
            logger.warning(
                "tcp request plane: peer %s reused live stream id %d; refused", conn._peer(), sid
            )
            text = f"stream id {sid} is already live on this connection; a request needs a new id"
            conn.send(Frame(Kind.ERROR, sid, text=text))
            return
        if not self._takes(path):
            conn.send(Frame(Kind.REJECT, sid, text=f"not taking requests for {path!r}"))
            return
        handler = self._handlers.get(path)
        if handler is None:  # answered even at the stream limit: a client's probe is answered
            conn.send(Frame(Kind.ERROR, sid, text=f"unknown endpoint {path!r}"))
            return
        if len(self._inflight) >= self.max_streams:
            conn.send(Frame(Kind.REJECT, sid, text=f"at its limit of {self.max_streams} streams"))
            return
        payload = frame.data
        if not isinstance(payload, bytes):
            conn.send(Frame(Kind.ERROR, sid, text="request payload must be bytes"))
            return
        stream = _ServerStream(sid, path, RequestContext(frame.text2 or None, frame.text3))
        conn.streams[sid] = stream
        self._inflight.add(stream)
        conn.send(Frame(Kind.ACK, sid))
        task = asyncio.get_running_loop().create_task(self._run(conn, stream, handler, payload))
        stream.task = task
        task.add_done_callback(lambda _: self._on_done(conn, stream))

    def _on_done(self, conn: _ServerConnection, stream: _ServerStream) -> None:
        """Bookkeeping when a handler task ends, however it ends: even a task cancelled
        before its first step, whose ``finally`` never runs."""
        conn.streams.pop(stream.stream_id, None)
        self._inflight.discard(stream)
        if stream.task is not None and stream.task.cancelled() and not stream.cancelled_by_client:
            # Cancelled by the server (drain ran out): the client must not hang.
            stream.ctx.cancel()
            conn.write_pending(stream)
            conn.send(Frame(Kind.ABORT, stream.stream_id))

    async def _run(
        self, conn: _ServerConnection, stream: _ServerStream, handler: Handler, payload: bytes
    ) -> None:
        push = conn.push
        limit = self.item_limit
        bind_request(stream.ctx)
        items = handler(payload, stream.ctx)
        try:
            async for item in items:
                if item.__class__ is not bytes:
                    item = as_bytes(item)
                if len(item) > limit:
                    raise RequestPlaneError(
                        f"a reply item of {len(item)} bytes is over the request plane's frame "
                        f"limit ({self.max_frame_bytes} bytes, --max-frame-bytes)"
                    )
                while stream.credit <= 0:
                    stream.waiter = asyncio.get_running_loop().create_future()
                    await stream.waiter
                stream.credit -= 1
                push(stream, item)
            conn.write_pending(stream)
            conn.send(Frame(Kind.END, stream.stream_id))
        except Exception as exc:
            logger.warning("handler for %s raised: %r", stream.path, exc)
            conn.write_pending(stream)
            conn.send(Frame(Kind.ERROR, stream.stream_id, text=f"{type(exc).__name__}: {exc}"))
        finally:
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                await aclose()
