"""What both ends of the ``nats`` request plane share: subjects, timings, frame coding, the
outbox that publishes without making senders wait. See the package docstring for the exchange.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable

import msgspec

from turnout.runtime.nats import NatsConnection
from turnout.runtime.request_plane.framing import Frame, Kind

logger = logging.getLogger("turnout.runtime")

SERVER_PREFIX = "turnout.rp."
CLIENT_PREFIX = "turnout.rpc."
#: Seconds between heartbeats (server) and credit repeats (client) on a quiet stream.
HEARTBEAT_INTERVAL = 1.0
#: Seconds of silence after which a stream's peer is taken for gone.
IDLE_TIMEOUT = 5.0
#: Seconds a client's every stream to a server may hear nothing before it reports the server
#: silent (three heartbeat intervals; see ``RequestPlaneClient.add_peer_listener``).
SILENCE_DEADLINE = 3 * HEARTBEAT_INTERVAL
#: Bytes kept free in each message for the frame around the data.
FRAME_OVERHEAD = 512

DATA = int(Kind.DATA)
PART = int(Kind.PART)
HEARTBEAT = int(Kind.HEARTBEAT)
CREDIT = int(Kind.CREDIT)
#: Frame kinds the server sends only on a stream it took, i.e. after that stream's ACK.
TAKEN = frozenset({DATA, PART, HEARTBEAT, int(Kind.END), int(Kind.ABORT)})
#: Appended to a frame text cut to fit a message.
TRUNCATED = " ... [truncated]"
#: A REQUEST's ``num`` bit by which a client says it takes batch messages (see ``pack_batch``).
#: A server that does not know the bit ignores it and answers one message per frame, which
#: such a client reads as well; a client that does not set it is never sent a batch.
TAKES_BATCHES = 1
#: The stream id of a client's batch subject (``turnout.rpc.<client id>.0``): stream ids
#: start at 1, so no stream has it.
BATCH_SID = 0

encode_frame = msgspec.msgpack.Encoder().encode
decode_frame = msgspec.msgpack.Decoder(Frame).decode
decode_batch = msgspec.msgpack.Decoder(list[Frame]).decode


def pack_batch(frames: list[bytes]) -> bytes:
    """Encoded frames (each naming its stream in ``stream_id``) as one msgpack array: the
    frames of several of a client's streams in one message, read with ``decode_batch``."""
    n = len(frames)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 0x10000:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return head + b"".join(frames)


#: One message to publish: subject, payload, reply subject ("" for none).
Message = tuple[str, bytes, str]


def fit_text(text: str, limit: int) -> str:
    """``text`` cut (on a character boundary) so that its UTF-8 takes at most ``limit`` bytes,
    with a marker when cut: a frame's text must fit in one NATS message, or the frame is
    never published and its stream ends in silence instead of with the text."""
    if len(text) * 4 <= limit:  # the common case, without encoding
        return text
    raw = text.encode(errors="replace")
    if len(raw) <= limit:
        return text
    keep = max(limit - len(TRUNCATED), 0)
    return raw[:keep].decode(errors="ignore") + TRUNCATED


class Outbox:
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
