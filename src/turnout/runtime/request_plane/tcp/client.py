"""Client end of the ``tcp`` request plane: ``TcpClient``, its connections and streams.

A stream's frames land in an ``Inbox`` owned by the connection; the iterator handed to the
caller (``_TcpStream``, a ``CreditedStream``) reads it and returns credit as it consumes, so
dropping the iterator can cancel the stream. Error mapping: nothing sent or REJECT ->
``PeerUnavailable``; connection lost before ACK -> ``PeerUnavailable``, after ACK or ABORT ->
``StreamBroken``; ERROR -> ``RemoteError``. A request payload over the frame bound
(``max_frame_bytes``) is refused here with ``RequestPlaneError``, never sent: the server would
drop the connection it shares with other streams. A peer announcing a reply frame over the
bound loses the connection (see ``connection``).

A peer must show it speaks the plane: a new connection that hears no frame within
``HANDSHAKE_TIMEOUT`` of its first request (the server acknowledges a request as it reads it),
or hears a frame a server never sends (a REQUEST echoed back, say), is dropped, and its
streams, none acknowledged, fail with ``PeerUnavailable``: the caller sets the instance aside
and tries another, at once rather than after the idle timeout, and not by migrating. Whoever
can write the discovery store can announce an instance at any address.

Liveness (the timer is ``connection``'s): with streams open, the client heartbeats a
connection it wrote nothing on, so the server can tell a quiet consumer from a frozen one. A
peer heard nothing from for ``silence_deadline`` is reported ``SILENT`` to the peer listeners
(the component layer sets its instances aside at once: a frozen worker keeps its TCP
connection and its discovery lease for a while), ``ANSWERING`` when heard again, and ``GONE``
when its connection is dropped (at ``idle_timeout``, which fails its streams).

With plane credentials (``plane_tls``) every connection runs mutual TLS: the client shows its
certificate, and checks the server's against the deployment CA and the host it dials (the
host of the instance's published address), so a worker's certificate must name its
advertised host. A server that fails that check is ``PeerUnavailable`` (logged, rate-limited
per host), as is one that refuses this client's certificate (under TLS 1.3 the client learns
it only as the connection closes before any ACK; the server logs why).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from turnout.errors import PeerUnavailable, RequestPlaneError
from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.request_plane.base import RequestPlaneClient
from turnout.runtime.request_plane.credited_stream import OVERRUN, CreditedStream, Inbox
from turnout.runtime.request_plane.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    FRAME_OVERHEAD,
    Frame,
    Kind,
)
from turnout.runtime.request_plane.tcp.connection import (
    _CREDIT,
    _DATA,
    HEARTBEAT_INTERVAL,
    IDLE_TIMEOUT,
    _Connection,
)
from turnout.runtime.request_plane.tcp.tls import (
    TLS_HANDSHAKE_TIMEOUT,
    describe_tls_failure,
    tls_refusal_log,
)

if TYPE_CHECKING:
    from turnout.runtime.plane_tls import PlaneTls

_CONNECT_TIMEOUT = 5.0
#: Seconds a connection with open streams may hear nothing before its peer is reported
#: ``SILENT`` (three of the server's heartbeat intervals): callers set it aside at once, while
#: its streams wait on until the idle timeout.
SILENCE_DEADLINE = 3 * HEARTBEAT_INTERVAL
#: Seconds a new connection may take to answer its first request with any frame (a server
#: acknowledges a request in the loop iteration that reads it, and heartbeats every 1 s).
HANDSHAKE_TIMEOUT = 3.0
#: The frames a server sends; any other kind from a peer means it does not speak the plane.
_SERVER_KINDS = frozenset(
    int(k) for k in (Kind.ACK, Kind.DATA, Kind.END, Kind.ERROR, Kind.REJECT, Kind.ABORT,
                     Kind.HEARTBEAT)
)  # fmt: skip


#: What a failed TLS handshake raises from ``create_connection`` (a refused connect does not
#: get that far).
_HANDSHAKE_ERRORS = (ssl.SSLError, ConnectionResetError, ConnectionAbortedError)


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise PeerUnavailable(f"bad tcp address {address!r}: expected host:port")
    return host.strip("[]"), int(port)


class _ClientConnection(_Connection):
    def __init__(self, client: TcpClient, address: str) -> None:
        super().__init__(client.max_frame_bytes, client.heartbeat_interval, client.idle_timeout)
        self.client = client
        self.address = address
        #: How its streams' errors name the peer.
        self.peer_name = f"tcp peer {address}"
        self.inboxes: dict[int, Inbox] = {}
        self._ids = itertools.count(1)
        #: Set on the first frame of the plane heard from the peer; until then, the first
        #: request's ``HANDSHAKE_TIMEOUT`` runs (``_handshake_timer``).
        self._verified = False
        self._handshake_timer: asyncio.TimerHandle | None = None

    def has_streams(self) -> bool:
        return bool(self.inboxes)

    def on_silence(self, silent_for: float, heard: bool) -> None:
        """Past the silence deadline the peer is reported ``SILENT`` (callers stop choosing
        it); heard again, ``ANSWERING``. A silent peer left with no open stream is dropped:
        with nothing to hear from it, only a new connection can tell whether it is back."""
        peers = self.client.silent_peers
        if self.address not in peers:
            peers.observe(self.address, silent_for)
        elif heard:
            peers.heard(self.address)
        elif not self.inboxes:
            self._lose(f"silent for over {peers.deadline:g}s, and no stream is left on it")

    def _check_handshake(self) -> None:
        """``HANDSHAKE_TIMEOUT`` after the first request: drop a peer that said nothing."""
        self._handshake_timer = None
        if self._verified or self._closing:
            return
        self._lose(
            f"no answer within {self.client.handshake_timeout:g}s of a request "
            "(not a turnout request plane, or frozen)"
        )

    def open_stream(
        self, path: str, payload: bytes, request_id: str, traceparent: str = ""
    ) -> tuple[int, Inbox]:
        """Send a request on a new stream; ``PeerUnavailable`` on a connection already closing
        or lost (its request would be dropped, and nothing would ever end the stream)."""
        if not self.is_open:
            reason = f": {self._lost_reason}" if self._lost_reason else ""
            raise PeerUnavailable(f"tcp peer {self.address}: connection lost{reason}")
        if not self._verified and self._handshake_timer is None:
            timeout = self.client.handshake_timeout
            if timeout > 0:
                self._handshake_timer = self._loop.call_later(timeout, self._check_handshake)
        sid = next(self._ids)
        if not self.inboxes:
            self.restart_silence()  # idle until now: the silence counts from this request
        inbox = Inbox(self.peer_name)
        self.inboxes[sid] = inbox
        self.send(Frame(Kind.REQUEST, sid, payload, path, 0, request_id, traceparent))
        return sid, inbox

    def cancel_stream(self, sid: int) -> None:
        if self.inboxes.pop(sid, None) is not None:
            self.send(Frame(Kind.CANCEL, sid))

    def on_frame(self, frame: Frame) -> None:
        kind = frame.kind
        if not self._verified:
            if kind not in _SERVER_KINDS:
                self._lose(f"sent a frame of kind {kind}, which no server sends (not a turnout "
                           "request plane)")  # fmt: skip
                return
            self._verified = True
            if self._handshake_timer is not None:
                self._handshake_timer.cancel()
                self._handshake_timer = None
        inbox = self.inboxes.get(frame.stream_id)
        if inbox is None:
            return  # late frames of a stream the client cancelled
        if kind == _DATA:
            if not inbox.deliver(frame.data):
                self.cancel_stream(frame.stream_id)
                inbox.finish(inbox.lost(OVERRUN))
        elif kind == Kind.ACK:
            inbox.acked = True
        else:
            del self.inboxes[frame.stream_id]
            inbox.end(kind, frame.text)

    def on_lost(self, exc: Exception | None) -> None:
        self.client._forget(self)
        self.client.silent_peers.gone(self.address)
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        inboxes = list(self.inboxes.values())
        self.inboxes.clear()
        reason = f": {exc}" if exc else (f": {self._lost_reason}" if self._lost_reason else "")
        if self.client._tls is not None and not self._verified and not self._lost_reason:
            # Under TLS 1.3 a server refuses a client's certificate after the client's side of
            # the handshake is done: all the client sees is the connection closing.
            reason += " before the server answered (did it refuse this process's --plane-cert?)"
        for inbox in inboxes:
            inbox.finish(inbox.lost(f"connection lost{reason}"))


class _TcpStream(CreditedStream[Inbox]):
    """The caller's iterator over one tcp stream (see ``credited_stream``)."""

    __slots__ = ("_address", "_client", "_conn", "_ctx", "_path", "_payload", "_sid")

    def __init__(
        self, client: TcpClient, address: str, path: str, payload: bytes, ctx: RequestContext
    ) -> None:
        super().__init__()
        self._client = client
        self._address = address
        self._path = path
        self._payload = payload
        self._ctx = ctx
        self._conn: _ClientConnection | None = None
        self._sid = 0

    async def _open(self) -> Inbox:
        self._client.check_payload(self._payload, self._path)
        conn = await self._client._connection(self._address)
        ctx = self._ctx
        self._sid, inbox = conn.open_stream(
            self._path, self._payload, ctx.request_id, ctx.traceparent
        )
        self._conn = conn
        self._payload = b""
        return inbox

    def _return_credit(self, delta: int, total: int) -> None:
        assert self._conn is not None
        self._conn.send(Frame(_CREDIT, self._sid, num=delta))

    def _canceller(self) -> Callable[[], None]:
        assert self._conn is not None
        return functools.partial(self._conn.cancel_stream, self._sid)


