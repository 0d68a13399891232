"""The subscribing side of the zmq event plane: one SUB socket following a component's
publishers in the discovery store (see ``zmq`` for the plane's model, joining and security)."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING

import msgspec
import zmq

from turnout.runtime.discovery.base import WatchEventKind
from turnout.runtime.event_plane.base import Event, EventSubscription
from turnout.runtime.event_plane.curve import check_publisher
from turnout.runtime.event_plane.zmq_discovery import publishers_prefix, record_decoder

if TYPE_CHECKING:
    from turnout.runtime.event_plane.zmq import ZmqEventPlane

logger = logging.getLogger(__name__)

#: After one awaited receive, drain up to this many already-queued messages without awaiting.
_RECV_BATCH = 256
# Flags and options as plain ints, the option read without pyzmq's sugar layer: these run
# several times per message, and the enum arithmetic showed in profiles.
_NOBLOCK = int(zmq.NOBLOCK)
_get = zmq.backend.Socket.get
_RCVMORE = int(zmq.RCVMORE)
#: Refused publisher records remembered (so each is warned about once).
_MAX_REFUSED = 1024


class ZmqEventSubscription(EventSubscription["ZmqEventPlane"]):
    """A SUB socket connected to every publisher of a component, following the store.

    Two tasks: the watch (connects and disconnects as records come and go) and the reader
    (moves messages from the socket into the ``EventBuffer``, filtering the exact topic).
    """

    def __init__(
        self,
        plane: ZmqEventPlane,
        namespace: str,
        component: str,
        topic: str,
        max_pending: int,
    ) -> None:
        super().__init__(plane, namespace, component, topic, max_pending)
        self._topic_bytes = topic.encode()
        sock = plane._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, plane.rcvhwm)
        # Back off reconnects to a publisher that died but whose lease has not expired yet.
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5_000)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic_bytes)
        if plane.curve is not None:
            sock.setsockopt(zmq.CURVE_PUBLICKEY, plane.curve.identity.public_key)
            sock.setsockopt(zmq.CURVE_SECRETKEY, plane.curve.identity.secret_key)
        self._sock = sock
        self._shadow: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        #: key -> address of the publishers we connected to; the watch task alone changes it.
        self._publishers: dict[str, str] = {}
        #: address -> number of keys naming it (ZeroMQ would duplicate a doubly connected pipe).
        self._address_refs: collections.Counter[str] = collections.Counter()
        #: Keys of publisher records refused (and warned about), up to ``_MAX_REFUSED``.
        self._refused: set[str] = set()
        self._changed = asyncio.Event()
        self.num_invalid = 0
        self._watch_task: asyncio.Task[None] | None = None
        self._reader_task: asyncio.Task[None] | None = None

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._reader_task = loop.create_task(self._read(), name=f"{self._buffer.name}-reader")
        self._watch_task = loop.create_task(self._watch(), name=f"{self._buffer.name}-watch")

    # -- following the publishers -------------------------------------------------------------

    @property
    def num_publishers(self) -> int:
        """Publishers this subscription has connected to (the handshake may still be running)."""
        return len(self._publishers)

    @property
    def publisher_addresses(self) -> frozenset[str]:
        return frozenset(self._address_refs)

    async def wait_num_publishers(self, n: int) -> None:
        """Wait until exactly ``n`` publishers are connected (see the module's joining note)."""
        while len(self._publishers) != n:
            self._changed.clear()
            await self._changed.wait()

    async def _watch(self) -> None:
        prefix = publishers_prefix(self.namespace, self.component)
        store = self._plane.store
        revision: int | None = None
        while True:
            events = store.watch_prefix(prefix, start_revision=revision)
            try:
                async for event in events:
                    revision = event.kv.revision
                    if event.kind is WatchEventKind.PUT:
                        self._on_put(event.kv.key, event.kv.value)
                    else:
                        self._on_delete(event.kv.key)
                logger.info("event subscription %s: the store closed its watch", self._buffer.name)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning(
                    "event subscription %s: watch failed, resuming after revision %s: %s",
                    self._buffer.name,
                    revision,
                    exc,
                )
                await asyncio.sleep(1.0)
            finally:
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    await aclose()

    def _on_put(self, key: str, value: bytes) -> None:
        try:
            record = record_decoder.decode(value)
        except msgspec.DecodeError as exc:
            logger.warning("ignoring malformed event publisher record %r: %s", key, exc)
            return
        address = record.address
        old = self._publishers.get(key)
        if old == address:
            return
        if old is not None:
            self._on_delete(key)
        check = check_publisher(record.attestation, self._plane.curve)
        if check.refused is not None:
            if key not in self._refused:
                logger.warning("event subscription %s: not connecting to publisher %r at %r: %s",
                               self._buffer.name, key, address, check.refused)  # fmt: skip
                if len(self._refused) < _MAX_REFUSED:
                    self._refused.add(key)
            return
        self._refused.discard(key)
        self._publishers[key] = address
        self._address_refs[address] += 1
        if self._address_refs[address] == 1:
            if check.server_key is not None:
                # Read at connect time: each publisher's connection gets its own server key.
                self._sock.setsockopt(zmq.CURVE_SERVERKEY, check.server_key)
            self._sock.connect(address)
            logger.debug("event subscription %s connected to %r", self._buffer.name, address)
        self._changed.set()

    def _on_delete(self, key: str) -> None:
        self._refused.discard(key)
        address = self._publishers.pop(key, None)
        if address is None:
            return
        self._address_refs[address] -= 1
        if self._address_refs[address] == 0:
            del self._address_refs[address]
            try:
                self._sock.disconnect(address)
            except zmq.ZMQError as exc:  # already gone: nothing to undo
                logger.debug("disconnect from %r: %s", address, exc)
            logger.debug("event subscription %s disconnected from %r", self._buffer.name, address)
        self._changed.set()

    # -- receiving ------------------------------------------------------------------------------

    async def _read(self) -> None:
        """Move messages from the socket to the buffer until cancelled.

        Waits with the asyncio socket only when the socket is empty; whatever is queued is
        taken with plain non-blocking receives (no future per message), and after a full batch
        the loop yields so that the consumer runs even under a flood. Every frame of a message
        is received in one run: the awaited receive takes whole messages (pyzmq reads all
        their frames in one callback), since a first frame handed to a task that resumes later
        would leave a window in which a disconnect (a publisher leaving) ends the pipe
        mid-message, which libzmq answers with an abort
        (``Assertion failed: !_more (src/fq.cpp:80)``).
        """
        wait_message, recv = self._sock.recv_multipart, self._shadow.recv
        while True:
            frames = await wait_message()
            if len(frames) == 2:
                self._offer(frames[0], frames[1])
            else:
                self.num_invalid += 1
            for _ in range(_RECV_BATCH):
                try:
                    first = recv(_NOBLOCK)
                except zmq.Again:
                    break
                self._deliver(first)
            else:
                await asyncio.sleep(0)

    def _deliver(self, topic_bytes: bytes) -> None:
        """Take the rest of the message whose first frame is ``topic_bytes`` and offer it.

        ZeroMQ delivers a multipart message whole, so the rest is there to take at once.
        """
        shadow = self._shadow
        if not _get(shadow, _RCVMORE):
            self.num_invalid += 1
            return
        payload = shadow.recv()
        if _get(shadow, _RCVMORE):  # more than [topic, payload]: not ours
            while _get(shadow, _RCVMORE):
                shadow.recv()
            self.num_invalid += 1
            return
        self._offer(topic_bytes, payload)

    def _offer(self, topic_bytes: bytes, payload: bytes) -> None:
        if self._topic_bytes:
            # ZeroMQ matched a prefix; keep the exact topic only.
            if topic_bytes != self._topic_bytes:
                return
            topic = self.topic
        else:
            try:
                topic = topic_bytes.decode()
            except UnicodeDecodeError:
                self.num_invalid += 1
                return
        self._buffer.offer(Event(topic, payload))

    async def _release(self) -> None:
        tasks = [t for t in (self._watch_task, self._reader_task) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            # wait(), not gather(): our own cancellation must propagate, the tasks' must not.
            await asyncio.wait(tasks)
        self._sock.close(linger=0)
