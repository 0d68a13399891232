"""The ``tcp`` request plane: one multiplexed connection per peer, length-prefixed msgpack frames.

See ``framing`` for the frames and the exchange of one stream. The pieces:

* ``_Connection``: an ``asyncio.Protocol`` shared by both ends. Outgoing frames are encoded
  into one buffer and written once per event-loop iteration (``call_soon``), so a burst of
  tokens from many streams costs one ``write`` syscall, not one per frame. On the server, the
  items one stream produced within the iteration also share one DATA frame.
* Server side, each REQUEST runs its handler in a task that spends one credit per DATA frame
  and waits when it has none; the client returns credit as it consumes. A slow consumer thus
  stops its handler at most ``WINDOW`` items ahead, and memory stays bounded.
* Client side, a stream's frames land in an ``_Inbox`` (a deque and one waiter) owned by the
  connection; the iterator handed to the caller (``_TcpStream``) reads it, so dropping the
  iterator can cancel the stream (the connection holds the inbox, not the iterator).

Error mapping on the client: nothing sent or REJECT -> ``PeerUnavailable``; connection lost
before ACK -> ``PeerUnavailable``, after ACK or ABORT -> ``StreamBroken``; ERROR ->
``RemoteError``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import socket

from turnout.errors import PeerUnavailable, RemoteError, StreamBroken
from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.request_plane.base import (
    Handler,
    RequestPlaneClient,
    RequestPlaneServer,
    as_bytes,
    drain_tasks,
)
from turnout.runtime.request_plane.framing import (
    CREDIT_BATCH,
    WINDOW,
    Frame,
    FrameError,
    FrameReader,
    FrameWriter,
    Kind,
)

logger = logging.getLogger("turnout.runtime")

_DATA = int(Kind.DATA)
_CREDIT = int(Kind.CREDIT)
_CONNECT_TIMEOUT = 5.0


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise PeerUnavailable(f"bad tcp address {address!r}: expected host:port")
    return host.strip("[]"), int(port)


class _Connection(asyncio.Protocol):
    """Frame I/O over one transport: batched writes, incremental reads."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._writer = FrameWriter()
        self._reader = FrameReader()
        self._flush_scheduled = False
        #: True from close() or connection loss on: frames sent after it are dropped.
        self._closing = False
        self._loop = asyncio.get_running_loop()

    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self._closing

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport: no isinstance check.
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, frame: Frame) -> None:
        if self._closing:
            return
        self._writer.append(frame)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if len(self._writer) and self.transport is not None and not self.closed.done():
            self.transport.write(self._writer.take())

    def close(self) -> None:
        """Flush what is queued, then close (``connection_lost`` follows)."""
        if self.transport is not None and not self.closed.done():
            self._flush()
            self._closing = True
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except FrameError as exc:
            logger.error("dropping tcp connection %s: %s", self._peer(), exc)
            assert self.transport is not None
            self.transport.abort()
            return
        on_frame = self.on_frame
        for frame in frames:
            on_frame(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if not self.closed.done():
            self.closed.set_result(None)
        self.on_lost(exc)

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "?"

    def on_frame(self, frame: Frame) -> None:
        raise NotImplementedError

    def on_lost(self, exc: Exception | None) -> None:
        raise NotImplementedError


# -- server -------------------------------------------------------------------------------


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
        super().__init__()
        self.server = server
        self.streams: dict[int, _ServerStream] = {}
        #: Streams with pending items, in the order they got their first one since the flush.
        self._dirty: list[_ServerStream] = []

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
            if not self._closing:
                data = pending[0] if len(pending) == 1 else pending
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
    """Serves registered handlers on ``host`` (port 0: the OS picks one)."""

    kind = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__()
        self.host = host
        self.port = port
        self._inflight: set[_ServerStream] = set()
        self._conns: set[_ServerConnection] = set()
        self._server: asyncio.Server | None = None
        self._address: TransportAddress | None = None

    async def start(self) -> TransportAddress:
        if self._address is not None:
            return self._address
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerConnection(self), self.host, self.port
        )
        host, port = self._server.sockets[0].getsockname()[:2]
        self._accepting = True
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._address = TransportAddress(kind=self.kind, address=address)
        return self._address

    async def stop(self, drain_timeout: float = 5.0) -> None:
        self._accepting = False
        if self._server is not None:
            self._server.close()
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
        if not self._takes(path):
            conn.send(Frame(Kind.REJECT, sid, text=f"not taking requests for {path!r}"))
            return
        handler = self._handlers.get(path)
        if handler is None:
            conn.send(Frame(Kind.ERROR, sid, text=f"unknown endpoint {path!r}"))
            return
        payload = frame.data
        if not isinstance(payload, bytes):
            conn.send(Frame(Kind.ERROR, sid, text="request payload must be bytes"))
            return
        stream = _ServerStream(sid, path, RequestContext(frame.text2 or None))
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
        items = handler(payload, stream.ctx)
        try:
            async for item in items:
                if item.__class__ is not bytes:
                    item = as_bytes(item)
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