class TcpClient(RequestPlaneClient):
    """Streams to tcp peers over one connection per peer address, opened on first use
    (``plane_tls``: over mutual TLS, see the module docstring)."""

    kind = "tcp"

    def __init__(
        self,
        *,
        idle_timeout: float = IDLE_TIMEOUT,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        silence_deadline: float = SILENCE_DEADLINE,
        plane_tls: PlaneTls | None = None,
    ) -> None:
        super().__init__()
        #: The TLS client context (None: plain TCP), loaded once, here.
        self._tls: ssl.SSLContext | None = plane_tls.client_context() if plane_tls else None
        #: Servers whose TLS handshake failed: counted, and logged rate-limited.
        self.refusals = tls_refusal_log()
        #: Seconds a connection with open streams may hear nothing before it is dropped
        #: (0: never).
        self.idle_timeout = idle_timeout
        #: Seconds between the HEARTBEATs sent on a connection with open streams that wrote
        #: nothing (the server drops a connection silent for its own idle timeout; 0: none).
        self.heartbeat_interval = heartbeat_interval
        #: Seconds heard nothing, with streams open, before the peer is reported ``SILENT``
        #: to the peer listeners (0: never).
        self.silent_peers.deadline = silence_deadline
        #: Seconds a new connection may take to answer its first request (0: no bound).
        self.handshake_timeout = handshake_timeout
        #: The bound on a frame, sent (requests) or read (replies).
        self.max_frame_bytes = max_frame_bytes
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

    def check_payload(self, payload: bytes, path: str) -> None:
        """``RequestPlaneError`` for a request whose frame would pass the bound."""
        if len(payload) + len(path) + FRAME_OVERHEAD > self.max_frame_bytes:
            raise RequestPlaneError(
                f"request payload of {len(payload)} bytes is over the request plane's frame "
                f"limit ({self.max_frame_bytes} bytes, --max-frame-bytes)"
            )

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
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # close() cancelled the connect, not this caller: a closed client, not a cancel.
            current = asyncio.current_task()
            if (
                task.cancelled()
                and self._closed
                and current is not None
                and not current.cancelling()
            ):
                raise PeerUnavailable("tcp request plane client is closed") from None
            raise

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
                    lambda: _ClientConnection(self, address), host, port, **self._tls_options(host)
                )
        except (OSError, TimeoutError) as exc:
            if self._tls is not None and isinstance(exc, _HANDSHAKE_ERRORS):
                reason = describe_tls_failure(exc)
                self.refusals.refused(host, f"TLS handshake with {address}", reason)
                message = f"TLS handshake with tcp peer {address} failed: {reason}"
                raise PeerUnavailable(message) from exc
            raise PeerUnavailable(f"cannot connect to tcp peer {address}: {exc}") from exc
        if self._closed:
            conn.close()
            raise PeerUnavailable("tcp request plane client is closed")
        self._conns[address] = conn
        return conn

    def _tls_options(self, host: str) -> dict[str, Any]:
        """``create_connection``'s TLS arguments for a peer at ``host`` (none: plain TCP)."""
        if self._tls is None:
            return {}
        return {
            "ssl": self._tls,
            "server_hostname": host,
            "ssl_handshake_timeout": TLS_HANDSHAKE_TIMEOUT,
        }

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
