"""The NATS event plane: publishers and subscribers meet on subjects of a NATS server.

Mental model::

    publisher ──PUB turnout.ev.{namespace}.{component}.{topic}──▶ nats-server
    subscriber ──SUB turnout.ev.{namespace}.{component}.{topic}   (topic "" : ….*)

No discovery records: the NATS server routes by subject, so a subscription follows publishers
that come and go by construction. Names are escaped into single subject tokens (see
``subject_token``): a namespace holding ``.``, ``*``, ``>`` or a space cannot change the shape
of a subject, and the subscribe-to-all wildcard recovers each topic from its token.

Joining: ``subscribe`` returns once the NATS server has registered the subscription (a
PING/PONG round trip), so unlike ZeroMQ there is no slow-joiner window; what is published after
that reaches the subscriber. When NATS does not confirm within ``subscribe_timeout`` seconds
(unreachable, frozen), ``subscribe`` raises ``NatsUnavailable`` and removes the subscription
again: a failed subscribe leaves nothing behind for the client library to restore later.

Ordering: NATS keeps the order of one connection's messages to one subscriber; each plane's
publishers send through one writer task in call order, so FIFO per publisher holds.

Never blocks the publisher: ``publish_nowait`` appends to the plane's outbox (bounded at
``max_outbox`` messages, beyond which new messages are dropped and counted in
``num_dropped``); the writer task hands them to the NATS client, which buffers while
reconnecting and drops past its own buffer. Subscribers get what arrives in their
``EventBuffer`` (``max_pending``, counted drops), as with every plane. Messages published while
the connection is down are lost: at-most-once, as the contract says.

Shutdown: ``close`` unsubscribes and ends iterations; the plane never closes the connection,
which belongs to the process (``turnout.runtime.nats``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
from typing import Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from turnout.errors import ConfigError
from turnout.runtime.event_plane.base import (
    Event,
    EventPlane,
    EventPublisher,
    EventSubscription,
    check_topic,
)
from turnout.runtime.nats import NatsConnection, subscribe_confirmed

logger = logging.getLogger(__name__)

SUBJECT_ROOT = "turnout.ev"
#: Messages the plane's outbox holds while the NATS client is slower than the publishers.
DEFAULT_MAX_OUTBOX = 65_536
#: Seconds ``subscribe`` waits for the NATS server to confirm a subscription.
DEFAULT_SUBSCRIBE_TIMEOUT = 5.0
#: Decoded topic names a subscribe-to-all subscription keeps; past that, names are decoded
#: per message (publishers choose topics, so their number is not ours to bound).
MAX_CACHED_TOPICS = 1024

_SAFE = re.compile(r"[A-Za-z0-9_\-]+")
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-]")
_ESCAPED = re.compile(r"~([0-9a-f]{2})")


def subject_token(name: str) -> str:
    """``name`` as one NATS subject token: ASCII letters, digits, ``_`` and ``-`` stay, every
    other byte of its UTF-8 becomes ``~xx`` (hex). Reversible (``token_name``)."""
    if _SAFE.fullmatch(name):
        return name
    return _UNSAFE.sub(lambda m: "".join(f"~{b:02x}" for b in m.group().encode()), name)


def token_name(token: str) -> str:
    """The name ``subject_token`` escaped into ``token``."""
    if "~" not in token:
        return token
    raw = bytearray()
    pos = 0
    for m in _ESCAPED.finditer(token):
        raw += token[pos : m.start()].encode()
        raw.append(int(m.group(1), 16))
        pos = m.end()
    raw += token[pos:].encode()
    return raw.decode(errors="replace")


def component_subject(namespace: str, component: str) -> str:
    return f"{SUBJECT_ROOT}.{subject_token(namespace)}.{subject_token(component)}"


class NatsEventPublisher(EventPublisher["NatsEventPlane"]):
    def __init__(self, plane: NatsEventPlane, namespace: str, component: str) -> None:
        super().__init__(plane, namespace, component)
        self._prefix = component_subject(namespace, component) + "."
        self._subjects: dict[str, str] = {}

    def publish_nowait(self, topic: str, payload: bytes) -> None:
        subject = self._subjects.get(topic)
        if subject is None:
            check_topic(topic)
            subject = self._subjects[topic] = self._prefix + subject_token(topic)
        if self._closed:
            raise self._closed_error()
        self._plane._put(subject, payload)
        self._num_published += 1


class NatsEventSubscription(EventSubscription["NatsEventPlane"]):
    def __init__(
        self, plane: NatsEventPlane, namespace: str, component: str, topic: str, max_pending: int
    ) -> None:
        super().__init__(plane, namespace, component, topic, max_pending)
        prefix = component_subject(namespace, component)
        self.subject = f"{prefix}.{subject_token(topic) if topic else '*'}"
        self._prefix_len = len(prefix) + 1
        self._sub: Subscription | None = None
        #: Topic tokens already decoded, at most ``MAX_CACHED_TOPICS`` (a wildcard
        #: subscription usually sees few distinct ones, but any publisher may invent more).
        self._topics: dict[str, str] = {}

    async def _start(self) -> None:
        """Subscribe; returns once registered at the server (from then on nothing is missed).
        Raises ``NatsUnavailable`` when not confirmed in time, leaving no subscription."""
        plane = self._plane
        self._sub = await subscribe_confirmed(
            plane.conn, self.subject, self._on_msg, plane.subscribe_timeout
        )

    async def _on_msg(self, msg: Msg) -> None:
        if self.topic:
            topic = self.topic
        else:
            token = msg.subject[self._prefix_len :]
            topics = self._topics
            cached = topics.get(token)
            if cached is None:
                cached = token_name(token)
                if len(topics) < MAX_CACHED_TOPICS:
                    topics[token] = cached
            topic = cached
        self._buffer.offer(Event(topic, msg.data))

    async def _release(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(Exception):  # the connection may be closed already
                await sub.unsubscribe()


class NatsEventPlane(EventPlane[NatsEventPublisher, NatsEventSubscription]):
    """Publish/subscribe through the NATS server of ``conn``; see the module docstring."""

    kind = "nats"

    def __init__(
        self,
        conn: NatsConnection,
        *,
        max_outbox: int = DEFAULT_MAX_OUTBOX,
        subscribe_timeout: float = DEFAULT_SUBSCRIBE_TIMEOUT,
    ) -> None:
        super().__init__()
        self.conn = conn
        self.max_outbox = max_outbox
        self.subscribe_timeout = subscribe_timeout
        self._outbox: collections.deque[tuple[str, bytes]] = collections.deque()
        self._wakeup: asyncio.Future[None] | None = None
        self._idle: asyncio.Future[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        #: Messages dropped because the outbox was full (or the client refused them).
        self.num_dropped = 0
        self._dropping = False

    # -- the outbox -----------------------------------------------------------------------------

    def _put(self, subject: str, payload: bytes) -> None:
        outbox = self._outbox
        if len(outbox) >= self.max_outbox:
            self._drop(f"the outbox holds {len(outbox)} messages")
            return
        outbox.append((subject, payload))
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    def _drop(self, why: str) -> None:
        self.num_dropped += 1
        if not self._dropping:
            self._dropping = True
            logger.warning("nats event plane dropping messages: %s", why)

    async def _write(self) -> None:
        outbox = self._outbox
        publish = self.conn.client.publish
        loop = asyncio.get_running_loop()
        while True:
            while not outbox:
                idle = self._idle
                if idle is not None and not idle.done():
                    idle.set_result(None)
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None
            subject, payload = outbox.popleft()
            try:
                await publish(subject, payload)
                self._dropping = False
            except Exception as exc:  # disconnected past the client's buffer, or closed
                self._drop(repr(exc))

    async def flush(self, timeout: float = 1.0) -> None:
        """Wait (up to ``timeout`` seconds) until every message published so far has been
        handed to the NATS client (benchmarks and orderly shutdown use it)."""
        if not self._outbox or self._writer is None or self._writer.done():
            return
        self._idle = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._idle), timeout)

    # -- the interface --------------------------------------------------------------------------

    async def _open_publisher(self, namespace: str, component: str) -> NatsEventPublisher:
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(
                self._write(), name="nats-event-plane-writer"
            )
        return NatsEventPublisher(self, namespace, component)

    async def _open_subscription(
        self, namespace: str, component: str, topic: str, max_pending: int
    ) -> NatsEventSubscription:
        sub = NatsEventSubscription(self, namespace, component, topic, max_pending)
        await sub._start()
        return sub

    async def _release(self) -> None:
        if self._writer is not None:
            await self.flush()
            self._writer.cancel()
            await asyncio.wait([self._writer])
            self._writer = None


def make_nats_event_plane(nats: NatsConnection | None, **options: Any) -> EventPlane:
    if nats is None:
        raise ConfigError("the nats event plane needs a NATS connection (--nats-url)")
    return NatsEventPlane(nats, **options)
