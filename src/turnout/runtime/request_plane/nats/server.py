"""Server end of the ``nats`` request plane: ``NatsServer`` and the streams it runs.

Each REQUEST on the server's subject runs its handler in a task that may send ``WINDOW`` items
past what the client reported consumed (credit is cumulative, so a lost CREDIT is repaired by
the next). Every stream gets a HEARTBEAT when the server wrote nothing to it for a heartbeat
interval; a stream whose client said nothing (its repeated CREDIT is its heartbeat) for
``idle_timeout`` is cancelled.

Frames for a client that takes batches (its REQUEST says so, ``TAKES_BATCHES``) are not
published one by one: each joins its client's batch (``_batches``), which the outbox writer
takes whole, so what a server's streams to one client produced since the writer last ran costs
one NATS message (or several, each within ``max_payload``), not one per stream and token.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from turnout.errors import RequestPlaneError
from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.log_context import bind_request
from turnout.runtime.nats import NatsConnection, NatsUnavailable, subscribe_confirmed
from turnout.runtime.request_plane.base import (
    Handler,
    RequestPlaneServer,
    as_bytes,
    drain_tasks,
)
from turnout.runtime.request_plane.framing import DEFAULT_MAX_FRAME_BYTES, WINDOW, Frame, Kind
from turnout.runtime.request_plane.nats.wire import (
    BATCH_SID,
    CREDIT,
    DATA,
    FRAME_OVERHEAD,
    HEARTBEAT,
    HEARTBEAT_INTERVAL,
    IDLE_TIMEOUT,
    PART,
    SERVER_PREFIX,
    TAKES_BATCHES,
    Message,
    Outbox,
    decode_frame,
    encode_frame,
    fit_text,
    logger,
    pack_batch,
)

#: The most digits of a stream id taken from a reply subject (it must fit a msgpack integer).
_MAX_SID_DIGITS = 18


class _ServerStream:
    """One request being handled, keyed by its reply subject."""

    __slots__ = ("allowed", "batch", "cancelled_by_client", "ctx", "last_heard", "last_sent",
                 "path", "pending", "queued", "reply", "sent", "seq", "sid", "task",
                 "waiter")  # fmt: skip

    def __init__(
        self,
        reply: str,
        path: str,
        ctx: RequestContext,
        now: float,
        batch: str = "",
        sid: int = 0,
    ) -> None:
        self.reply = reply
        #: The client's batch subject when it takes batches ("": one message per frame), and
        #: the stream's id, which its frames carry there.
        self.batch = batch
        self.sid = sid
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
        self._outbox: Outbox | None = None
        self._heartbeats: asyncio.Task[None] | None = None
        self._address: TransportAddress | None = None
        #: Encoded frames waiting for the outbox writer, by client batch subject; a subject is
        #: here exactly while the outbox holds the entry that takes its batch (``_take_batch``).
        self._batches: dict[str, list[bytes]] = {}

    async def start(self) -> TransportAddress:
        """Subscribe to this server's subject; returns its address once NATS has registered the
        subscription. Raises ``RequestPlaneError`` when NATS does not confirm it within
        ``idle_timeout``, with nothing left behind (a later ``start`` tries again)."""
        if self._address is not None:
            return self._address
        # Before subscribing: a request that arrives before start returns is answered REJECT.
        self._outbox = Outbox(self.conn, f"nats-rp-server-{self.subject[-8:]}")
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
            text = fit_text(text, max(self.conn.max_payload - FRAME_OVERHEAD, 1))

        def frame() -> list[Message]:
            out = self._frame_pending(stream)
            self._emit(stream, out, kind, text=text)
            stream.last_sent = time.monotonic()
            return out

        self._outbox.put(frame)

    def _emit(
        self,
        stream: _ServerStream,
        out: list[Message],
        kind: int,
        data: bytes | list[bytes] = b"",
        text: str = "",
    ) -> None:
        """Number the next frame of ``stream`` and add it to ``out`` (one message of its own)
        or to its client's batch. Called by the outbox writer only, so numbers follow the
        order frames are written in."""
        stream.seq += 1
        batch = stream.batch
        if batch:
            self._add_to_batch(batch, encode_frame(Frame(kind, stream.sid, data, text, stream.seq)))
        else:
            out.append((stream.reply, encode_frame(Frame(kind, 0, data, text, stream.seq)), ""))

    def _add_to_batch(self, subject: str, frame: bytes) -> None:
        frames = self._batches.get(subject)
        if frames is None:
            self._batches[subject] = [frame]
            assert self._outbox is not None
            self._outbox.put(functools.partial(self._take_batch, subject))
        else:
            frames.append(frame)

    def _take_batch(self, subject: str) -> list[Message]:
        """The frames batched for one client as messages, each within ``max_payload``."""
        frames = self._batches.pop(subject, [])
        limit = max(self.conn.max_payload - FRAME_OVERHEAD, 1)
        out: list[Message] = []
        run: list[bytes] = []
        size = 0
        for frame in frames:
            if run and size + len(frame) > limit:
                out.append((subject, pack_batch(run), ""))
                run, size = [], 0
            run.append(frame)
            size += len(frame)
        if run:
            out.append((subject, pack_batch(run), ""))
        return out

    def _heartbeat(self, stream: _ServerStream) -> list[Message]:
        """A HEARTBEAT naming the last frame sent on ``stream`` (written by the outbox)."""
        frame = Frame(HEARTBEAT, stream.sid, num=stream.seq)
        if stream.batch:
            self._add_to_batch(stream.batch, encode_frame(frame))
            return []
        return [(stream.reply, encode_frame(frame), "")]

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
        out: list[Message] = []
        if not pending:
            return out
        stream.pending = []
        limit = max(self.conn.max_payload - FRAME_OVERHEAD, 1)
        emit = self._emit
        run: list[bytes] = []
        size = 0
        for item in pending:
            n = len(item)
            if n > limit:
                if run:
                    emit(stream, out, DATA, run[0] if len(run) == 1 else run)
                    run = []
                size = 0
                view = memoryview(item)
                last = (n - 1) // limit * limit
                for start in range(0, last, limit):
                    emit(stream, out, PART, bytes(view[start : start + limit]))
                emit(stream, out, DATA, bytes(view[last:]))
                continue
            if size + n > limit:
                emit(stream, out, DATA, run[0] if len(run) == 1 else run)
                run, size = [], 0
            run.append(item)
            size += n + 8
        if run:
            emit(stream, out, DATA, run[0] if len(run) == 1 else run)
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
            frame = decode_frame(msg.data)
        except msgspec.DecodeError as exc:
            logger.warning("nats request plane: dropping an undecodable message: %s", exc)
            return
        kind = frame.kind
        if kind == CREDIT:
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
        batch, sid = "", 0
        if frame.num & TAKES_BATCHES:
            prefix, _, tail = reply.rpartition(".")
            if prefix and tail.isdigit() and len(tail) <= _MAX_SID_DIGITS:
                batch, sid = f"{prefix}.{BATCH_SID}", int(tail)
        ctx = RequestContext(frame.text2 or None, frame.text3)
        stream = _ServerStream(reply, path, ctx, time.monotonic(), batch, sid)
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
        bind_request(stream.ctx)
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
                    outbox.put(functools.partial(self._heartbeat, stream))
