"""The brokerless ZeroMQ event plane: a PUB socket per publisher, found through discovery.

Mental model::

    publisher ──bind PUB tcp://host:port──▶ store: v1/event_publishers/{ns}/{comp}/{id:x}
                                                   (JSON record, under the publisher's lease)
    subscriber ──watch_prefix v1/event_publishers/{ns}/{comp}/──▶ SUB.connect(every address)
    wire: multipart [topic (utf-8), payload]; SUB filters on the topic bytes (a prefix match in
    ZeroMQ), the subscription keeps the exact topic only.

There is no broker: every subscriber holds one TCP connection to every publisher of its
component. A publisher's record vanishes with its lease (closed, crashed, or partitioned past
the TTL); the subscriber's watch sees the DELETE and disconnects from that address.

Joining takes time (ZeroMQ's "slow joiner"). After ``subscribe`` returns, the subscriber still
has to see the publisher in the store, connect, finish the TCP and ZMTP handshakes and send its
topic filter to the publisher; until the publisher has that filter, what it publishes does not
go to this subscriber. This is the event plane's at-most-once contract at work, not a bug:
routers resynchronise from the first KV event they see (gap detection with ``event_id``).
Tests that need every message wait until a probe gets through before the real traffic
(``num_publishers`` and ``wait_num_publishers`` only say that ``connect`` was called).

Back-pressure: ``publish`` is a non-blocking send on a PUB socket, which drops a subscriber's
messages once its pipe holds ``sndhwm`` of them; the subscription's reader task drains its SUB
socket (``rcvhwm``) into the subscription's ``EventBuffer`` (``max_pending``, counted drops).
While the consumer keeps the event loop turning, the buffer is where drops happen; ZeroMQ's
own drops (a starved event loop) are invisible here but show up as event-id gaps all the same.

Shutdown: sockets are closed with linger 0 (pending messages are discarded, nothing waits),
watch and reader tasks are cancelled and awaited, publishers' leases are revoked (so their
records vanish at once for everyone), and the plane's ZeroMQ context is destroyed last.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import secrets
import socket
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from turnout.errors import ConfigError
from turnout.runtime.discovery.base import DiscoveryStore, WatchEventKind
from turnout.runtime.event_plane.base import (
    Event,
    EventPlane,
    EventPublisher,
    EventSubscription,
    check_topic,
)
from turnout.runtime.lease import Lease

logger = logging.getLogger(__name__)

#: Root of the publishers' records in the discovery store (a wire format: keep it stable).
PUBLISHERS_ROOT = "v1/event_publishers"
DEFAULT_LEASE_TTL = 10.0
#: Messages ZeroMQ queues per connection before dropping (PUB side) or refusing (SUB side).
DEFAULT_SNDHWM = 10_000
DEFAULT_RCVHWM = 10_000
#: After one awaited receive, drain up to this many already-queued messages without awaiting.
_RECV_BATCH = 256
# Flags and options as plain ints, the option read without pyzmq's sugar layer: these run
# several times per message, and the enum arithmetic showed in profiles.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_get = zmq.backend.Socket.get
_RCVMORE = int(zmq.RCVMORE)
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", "[::]", ""})


class EventPublisherRecord(msgspec.Struct, kw_only=True):
    """What a publisher writes at ``publishers_key``; JSON in the store."""

    address: str
    publisher_id: int
    namespace: str
    component: str
    hostname: str = ""
    pid: int = 0


_record_decoder = msgspec.json.Decoder(EventPublisherRecord)


def publishers_prefix(namespace: str, component: str) -> str:
    """The prefix a subscriber watches (the trailing ``/`` keeps ``kv`` apart from ``kv2``)."""
    return f"{PUBLISHERS_ROOT}/{namespace}/{component}/"


def publishers_key(namespace: str, component: str, publisher_id: int) -> str:
    return f"{publishers_prefix(namespace, component)}{publisher_id:x}"


def _close_socket(sock: zmq.asyncio.Socket) -> None:
    if not sock.closed:
        sock.close(linger=0)


class ZmqEventPublisher(EventPublisher["ZmqEventPlane"]):
    """A bound PUB socket and its record in the store, kept under its own lease.

    If the lease is lost (the store could not be reached for a TTL), the record is gone for
    every subscriber; the publisher re-registers under a new lease as soon as it can.
    """

    def __init__(
        self,
        plane: ZmqEventPlane,
        namespace: str,
        component: str,
        publisher_id: int,
        sock: zmq.asyncio.Socket,
        address: str,
    ) -> None:
        super().__init__(plane, namespace, component)
        self.publisher_id = publisher_id
        self.address = address
        self.key = publishers_key(namespace, component, publisher_id)
        self._sock = sock
        # A synchronous view of the same socket: a PUB send never waits, so there is nothing to
        # await, and skipping the asyncio wrapper's future per message saves most of the cost.
        self._send = zmq.Socket.shadow(sock.underlying).send
        self._topics: dict[str, bytes] = {}
        self.lease: Lease | None = None
        self._guard: asyncio.Task[None] | None = None

    async def _register(self) -> None:
        """Grant a lease and write the record under it."""
        store = self._plane.store
        lease = await Lease.grant(store, self._plane.lease_ttl)
        record = EventPublisherRecord(
            address=self.address,
            publisher_id=self.publisher_id,
            namespace=self.namespace,
            component=self.component,
            hostname=socket.gethostname(),
            pid=os.getpid(),
        )
        try:
            await store.put(self.key, msgspec.json.encode(record), lease_id=lease.id)
        except BaseException:
            await lease.revoke()
            raise
        self.lease = lease

    def _start_guard(self) -> None:
        self._guard = asyncio.get_running_loop().create_task(
            self._keep_registered(), name=f"event-publisher-{self.publisher_id:x}"
        )

    async def _keep_registered(self) -> None:
        """Re-register whenever the lease is lost, with a capped back-off between tries."""
        while True:
            assert self.lease is not None
            await self.lease.lost.wait()
            logger.error(
                "event publisher %s lost its lease; subscribers dropped it; re-registering",
                self.key,
            )
            delay = 0.1
            while True:
                try:
                    await self._register()
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    logger.warning("event publisher %s re-register failed: %s", self.key, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self._plane.lease_ttl)

    def publish_nowait(self, topic: str, payload: bytes) -> None:
        topic_bytes = self._topics.get(topic)
        if topic_bytes is None:
            check_topic(topic)
            topic_bytes = self._topics[topic] = topic.encode()
        if self._closed:
            raise self._closed_error()
        # PUB never blocks: a subscriber whose pipe is at its high water mark loses the message.
        # Two send() calls, not send_multipart(): a third of the cost for two frames.
        self._send(topic_bytes, _SNDMORE_NOBLOCK)
        self._send(payload, _NOBLOCK)
        self._num_published += 1

    async def _release(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
            await asyncio.wait([self._guard])
        # Withdraw the record first so subscribers disconnect, then close the socket.
        if self.lease is not None:
            await self.lease.revoke()
        _close_socket(self._sock)


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
        self._sock = sock
        self._shadow: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        #: key -> address of the publishers we connected to; the watch task alone changes it.
        self._publishers: dict[str, str] = {}
        #: address -> number of keys naming it (ZeroMQ would duplicate a doubly connected pipe).
        self._address_refs: collections.Counter[str] = collections.Counter()
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
            address = _record_decoder.decode(value).address
        except msgspec.DecodeError as exc:
            logger.warning("ignoring malformed event publisher record %s: %s", key, exc)
            return
        old = self._publishers.get(key)
        if old == address:
            return
        if old is not None:
            self._on_delete(key)
        self._publishers[key] = address
        self._address_refs[address] += 1
        if self._address_refs[address] == 1:
            self._sock.connect(address)
            logger.debug("event subscription %s connected to %s", self._buffer.name, address)
        self._changed.set()

    def _on_delete(self, key: str) -> None:
        address = self._publishers.pop(key, None)
        if address is None:
            return
        self._address_refs[address] -= 1
        if self._address_refs[address] == 0:
            del self._address_refs[address]
            try:
                self._sock.disconnect(address)
            except zmq.ZMQError as exc:  # already gone: nothing to undo
                logger.debug("disconnect from %s: %s", address, exc)
            logger.debug("event subscription %s disconnected from %s", self._buffer.name, address)
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
        _close_socket(self._sock)


class ZmqEventPlane(EventPlane[ZmqEventPublisher, ZmqEventSubscription]):
    """Brokerless PUB/SUB over TCP; publishers are found in the discovery ``store``.

    ``host`` is the interface publishers bind to; ``advertise_host`` the name subscribers
    connect to (default: ``host``, or this machine's hostname when ``host`` is a wildcard).
    """

    kind = "zmq"

    def __init__(
        self,
        store: DiscoveryStore,
        host: str = "127.0.0.1",
        *,
        advertise_host: str | None = None,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        sndhwm: int = DEFAULT_SNDHWM,
        rcvhwm: int = DEFAULT_RCVHWM,
    ) -> None:
        if lease_ttl <= 0:
            raise ConfigError(f"event plane lease TTL must be positive, got {lease_ttl}")
        super().__init__()
        self.store = store
        self.host = host
        if advertise_host is None:
            advertise_host = socket.gethostname() if host in _WILDCARD_HOSTS else host
        self.advertise_host = advertise_host
        self.lease_ttl = lease_ttl
        self.sndhwm = sndhwm
        self.rcvhwm = rcvhwm
        self._ctx = zmq.asyncio.Context()

    async def _open_publisher(self, namespace: str, component: str) -> ZmqEventPublisher:
        sock = self._ctx.socket(zmq.PUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.sndhwm)
            bind_host = "*" if self.host in _WILDCARD_HOSTS else self.host
            try:
                sock.bind(f"tcp://{bind_host}:*")
            except zmq.ZMQError as exc:
                raise ConfigError(
                    f"cannot bind an event publisher on host {self.host!r}: {exc}"
                ) from exc
            endpoint: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            port = endpoint.rsplit(":", 1)[1]
            address = f"tcp://{_bracket(self.advertise_host)}:{port}"
            pub = ZmqEventPublisher(
                self, namespace, component, secrets.randbits(63) or 1, sock, address
            )
            await pub._register()
        except BaseException:
            _close_socket(sock)
            raise
        pub._start_guard()
        return pub

    async def _open_subscription(
        self, namespace: str, component: str, topic: str, max_pending: int
    ) -> ZmqEventSubscription:
        sub = ZmqEventSubscription(self, namespace, component, topic, max_pending)
        sub._start()
        return sub

    async def _release(self) -> None:
        self._ctx.destroy(linger=0)


def _bracket(host: str) -> str:
    """IPv6 literals go in brackets inside a tcp:// address."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def make_zmq_event_plane(store: DiscoveryStore | None, host: str, **options: Any) -> EventPlane:
    if store is None:
        raise ConfigError("the zmq event plane needs a discovery store to find publishers")
    return ZmqEventPlane(store, host, **options)