# -- client -------------------------------------------------------------------------------


class _Inbox:
    """What the connection delivers to one client stream. ``terminal`` is set once, by the
    connection (END, ERROR, REJECT, ABORT, loss) or by the consumer (cancel)."""

    __slots__ = ("acked", "items", "terminal", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque[bytes] = collections.deque()
        self.acked = False
        self.terminal: type[StopAsyncIteration] | BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def finish(self, terminal: type[StopAsyncIteration] | BaseException) -> None:
        if self.terminal is None:
            self.terminal = terminal
            self.wake()


class _ClientConnection(_Connection):
    def __init__(self, client: TcpClient, address: str) -> None:
        super().__init__()
        self.client = client
        self.address = address
        self.inboxes: dict[int, _Inbox] = {}
        self._ids = itertools.count(1)

    def open_stream(self, path: str, payload: bytes, request_id: str) -> tuple[int, _Inbox]:
        sid = next(self._ids)
        inbox = _Inbox()
        self.inboxes[sid] = inbox
        self.send(Frame(Kind.REQUEST, sid, payload, path, 0, request_id))
        return sid, inbox

    def cancel_stream(self, sid: int) -> None:
        if self.inboxes.pop(sid, None) is not None:
            self.send(Frame(Kind.CANCEL, sid))

    def on_frame(self, frame: Frame) -> None:
        kind = frame.kind
        inbox = self.inboxes.get(frame.stream_id)
        if inbox is None:
            return  # late frames of a stream the client cancelled
        if kind == _DATA:
            data = frame.data
            if isinstance(data, bytes):
                inbox.items.append(data)
            else:
                inbox.items.extend(data)
            inbox.wake()
        elif kind == Kind.ACK:
            inbox.acked = True
        else:
            del self.inboxes[frame.stream_id]
            if kind == Kind.END:
                inbox.finish(StopAsyncIteration)
            elif kind == Kind.ERROR:
                inbox.finish(RemoteError(frame.text))
            elif kind == Kind.REJECT:
                inbox.finish(PeerUnavailable(f"tcp peer {self.address}: {frame.text}"))
            else:  # ABORT
                inbox.finish(StreamBroken(f"tcp peer {self.address} aborted the stream"))

    def on_lost(self, exc: Exception | None) -> None:
        self.client._forget(self)
        inboxes = list(self.inboxes.values())
        self.inboxes.clear()
        reason = f": {exc}" if exc else ""
        for inbox in inboxes:
            if inbox.acked:
                inbox.finish(StreamBroken(f"connection to tcp peer {self.address} lost{reason}"))
            else:
                inbox.finish(PeerUnavailable(f"connection to tcp peer {self.address} lost{reason}"))


class _TcpStream:
    """The caller's iterator over one stream; sends the REQUEST on the first ``__anext__``."""

    __slots__ = ("_address", "_client", "_conn", "_consumed", "_ctx", "_inbox", "_path",
                 "_payload", "_sid")  # fmt: skip

    def __init__(
        self, client: TcpClient, address: str, path: str, payload: bytes, ctx: RequestContext
    ) -> None:
        self._client = client
        self._address = address
        self._path = path
        self._payload = payload
        self._ctx = ctx
        self._conn: _ClientConnection | None = None
        self._inbox: _Inbox | None = None
        self._sid = 0
        self._consumed = 0

    def __aiter__(self) -> _TcpStream:
        return self

    async def __anext__(self) -> bytes:
        inbox = self._inbox
        if inbox is None:
            conn = await self._client._connection(self._address)
            self._sid, inbox = conn.open_stream(self._path, self._payload, self._ctx.request_id)
            self._conn, self._inbox = conn, inbox
            self._payload = b""
        items = inbox.items
        while not items:
            terminal = inbox.terminal
            if terminal is not None:
                inbox.terminal = StopAsyncIteration  # an error is raised once
                raise terminal
            inbox.waiter = asyncio.get_running_loop().create_future()
            try:
                await inbox.waiter
            except asyncio.CancelledError:
                self._cancel()
                raise
            finally:
                inbox.waiter = None
        self._consumed += 1
        if self._consumed >= CREDIT_BATCH and inbox.terminal is None:
            assert self._conn is not None
            self._conn.send(Frame(_CREDIT, self._sid, num=self._consumed))
            self._consumed = 0
        return items.popleft()

    def _cancel(self) -> None:
        inbox = self._inbox
        if inbox is not None and inbox.terminal is None:
            inbox.terminal = StopAsyncIteration
            assert self._conn is not None
            self._conn.cancel_stream(self._sid)

    async def aclose(self) -> None:
        self._cancel()

    def __del__(self) -> None:
        inbox = self._inbox
        if inbox is not None and inbox.terminal is None and self._conn is not None:
            # Dropped without aclose(): cancel at the next loop iteration (not from inside
            # __del__, which may run in the middle of a frame being written).
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self._conn._loop.call_soon(self._conn.cancel_stream, self._sid)


class TcpClient(RequestPlaneClient):
    """Streams to tcp peers over one connection per peer address, opened on first use."""

    kind = "tcp"

    def __init__(self) -> None:
        self._conns: dict[str, _ClientConnection] = {}
        self._connecting: dict[str, asyncio.Task[_ClientConnection]] = {}
        self._closed = False

    def stream(
        self,
        address: TransportAddress,
        endpoint_path: str,
        payload: bytes,
        ctx: RequestContext,
    ) -> _TcpStream:
        if address.kind != self.kind:
            raise PeerUnavailable(f"tcp client cannot reach a {address.kind!r} address")
        return _TcpStream(self, address.address, endpoint_path, payload, ctx)

    async def _connection(self, address: str) -> _ClientConnection:
        conn = self._conns.get(address)
        if conn is not None and conn.is_open:
            return conn
        if self._closed:
            raise PeerUnavailable("tcp request plane client is closed")
        task = self._connecting.get(address)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._connect(address))
            self._connecting[address] = task
            task.add_done_callback(self._connected)
        # shield: one caller giving up must not abort the connect the others wait for.
        return await asyncio.shield(task)

    def _connected(self, task: asyncio.Task[_ClientConnection]) -> None:
        for address, pending in list(self._connecting.items()):
            if pending is task:
                del self._connecting[address]
        if not task.cancelled():
            task.exception()  # retrieved here, so an abandoned failure is not logged as lost

    async def _connect(self, address: str) -> _ClientConnection:
        host, port = split_address(address)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(_CONNECT_TIMEOUT):
                _, conn = await loop.create_connection(
                    lambda: _ClientConnection(self, address), host, port
                )
        except (OSError, TimeoutError) as exc:
            raise PeerUnavailable(f"cannot connect to tcp peer {address}: {exc}") from exc
        if self._closed:
            conn.close()
            raise PeerUnavailable("tcp request plane client is closed")
        self._conns[address] = conn
        return conn

    def _forget(self, conn: _ClientConnection) -> None:
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]

    async def close(self) -> None:
        self._closed = True
        for task in list(self._connecting.values()):
            task.cancel()
        conns = list(self._conns.values())
        for conn in conns:
            conn.close()
        if conns:
            await asyncio.wait([conn.closed for conn in conns], timeout=1.0)
            for conn in conns:
                if conn.transport is not None and not conn.closed.done():
                    conn.transport.abort()
