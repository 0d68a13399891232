"""Client end of the ``nats`` request plane: ``NatsClient`` and its streams.

One reply subscription per client (``turnout.rpc.<client id>.*``), one reply subject per
stream. Server frames carry a sequence number per stream: a gap ends the stream (``StreamBroken``
after the request was taken, ``PeerUnavailable`` before), never a silently shortened stream. A
monitor task ends streams whose server fell silent for ``idle_timeout`` and repeats each
stream's cumulative credit every heartbeat interval (the client's own heartbeat).

As on tcp, a server whose every open stream heard nothing for ``silence_deadline`` is reported
``SILENT`` to the peer listeners (a frozen worker keeps its lease for a while; callers set it
aside at once), ``ANSWERING`` when one of its streams hears from it again, and ``GONE`` when
no stream to it is left.

Every REQUEST says the client takes batch messages (``TAKES_BATCHES``): a server that knows
them sends the frames of several streams in one message on the client's batch subject (stream
id ``BATCH_SID``), each frame naming its stream; one that does not sends one message per frame
on the stream's own subject. Both are read here, frame by frame alike (``_on_frame``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
import uuid
from collections.abc import Callable

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from turnout.errors import PeerUnavailable, RequestPlaneError
from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.nats import NatsConnection, NatsUnavailable, subscribe_confirmed
from turnout.runtime.request_plane.base import RequestPlaneClient
from turnout.runtime.request_plane.credited_stream import OVERRUN, CreditedStream, Inbox
from turnout.runtime.request_plane.framing import DEFAULT_MAX_FRAME_BYTES, Frame, Kind
from turnout.runtime.request_plane.nats.wire import (
    BATCH_SID,
    CLIENT_PREFIX,
    CREDIT,
    DATA,
    FRAME_OVERHEAD,
    HEARTBEAT,
    HEARTBEAT_INTERVAL,
    IDLE_TIMEOUT,
    PART,
    SERVER_PREFIX,
    SILENCE_DEADLINE,
    TAKEN,
    TAKES_BATCHES,
    Outbox,
    decode_batch,
    decode_frame,
    encode_frame,
    logger,
)


class _Inbox(Inbox):
    """What arrives for one client stream, with what NATS needs besides: the stream's
    reply subject, the last sequence number seen, a large item being reassembled from PARTs
    and when the server was last heard (the client's monitor ends a silent stream)."""

    __slots__ = ("last_heard", "partial", "seq", "server", "subject")

    def __init__(self, server: str, subject: str, now: float) -> None:
        super().__init__(f"nats peer {server}")
        self.server = server
        self.subject = subject
        self.seq = 0
        self.partial: bytearray | None = None
        self.last_heard = now


class _NatsStream(CreditedStream[_Inbox]):
    """The caller's iterator over one nats stream (see ``credited_stream``); credit travels
    as the cumulative count consumed, so a lost CREDIT is repaired by the next."""

    __slots__ = ("_address", "_client", "_ctx", "_path", "_payload", "_sid")

    def __init__(
        self, client: NatsClient, address: str, path: str, payload: bytes, ctx: RequestContext
    ) -> None:
        super().__init__()
        self._client = client
        self._address = address
        self._path = path
        self._payload = payload
        self._ctx = ctx
        self._sid = 0

    async def _open(self) -> _Inbox:
        self._sid, inbox = await self._client._open(
            self._address, self._path, self._payload, self._ctx.request_id, self._ctx.traceparent
        )
        self._payload = b""
        return inbox

    def _return_credit(self, delta: int, total: int) -> None:
        assert self._inbox is not None
        self._client._credit(self._inbox, self._sid, total)

    def _canceller(self) -> Callable[[], None]:
        return functools.partial(self._client._cancel_stream, self._sid)


class NatsClient(RequestPlaneClient):
    """Streams to ``nats`` servers; one reply subscription per client, opened on first use."""

    kind = "nats"

    def __init__(
        self,
        conn: NatsConnection,
        *,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        idle_timeout: float = IDLE_TIMEOUT,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        silence_deadline: float = SILENCE_DEADLINE,
    ) -> None:
        super().__init__()
        self.conn = conn
        self.heartbeat_interval = heartbeat_interval
        self.idle_timeout = idle_timeout
        #: Seconds every stream to a server may hear nothing before the server is reported
        #: ``SILENT`` to the peer listeners (0: never).
        self.silent_peers.deadline = silence_deadline
        #: The largest request sent, and the largest item reassembled from PARTs.
        self.max_frame_bytes = max_frame_bytes
        self.prefix = CLIENT_PREFIX + uuid.uuid4().hex + "."
        self._inboxes: dict[int, _Inbox] = {}
        #: Consumed counts to repeat as keep-alive credit, by stream id.
        self._consumed: dict[int, int] = {}
        self._ids = itertools.count(1)
        self._sub: Subscription | None = None
        self._outbox: Outbox | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._starting: asyncio.Task[None] | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def stream(
        self,
        address: TransportAddress,
        endpoint_path: str,
        payload: bytes,
        ctx: RequestContext,
    ) -> _NatsStream:
        if address.kind != self.kind:
            raise PeerUnavailable(f"nats client cannot reach a {address.kind!r} address")
        return _NatsStream(self, address.address, endpoint_path, payload, ctx)

    async def _start(self) -> None:
        """Subscribe to this client's reply subjects, then open the outbox and the monitor.

        Nothing is kept unless NATS confirmed the subscription (within ``idle_timeout``):
        ``_outbox`` is what says the client has started, so a failed start is retried by the
        next stream instead of leaving a client without its idle monitor."""
        self._sub = await subscribe_confirmed(
            self.conn, self.prefix + "*", self._on_msg, self.idle_timeout
        )
        self._outbox = Outbox(self.conn, f"nats-rp-client-{self.prefix[-9:-1]}")
        self._monitor = asyncio.get_running_loop().create_task(self._watch())

    def _started(self, task: asyncio.Task[None]) -> None:
        """Forget a start-up that failed (or was cancelled), so the next stream tries again;
        retrieves its exception, which no stream may be left waiting to take."""
        failed = task.cancelled() or task.exception() is not None
        if failed and self._starting is task:
            self._starting = None

    async def _ensure_started(self, server: str) -> None:
        """Start the client on first use; ``PeerUnavailable`` when NATS does not confirm."""
        if self._starting is None:
            self._loop = asyncio.get_running_loop()
            self._starting = self._loop.create_task(self._start())
            self._starting.add_done_callback(self._started)
        starting = self._starting
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if starting.cancelled() and self._closed and task is not None and not task.cancelling():
                raise PeerUnavailable("nats request plane client is closed") from None
            raise
        except NatsUnavailable as exc:
            raise PeerUnavailable(f"nats peer {server}: {exc}") from exc

    async def _open(
        self, server: str, path: str, payload: bytes, request_id: str, traceparent: str = ""
    ) -> tuple[int, _Inbox]:
        if self._closed:
            raise PeerUnavailable("nats request plane client is closed")
        if not server.startswith(SERVER_PREFIX):
            raise PeerUnavailable(f"bad nats address {server!r}: expected {SERVER_PREFIX}<id>")
        limit = self.conn.max_payload - FRAME_OVERHEAD
        if len(payload) > limit:
            raise RequestPlaneError(
                f"request payload of {len(payload)} bytes exceeds what one NATS message "
                f"carries ({limit} bytes)"
            )
        if len(payload) + FRAME_OVERHEAD > self.max_frame_bytes:
            raise RequestPlaneError(
                f"request payload of {len(payload)} bytes is over the request plane's frame "
                f"limit ({self.max_frame_bytes} bytes, --max-frame-bytes)"
            )
        if self._outbox is None:
            await self._ensure_started(server)
            if self._closed:  # closed while starting: the monitor is gone, nothing would end it
                raise PeerUnavailable("nats request plane client is closed")
        if not self.conn.is_connected:
            raise PeerUnavailable(f"nats peer {server}: not connected to NATS")
        assert self._outbox is not None
        sid = next(self._ids)
        subject = self.prefix + str(sid)
        inbox = _Inbox(server, subject, time.monotonic())
        self._inboxes[sid] = inbox
        self._consumed[sid] = 0
        frame = Frame(Kind.REQUEST, 0, payload, path, TAKES_BATCHES, request_id, traceparent)
        self._outbox.put((server, encode_frame(frame), subject))
        return sid, inbox

    def _credit(self, inbox: _Inbox, sid: int, consumed: int) -> None:
        if sid in self._consumed:
            self._consumed[sid] = consumed
        if self._outbox is not None:
            frame = encode_frame(Frame(CREDIT, 0, num=consumed))
            self._outbox.put((inbox.server, frame, inbox.subject))

    def _cancel_stream(self, sid: int) -> None:
        inbox = self._inboxes.pop(sid, None)
        self._consumed.pop(sid, None)
        if inbox is not None and self._outbox is not None:
            self._outbox.put((inbox.server, encode_frame(Frame(Kind.CANCEL, 0)), inbox.subject))

    def _forget(self, sid: int) -> None:
        self._inboxes.pop(sid, None)
        self._consumed.pop(sid, None)

    async def _on_msg(self, msg: Msg) -> None:
        try:
            sid = int(msg.subject[len(self.prefix) :])
        except ValueError:
            return
        if sid == BATCH_SID:
            self._on_batch(msg.data)
            return
        inbox = self._inboxes.get(sid)
        if inbox is None:
            return  # late frames of a stream that ended
        inbox.last_heard = time.monotonic()
        headers = msg.headers
        if headers and headers.get("Status") == "503":
            self._forget(sid)
            inbox.finish(inbox.lost("no responder (server gone)"))
            return
        silent_peers = self.silent_peers
        if silent_peers and inbox.server in silent_peers:
            silent_peers.heard(inbox.server)
        try:
            frame = decode_frame(msg.data)
        except msgspec.DecodeError as exc:
            self._cancel_stream(sid)
            inbox.finish(inbox.lost(f"undecodable message: {exc}"))
            return
        self._on_frame(sid, inbox, frame)

    def _on_batch(self, data: bytes) -> None:
        """A batch message: frames of several streams, in order within each stream."""
        try:
            frames = decode_batch(data)
        except msgspec.DecodeError as exc:
            # Whose frames were in it is unknown: each of those streams finds the gap in its
            # sequence numbers at its next frame or heartbeat, or falls silent.
            logger.warning("nats request plane: dropping an undecodable batch message: %s", exc)
            return
        inboxes = self._inboxes
        silent_peers = self.silent_peers
        now = time.monotonic()
        for frame in frames:
            sid = frame.stream_id
            inbox = inboxes.get(sid)
            if inbox is None:
                continue  # late frames of a stream that ended
            inbox.last_heard = now
            if silent_peers and inbox.server in silent_peers:
                silent_peers.heard(inbox.server)
            self._on_frame(sid, inbox, frame)

    def _on_frame(self, sid: int, inbox: _Inbox, frame: Frame) -> None:
        """One server frame of stream ``sid``: sequence checks, then what its kind says."""
        kind = frame.kind
        if not inbox.acked and (kind in TAKEN or frame.num > 1):
            # The server took the request and its ACK (always ``num`` 1) was lost: the
            # request ran, so whatever goes wrong from here is StreamBroken, not
            # PeerUnavailable (which would send it elsewhere as if nothing had run).
            inbox.acked = True
            if inbox.seq == 0:
                inbox.seq = 1  # the lost ACK is no gap: it carried nothing
        if kind == HEARTBEAT:
            if frame.num > inbox.seq:
                self._cancel_stream(sid)
                inbox.finish(inbox.lost("messages were lost"))
            return
        if frame.num != inbox.seq + 1:
            self._cancel_stream(sid)
            inbox.finish(inbox.lost("messages were lost"))
            return
        inbox.seq = frame.num
        if kind == DATA:
            data = frame.data
            if isinstance(data, bytes) and inbox.partial is not None:
                if not self._fits(sid, inbox, len(data)):
                    return
                inbox.partial += data
                data = bytes(inbox.partial)
                inbox.partial = None
            if not inbox.deliver(data):
                self._cancel_stream(sid)
                inbox.finish(inbox.lost(OVERRUN))
        elif kind == PART:
            data = frame.data
            if not isinstance(data, bytes):
                self._cancel_stream(sid)
                inbox.finish(inbox.lost("a PART frame that holds no bytes"))
                return
            if inbox.partial is None:
                inbox.partial = bytearray()
            if not self._fits(sid, inbox, len(data)):
                return
            inbox.partial += data
        elif kind == Kind.ACK:
            inbox.acked = True
        else:  # END, ERROR, REJECT, ABORT
            self._forget(sid)
            inbox.end(kind, frame.text)

    def _fits(self, sid: int, inbox: _Inbox, more: int) -> bool:
        """Whether an item being reassembled may grow by ``more`` bytes; if not, the stream
        ends (``StreamBroken``) and what was gathered is dropped."""
        assert inbox.partial is not None
        size = len(inbox.partial) + more
        if size <= self.max_frame_bytes:
            return True
        logger.warning(
            "nats request plane: peer %s sent an item of at least %d bytes, over the limit "
            "of %d (--max-frame-bytes); ending the stream",
            inbox.server, size, self.max_frame_bytes,
        )  # fmt: skip
        inbox.partial = None
        self._cancel_stream(sid)
        inbox.finish(
            inbox.lost(f"a reply item over the frame limit of {self.max_frame_bytes} bytes")
        )
        return False

    async def _watch(self) -> None:
        """Ends streams whose server fell silent; repeats credit as the client's heartbeat;
        reports servers silent on every stream (see the module docstring)."""
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            now = time.monotonic()
            #: Per server with open streams: the shortest silence among them.
            quiet: dict[str, float] = {}
            for sid, inbox in list(self._inboxes.items()):
                silent = now - inbox.last_heard
                if silent > self.idle_timeout:
                    self._cancel_stream(sid)
                    inbox.finish(inbox.lost(f"silent for {silent:.1f}s"))
                    continue
                if inbox.acked:
                    self._credit(inbox, sid, self._consumed.get(sid, 0))
                quiet[inbox.server] = min(quiet.get(inbox.server, silent), silent)
            peers = self.silent_peers
            for server, silent in quiet.items():
                peers.observe(server, silent)
            for server in peers.peers():
                if server not in quiet:
                    peers.gone(server)  # no stream left to hear it on

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sid, inbox in list(self._inboxes.items()):
            self._cancel_stream(sid)
            inbox.finish(PeerUnavailable("nats request plane client is closed"))
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            await asyncio.wait([self._starting])
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.wait([self._monitor])
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(Exception):  # the connection may be closed already
                await sub.unsubscribe()
        if self._outbox is not None:
            outbox, self._outbox = self._outbox, None
            await outbox.close()
