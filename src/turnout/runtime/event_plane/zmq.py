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

Security: with plane credentials (``plane_tls``) publishers are CurveZMQ servers and
subscriptions CurveZMQ clients, every connection authenticated and encrypted. A publisher's
record carries the attestation of its Curve key (``curve``); a subscriber connects only to
publishers whose attestation verifies against the plane CA, and a publisher admits only
subscribers whose attested key is in the store (``zap``). Without credentials, nothing of this
runs and the records are the same as ever; a plain plane and a CURVE one refuse each other.

Shutdown: sockets are closed with linger 0 (pending messages are discarded, nothing waits),
watch and reader tasks are cancelled and awaited, publishers' leases are revoked (so their
records vanish at once for everyone), and the plane's ZeroMQ context is destroyed last.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from turnout.errors import ConfigError
from turnout.runtime.discovery.base import DiscoveryStore
from turnout.runtime.event_plane.base import EventPlane, EventPublisher, check_topic
from turnout.runtime.event_plane.curve import CurveCredentials
from turnout.runtime.event_plane.zap import (
    AUTH_GRACE,
    HANDSHAKE_IVL_MS,
    KeyRegistration,
    SubscriberGate,
    require_zap,
)
from turnout.runtime.event_plane.zmq_discovery import (
    PUBLISHERS_ROOT,
    EventPublisherRecord,
    publishers_key,
    publishers_prefix,
)
from turnout.runtime.event_plane.zmq_subscription import ZmqEventSubscription
from turnout.runtime.lease import Lease
from turnout.runtime.plane_tls import PlaneTls

__all__ = [
    "PUBLISHERS_ROOT",
    "EventPublisherRecord",
    "ZmqEventPlane",
    "ZmqEventPublisher",
    "ZmqEventSubscription",
    "make_zmq_event_plane",
    "publishers_key",
    "publishers_prefix",
]

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TTL = 10.0
#: Messages ZeroMQ queues per connection before dropping (PUB side) or refusing (SUB side).
DEFAULT_SNDHWM = 10_000
DEFAULT_RCVHWM = 10_000
# Flags as plain ints: they are used twice per message, and enum arithmetic showed in profiles.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", "[::]", ""})


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
        store, curve = self._plane.store, self._plane.curve
        lease = await Lease.grant(store, self._plane.lease_ttl)
        record = EventPublisherRecord(
            address=self.address,
            publisher_id=self.publisher_id,
            namespace=self.namespace,
            component=self.component,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            attestation=curve.identity.attestation if curve is not None else None,
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
            logger.warning(
                "event publisher %s lost its lease; subscribers dropped it; re-registering",
                self.key,
            )
            delay = 0.1
            failures = 0
            while True:
                try:
                    await self._register()
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    # The first failure says why; the retries until it works say nothing new.
                    failures += 1
                    logger.log(
                        logging.WARNING if failures == 1 else logging.DEBUG,
                        "event publisher %s re-register failed, retrying: %s",
                        self.key,
                        exc,
                    )
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


class ZmqEventPlane(EventPlane[ZmqEventPublisher, ZmqEventSubscription]):
    """Brokerless PUB/SUB over TCP; publishers are found in the discovery ``store``.

    ``host`` is the interface publishers bind to; ``advertise_host`` the name subscribers
    connect to (default: ``host``, or this machine's hostname when ``host`` is a wildcard).
    ``plane_tls``: CurveZMQ with keys attested by these credentials (see the module
    docstring); ``auth_grace``: how long a publisher waits for a subscriber's key record.
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
        plane_tls: PlaneTls | None = None,
        auth_grace: float = AUTH_GRACE,
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
        #: This plane's Curve identity and the CA's verifier; None without plane credentials.
        self.curve = None if plane_tls is None else CurveCredentials.load(plane_tls)
        self._gate: SubscriberGate | None = None
        self._registration: KeyRegistration | None = None
        if self.curve is not None:
            self._gate = SubscriberGate(self._ctx, store, self.curve.verifier, grace=auth_grace)
            self._registration = KeyRegistration(
                store, secrets.randbits(63) or 1, self.curve.identity.attestation, lease_ttl
            )

    async def _open_publisher(self, namespace: str, component: str) -> ZmqEventPublisher:
        if self._gate is not None:
            self._gate.start()  # before any CURVE server socket: it asks the gate
        sock = self._ctx.socket(zmq.PUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.sndhwm)
            if self.curve is not None:
                sock.setsockopt(zmq.CURVE_SERVER, 1)
                sock.setsockopt(zmq.CURVE_SECRETKEY, self.curve.identity.secret_key)
                sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
                require_zap(sock)
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
        if self._registration is not None:
            await self._registration.start()  # publishers admit the key once they see it
        sub = ZmqEventSubscription(self, namespace, component, topic, max_pending)
        sub._start()
        return sub

    async def _release(self) -> None:
        if self._gate is not None:
            await self._gate.close()
        if self._registration is not None:
            await self._registration.close()
        self._ctx.destroy(linger=0)


def _bracket(host: str) -> str:
    """IPv6 literals go in brackets inside a tcp:// address."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def make_zmq_event_plane(store: DiscoveryStore | None, host: str, **options: Any) -> EventPlane:
    if store is None:
        raise ConfigError("the zmq event plane needs a discovery store to find publishers")
    return ZmqEventPlane(store, host, **options)
