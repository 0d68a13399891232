"""The ``nats`` request plane: streams between instances through a NATS server.

Subjects::

    turnout.rp.<server id>              each server's one subscription (its TransportAddress)
    turnout.rpc.<client id>.<stream>    one reply subject per stream; a client subscribes to
                                        turnout.rpc.<client id>.* once

Every message is one msgpack ``Frame`` (see ``framing``), as on tcp, with no length prefix
(NATS delimits messages). The client publishes REQUEST, CREDIT and CANCEL to the server's
subject with the stream's reply subject as the NATS reply; the server answers on that subject
with ACK, DATA, PART, HEARTBEAT and one of END / ERROR / REJECT / ABORT.

What NATS does not give, the frames add:

* **No responders.** A message published with a reply subject that no subscription takes is
  answered by the NATS server with a ``503`` status message on the reply subject: before ACK
  that is ``PeerUnavailable`` (no such server, or it stopped), after ACK ``StreamBroken``.
* **Losses.** NATS is at-most-once (a reconnect may drop messages). Server frames carry a
  sequence number per stream (``num``); a gap is ``StreamBroken``, never a silently shortened
  stream. Credit is cumulative (items consumed since the start), so a lost CREDIT is repaired
  by the next one, and the client repeats it every heartbeat interval.
* **Liveness.** The server sends a HEARTBEAT on every stream it has not written to for
  ``heartbeat_interval``; a client that hears nothing for ``idle_timeout`` ends the stream
  (``StreamBroken`` after ACK, ``PeerUnavailable`` before). The client's repeated CREDIT is its
  own heartbeat: a server that hears nothing from a stream's client for ``idle_timeout``
  cancels the handler. No wait is unbounded.
* **Back-pressure.** As on tcp: a handler runs at most ``WINDOW`` items ahead of its consumer.
* **Lost ACK.** Only a stream the server took gets DATA, PART, HEARTBEAT, END or ABORT, and its
  first frame (``num`` 1) is always the ACK: any of those proves the request was delivered even
  when the ACK itself was lost. A gap after that is ``StreamBroken`` (the handler ran), never
  ``PeerUnavailable``; the ACK alone missing is no gap at all.
* **Start-up.** A client subscribes to its reply subjects on first use and a server to its
  subject in ``start``; each waits at most ``idle_timeout`` for NATS to confirm. A failure is
  ``PeerUnavailable`` (client) or ``RequestPlaneError`` (server) and leaves nothing behind, so
  the next call starts over.
* **Size.** NATS caps a message at ``max_payload`` (1 MiB by default). Items produced within one
  event-loop iteration share a DATA frame up to that size; an item larger than a message is sent
  as PART frames and a last DATA frame, and reassembled. A request payload larger than one
  message is refused with ``RequestPlaneError`` (it never reaches a server). The text of an
  ERROR or REJECT frame (a handler's exception message may be anything) is truncated to fit.
  As on tcp, ``max_frame_bytes`` bounds an item: a larger one ends its stream with an ERROR
  on the server, and a client stops reassembling PARTs (``StreamBroken``) once they pass it,
  whatever a server sends; a request message over it is answered with an ERROR, undecoded.

Sends never await in the caller: frames go to an ``_Outbox`` whose writer task publishes them
in order (and frames each stream's pending items at that moment, so a burst is one message).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from turnout.errors import PeerUnavailable, RemoteError, RequestPlaneError, StreamBroken
from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.nats import NatsConnection, NatsUnavailable, subscribe_confirmed
from turnout.runtime.request_plane.base import (
    Handler,
    RequestPlaneClient,
    RequestPlaneServer,
    as_bytes,
    drain_tasks,
)
from turnout.runtime.request_plane.framing import (
    CREDIT_BATCH,
    DEFAULT_MAX_FRAME_BYTES,
    WINDOW,
    Frame,
    Kind,
)

logger = logging.getLogger("turnout.runtime")

SERVER_PREFIX = "turnout.rp."
CLIENT_PREFIX = "turnout.rpc."
#: Seconds between heartbeats (server) and credit repeats (client) on a quiet stream.
HEARTBEAT_INTERVAL = 1.0
#: Seconds of silence after which a stream's peer is taken for gone.
IDLE_TIMEOUT = 5.0
#: Bytes kept free in each message for the frame around the data.
_FRAME_OVERHEAD = 512

_DATA = int(Kind.DATA)
_PART = int(Kind.PART)
_HEARTBEAT = int(Kind.HEARTBEAT)
_CREDIT = int(Kind.CREDIT)
#: Frame kinds the server sends only on a stream it took, i.e. after that stream's ACK.
_TAKEN = frozenset({_DATA, _PART, _HEARTBEAT, int(Kind.END), int(Kind.ABORT)})
#: Appended to a frame text cut to fit a message.
_TRUNCATED = " ... [truncated]"

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Frame).decode

#: One message to publish: subject, payload, reply subject ("" for none).
Message = tuple[str, bytes, str]


def _fit_text(text: str, limit: int) -> str:
    """``text`` cut (on a character boundary) so that its UTF-8 takes at most ``limit`` bytes,
    with a marker when cut: a frame's text must fit in one NATS message, or the frame is
    never published and its stream ends in silence instead of with the text."""
    if len(text) * 4 <= limit:  # the common case, without encoding
        return text
    raw = text.encode(errors="replace")
    if len(raw) <= limit:
        return text
    keep = max(limit - len(_TRUNCATED), 0)
    return raw[:keep].decode(errors="ignore") + _TRUNCATED


class _Outbox:
    """Publishes messages in order from one writer task, so senders never await.

    An entry is a ready ``Message`` or a function called at write time that returns the
    messages to publish then (a stream's pending items, framed at the last moment).
    """

    def __init__(self, conn: NatsConnection, name: str) -> None:
        self._nc = conn.client
        self._entries: collections.deque[Message | Callable[[], list[Message]]] = (
            collections.deque()
        )
        self._wakeup: asyncio.Future[None] | None = None
        self._idle: asyncio.Future[None] | None = None
        self._failed_logged = False
        #: True while the writer publishes the messages of an entry it took.
        self._busy = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name=name)

    def put(self, entry: Message | Callable[[], list[Message]]) -> None:
        self._entries.append(entry)
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    async def _run(self) -> None:
        entries = self._entries
        publish = self._nc.publish
        loop = asyncio.get_running_loop()
        while True:
            while not entries:
                idle = self._idle
                if idle is not None and not idle.done():
                    idle.set_result(None)
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None
            entry = entries.popleft()
            messages = [entry] if isinstance(entry, tuple) else entry()
            self._busy = True
            for subject, payload, reply in messages:
                try:
                    await publish(subject, payload, reply=reply)
                    self._failed_logged = False
                except Exception as exc:  # disconnected past the buffer, closed: lost
                    if not self._failed_logged:
                        self._failed_logged = True
                        logger.warning("nats request plane: cannot publish to %s: %r", subject, exc)
            self._busy = False

    async def flush(self, timeout: float = 1.0) -> None:
        """Wait (up to ``timeout``) until every queued entry has been handed to NATS."""
        if not (self._entries or self._busy) or self._task.done():
            return
        self._idle = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._idle), timeout)

    async def close(self) -> None:
        await self.flush()
        self._task.cancel()
        await asyncio.wait([self._task])


# --- server --------------------------------------------------------------------------------------


class _ServerStream:
    """One request being handled, keyed by its reply subject."""

    __slots__ = ("allowed", "cancelled_by_client", "ctx", "last_heard", "last_sent", "path",
                 "pending", "queued", "reply", "sent", "seq", "task", "waiter")  # fmt: skip

    def __init__(self, reply: str, path: str, ctx: RequestContext, now: float) -> None:
        self.reply = reply
        self.path = path
        self.ctx = ctx
        #: Items the handler may have sent in total (WINDOW + what the client consumed).
        self.allowed = WINDOW
        self.sent = 0
        self.seq = 0
        self.last_sent = now
        self.last_heard = now
        self.waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None
        self.cancelled_by_client = False
        self.pending: list[bytes] = []
        #: Whether the outbox holds an entry that will frame ``pending``.
        self.queued = False

    def credit(self, consumed: int) -> None:
        allowed = WINDOW + consumed
        if allowed > self.allowed:
            self.allowed = allowed
            waiter = self.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def cancel(self) -> None:
        self.cancelled_by_client = True
        self.pending = []
        self.ctx.cancel()
        if self.task is not None:
            self.task.cancel()


class NatsServer(RequestPlaneServer):
    """Serves registered handlers on the subject ``turnout.rp.<server id>``."""

    kind = "nats"

    def __init__(
        self,
        conn: NatsConnection,
        *,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        idle_timeout: float = IDLE_TIMEOUT,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        super().__init__()
        self.conn = conn
        self.subject = SERVER_PREFIX + uuid.uuid4().hex
        self.heartbeat_interval = heartbeat_interval
        self.idle_timeout = idle_timeout
        #: The largest item a stream may send (as PARTs) or a request may be.
        self.max_frame_bytes = max_frame_bytes
        self._inflight: set[_ServerStream] = set()
        self._streams: dict[str, _ServerStream] = {}
        self._sub: Subscription | None = None
        self._outbox: _Outbox | None = None
        self._heartbeats: asyncio.Task[None] | None = None
        self._address: TransportAddress | None = None

    async def start(self) -> TransportAddress:
        """Subscribe to this server's subject; returns its address once NATS has registered the
        subscription. Raises ``RequestPlaneError`` when NATS does not confirm it within
        ``idle_timeout``, with nothing left behind (a later ``start`` tries again)."""
        if self._address is not None:
            return self._address
        # Before subscribing: a request that arrives before start returns is answered REJECT.
        self._outbox = _Outbox(self.conn, f"nats-rp-server-{self.subject[-8:]}")
        try:
            self._sub = await subscribe_confirmed(
                self.conn, self.subject, self._on_msg, self.idle_timeout
            )
        except BaseException as exc:
            outbox, self._outbox = self._outbox, None
            await outbox.close()
            if isinstance(exc, NatsUnavailable):
                raise RequestPlaneError(f"nats request plane cannot serve: {exc}") from exc
            raise
        self._heartbeats = asyncio.get_running_loop().create_task(self._beat())
        self._accepting = True
        self._address = TransportAddress(kind=self.kind, address=self.subject)
        return self._address

    async def stop(self, drain_timeout: float = 5.0) -> None:
        self._accepting = False
        await drain_tasks([s.task for s in self._inflight if s.task], drain_timeout)
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            await asyncio.wait([self._heartbeats])
            self._heartbeats = None
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(Exception):  # the connection may be closed already
                await sub.unsubscribe()
        if self._outbox is not None:
            await self._outbox.close()
            self._outbox = None
            with contextlib.suppress(Exception):  # written out: the last ENDs and ABORTs
                await self.conn.client.flush(timeout=1)

    # -- sending --------------------------------------------------------------------------------

    def _send(self, stream: _ServerStream, kind: int, text: str = "") -> None:
        """Queue a control frame of ``stream``, after its pending items."""
        assert self._outbox is not None
        if text:
            text = _fit_text(text, max(self.conn.max_payload - _FRAME_OVERHEAD, 1))

        def frame() -> list[Message]:
            out = self._frame_pending(stream)
            stream.seq += 1
            out.append((stream.reply, _encode(Frame(kind, 0, text=text, num=stream.seq)), ""))
            stream.last_sent = time.monotonic()
            return out

        self._outbox.put(frame)

    def _push(self, stream: _ServerStream, item: bytes) -> None:
        stream.pending.append(item)
        if not stream.queued:
            stream.queued = True
            assert self._outbox is not None
            self._outbox.put(lambda: self._frame_pending(stream))

    def _frame_pending(self, stream: _ServerStream) -> list[Message]:
        """The stream's pending items as DATA (and PART) messages, each within max_payload."""
        stream.queued = False
        pending = stream.pending
        if not pending:
            return []
        stream.pending = []
        limit = max(self.conn.max_payload - _FRAME_OVERHEAD, 1)
        reply = stream.reply
        out: list[Message] = []
        batch: list[bytes] = []
        size = 0

        def emit(kind: int, data: bytes | list[bytes]) -> None:
            stream.seq += 1
            out.append((reply, _encode(Frame(kind, 0, data, num=stream.seq)), ""))

        def emit_batch() -> None:
            if batch:
                emit(_DATA, batch[0] if len(batch) == 1 else list(batch))
                batch.clear()

        for item in pending:
            n = len(item)
            if n > limit:
                emit_batch()
                size = 0
                view = memoryview(item)
                last = (n - 1) // limit * limit
                for start in range(0, last, limit):
                    emit(_PART, bytes(view[start : start + limit]))
                emit(_DATA, bytes(view[last:]))
                continue
            if size + n > limit:
                emit_batch()
                size = 0
            batch.append(item)
            size += n + 8
        emit_batch()
        stream.last_sent = time.monotonic()
        return out

    # -- receiving ------------------------------------------------------------------------------

    async def _on_msg(self, msg: Msg) -> None:
        reply = msg.reply
        if not reply:
            return
        if len(msg.data) > self.max_frame_bytes:
            self._refuse_oversize(reply, len(msg.data))
            return
        try:
            frame = _decode(msg.data)
        except msgspec.DecodeError as exc:
            logger.warning("nats request plane: dropping an undecodable message: %s", exc)
            return
        kind = frame.kind
        if kind == _CREDIT:
            stream = self._streams.get(reply)
            if stream is not None:
                stream.last_heard = time.monotonic()
                stream.credit(frame.num)
        elif kind == Kind.REQUEST:
            self._open(reply, frame)
        elif kind == Kind.CANCEL:
            stream = self._streams.pop(reply, None)
            if stream is not None:
                stream.cancel()

    def _refuse_oversize(self, reply: str, size: int) -> None:
        """Answer a message over the frame bound with an ERROR, without decoding it."""
        logger.warning(
            "nats request plane: a message of %d bytes on %s is over the limit of %d "
            "(--max-frame-bytes); refused",
            size, reply, self.max_frame_bytes,
        )  # fmt: skip
        if self._outbox is None or reply in self._streams:
            return
        stream = _ServerStream(reply, "", RequestContext(), time.monotonic())
        self._send(
            stream,
            Kind.ERROR,
            f"a request of {size} bytes is over the request plane's frame limit "
            f"({self.max_frame_bytes} bytes, --max-frame-bytes)",
        )

    def _open(self, reply: str, frame: Frame) -> None:
        path = frame.text
        if self._outbox is None:
            return  # not started, or stopped: no one to answer through
        stream = _ServerStream(reply, path, RequestContext(frame.text2 or None), time.monotonic())
        if not self._takes(path):
            self._send(stream, Kind.REJECT, f"not taking requests for {path!r}")
            return
        handler = self._handlers.get(path)
        if handler is None:
            self._send(stream, Kind.ERROR, f"unknown endpoint {path!r}")
            return
        payload = frame.data
        if not isinstance(payload, bytes):
            self._send(stream, Kind.ERROR, "request payload must be bytes")
            return
        if reply in self._streams:
            return  # a duplicate
        self._streams[reply] = stream
        self._inflight.add(stream)
        self._send(stream, Kind.ACK)
        task = asyncio.get_running_loop().create_task(self._run(stream, handler, payload))
        stream.task = task
        task.add_done_callback(lambda _: self._on_done(stream))

    def _on_done(self, stream: _ServerStream) -> None:
        """Bookkeeping when a handler task ends, however it ends."""
        if self._streams.get(stream.reply) is stream:
            del self._streams[stream.reply]
        self._inflight.discard(stream)
        if stream.task is not None and stream.task.cancelled() and not stream.cancelled_by_client:
            # Cancelled by the server (drain ran out): the client must not wait for more.
            stream.ctx.cancel()
            if self._outbox is not None:
                self._send(stream, Kind.ABORT)

    async def _run(self, stream: _ServerStream, handler: Handler, payload: bytes) -> None:
        push = self._push
        limit = self.max_frame_bytes
        items = handler(payload, stream.ctx)
        try:
            async for item in items:
                if item.__class__ is not bytes:
                    item = as_bytes(item)
                if len(item) > limit:
                    raise RequestPlaneError(
                        f"a reply item of {len(item)} bytes is over the request plane's frame "
                        f"limit ({limit} bytes, --max-frame-bytes)"
                    )
                while stream.sent >= stream.allowed:
                    stream.waiter = asyncio.get_running_loop().create_future()
                    await stream.waiter  # ends with credit, or the cancel of an idle client
                stream.sent += 1
                push(stream, item)
            self._send(stream, Kind.END)
        except Exception as exc:
            logger.warning("handler for %s raised: %r", stream.path, exc)
            self._send(stream, Kind.ERROR, f"{type(exc).__name__}: {exc}")
        finally:
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _beat(self) -> None:
        """Heartbeats on quiet streams; cancels streams whose client fell silent."""
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            now = time.monotonic()
            outbox = self._outbox
            for stream in list(self._streams.values()):
                if now - stream.last_heard > self.idle_timeout:
                    logger.warning(
                        "nats request plane: client of %s silent for %.1fs; cancelling",
                        stream.path,
                        now - stream.last_heard,
                    )
                    del self._streams[stream.reply]
                    stream.cancel()
                elif now - stream.last_sent >= self.heartbeat_interval and outbox is not None:
                    stream.last_sent = now
                    outbox.put((stream.reply, _encode(Frame(_HEARTBEAT, 0, num=stream.seq)), ""))


# --- client --------------------------------------------------------------------------------------


class _Inbox:
    """What arrives for one client stream. ``terminal`` is set once."""

    __slots__ = ("acked", "items", "last_heard", "partial", "seq", "server", "subject",
                 "terminal", "waiter")  # fmt: skip

    def __init__(self, server: str, subject: str, now: float) -> None:
        self.server = server
        self.subject = subject
        self.items: collections.deque[bytes] = collections.deque()
        self.acked = False
        self.seq = 0
        self.partial: bytearray | None = None
        self.last_heard = now
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

    def lost(self, why: str) -> BaseException:
        if self.acked:
            return StreamBroken(f"nats peer {self.server}: {why}")
        return PeerUnavailable(f"nats peer {self.server}: {why}")


class _NatsStream:
    """The caller's iterator over one stream; sends the REQUEST on the first ``__anext__``."""

    __slots__ = ("_address", "_client", "_consumed", "_credited", "_ctx", "_inbox", "_path",
                 "_payload", "_sid")  # fmt: skip

    def __init__(
        self, client: NatsClient, address: str, path: str, payload: bytes, ctx: RequestContext
    ) -> None:
        self._client = client
        self._address = address
        self._path = path
        self._payload = payload
        self._ctx = ctx
        self._inbox: _Inbox | None = None
        self._sid = 0
        self._consumed = 0
        self._credited = 0

    def __aiter__(self) -> _NatsStream:
        return self

    async def __anext__(self) -> bytes:
        inbox = self._inbox
        if inbox is None:
            self._sid, inbox = await self._client._open(
                self._address, self._path, self._payload, self._ctx.request_id
            )
            self._inbox = inbox
            self._payload = b""
        items = inbox.items
        while not items:
            terminal = inbox.terminal
            if terminal is not None:
                inbox.terminal = StopAsyncIteration  # an error is raised once
                raise terminal
            inbox.waiter = asyncio.get_running_loop().create_future()
            try:
                await inbox.waiter  # bounded: the client's idle check ends a silent stream
            except asyncio.CancelledError:
                self._cancel()
                raise
            finally:
                inbox.waiter = None
        self._consumed += 1
        if self._consumed - self._credited >= CREDIT_BATCH and inbox.terminal is None:
            self._credited = self._consumed
            self._client._credit(inbox, self._sid, self._consumed)
        return items.popleft()

    @property
    def consumed(self) -> int:
        return self._consumed

    def _cancel(self) -> None:
        inbox = self._inbox
        if inbox is not None and inbox.terminal is None:
            inbox.terminal = StopAsyncIteration
            self._client._cancel_stream(self._sid)

    async def aclose(self) -> None:
        self._cancel()

    def abort(self, exc: BaseException) -> None:
        """Fail the stream with ``exc`` at once (its server is known to be gone, e.g. its
        instance left discovery, though no frame has said so yet) and send CANCEL, so that a
        server still alive stops the handler. A pending ``__anext__`` raises ``exc``."""
        inbox = self._inbox
        if inbox is not None and inbox.terminal is None:
            self._client._cancel_stream(self._sid)
            inbox.finish(exc)

    def __del__(self) -> None:
        inbox = self._inbox
        loop = self._client._loop
        if inbox is not None and inbox.terminal is None and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon(self._client._cancel_stream, self._sid)


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
    ) -> None:
        self.conn = conn
        self.heartbeat_interval = heartbeat_interval
        self.idle_timeout = idle_timeout
        #: The largest request sent, and the largest item reassembled from PARTs.
        self.max_frame_bytes = max_frame_bytes
        self.prefix = CLIENT_PREFIX + uuid.uuid4().hex + "."
        self._inboxes: dict[int, _Inbox] = {}
        #: Consumed counts to repeat as keep-alive credit, by stream id.
        self._consumed: dict[int, int] = {}
        self._ids = itertools.count(1)
        self._sub: Subscription | None = None
        self._outbox: _Outbox | None = None
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
        self._outbox = _Outbox(self.conn, f"nats-rp-client-{self.prefix[-9:-1]}")
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
        self, server: str, path: str, payload: bytes, request_id: str
    ) -> tuple[int, _Inbox]:
        if self._closed:
            raise PeerUnavailable("nats request plane client is closed")
        if not server.startswith(SERVER_PREFIX):
            raise PeerUnavailable(f"bad nats address {server!r}: expected {SERVER_PREFIX}<id>")
        limit = self.conn.max_payload - _FRAME_OVERHEAD
        if len(payload) > limit:
            raise RequestPlaneError(
                f"request payload of {len(payload)} bytes exceeds what one NATS message "
                f"carries ({limit} bytes)"
            )
        if len(payload) + _FRAME_OVERHEAD > self.max_frame_bytes:
            raise RequestPlaneError(
                f"request payload of {len(payload)} bytes is over the request plane's frame "
                f"limit ({self.max_frame_bytes} bytes, --max-frame-bytes)"
            )
        if self._outbox is None:
            await self._ensure_started(server)
        if not self.conn.is_connected:
            raise PeerUnavailable(f"nats peer {server}: not connected to NATS")
        assert self._outbox is not None
        sid = next(self._ids)
        subject = self.prefix + str(sid)
        inbox = _Inbox(server, subject, time.monotonic())
        self._inboxes[sid] = inbox
        self._consumed[sid] = 0
        frame = Frame(Kind.REQUEST, 0, payload, path, 0, request_id)
        self._outbox.put((server, _encode(frame), subject))
        return sid, inbox

    def _credit(self, inbox: _Inbox, sid: int, consumed: int) -> None:
        if sid in self._consumed:
            self._consumed[sid] = consumed
        if self._outbox is not None:
            frame = _encode(Frame(_CREDIT, 0, num=consumed))
            self._outbox.put((inbox.server, frame, inbox.subject))

    def _cancel_stream(self, sid: int) -> None:
        inbox = self._inboxes.pop(sid, None)
        self._consumed.pop(sid, None)
        if inbox is not None and self._outbox is not None:
            self._outbox.put((inbox.server, _encode(Frame(Kind.CANCEL, 0)), inbox.subject))

    def _end(self, sid: int, inbox: _Inbox, terminal: type[StopAsyncIteration] | BaseException):
        self._inboxes.pop(sid, None)
        self._consumed.pop(sid, None)
        inbox.finish(terminal)

    async def _on_msg(self, msg: Msg) -> None:
        try:
            sid = int(msg.subject[len(self.prefix) :])
        except ValueError:
            return
        inbox = self._inboxes.get(sid)
        if inbox is None:
            return  # late frames of a stream that ended
        inbox.last_heard = time.monotonic()
        headers = msg.headers
        if headers and headers.get("Status") == "503":
            self._end(sid, inbox, inbox.lost("no responder (server gone)"))
            return
        try:
            frame = _decode(msg.data)
        except msgspec.DecodeError as exc:
            self._cancel_stream(sid)
            inbox.finish(inbox.lost(f"undecodable message: {exc}"))
            return
        kind = frame.kind
        if not inbox.acked and (kind in _TAKEN or frame.num > 1):
            # The server took the request and its ACK (always ``num`` 1) was lost: the
            # request ran, so whatever goes wrong from here is StreamBroken, not
            # PeerUnavailable (which would send it elsewhere as if nothing had run).
            inbox.acked = True
            if inbox.seq == 0:
                inbox.seq = 1  # the lost ACK is no gap: it carried nothing
        if kind == _HEARTBEAT:
            if frame.num > inbox.seq:
                self._cancel_stream(sid)
                inbox.finish(inbox.lost("messages were lost"))
            return
        if frame.num != inbox.seq + 1:
            self._cancel_stream(sid)
            inbox.finish(inbox.lost("messages were lost"))
            return
        inbox.seq = frame.num
        if kind == _DATA:
            data = frame.data
            if isinstance(data, bytes):
                if inbox.partial is not None:
                    if not self._fits(sid, inbox, len(data)):
                        return
                    inbox.partial += data
                    data = bytes(inbox.partial)
                    inbox.partial = None
                inbox.items.append(data)
            else:
                inbox.items.extend(data)
            inbox.wake()
        elif kind == _PART:
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
        elif kind == Kind.END:
            self._end(sid, inbox, StopAsyncIteration)
        elif kind == Kind.ERROR:
            self._end(sid, inbox, RemoteError(frame.text))
        elif kind == Kind.REJECT:
            self._end(sid, inbox, PeerUnavailable(f"nats peer {inbox.server}: {frame.text}"))
        else:  # ABORT
            self._end(sid, inbox, StreamBroken(f"nats peer {inbox.server} aborted the stream"))

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
        """Ends streams whose server fell silent; repeats credit as the client's heartbeat."""
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            now = time.monotonic()
            for sid, inbox in list(self._inboxes.items()):
                silent = now - inbox.last_heard
                if silent > self.idle_timeout:
                    self._cancel_stream(sid)
                    inbox.finish(inbox.lost(f"silent for {silent:.1f}s"))
                elif inbox.acked:
                    self._credit(inbox, sid, self._consumed.get(sid, 0))

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
            await self._outbox.close()
