"""The event plane interface: publish/subscribe of small messages per namespace/component/topic.

Workers publish KV-cache events and load reports; routers subscribe. A message is a topic (a
short string such as ``kv_events``) and an opaque payload (``bytes``, by convention a
msgspec-msgpack encoded struct: see ``publish_msg`` and ``EventSubscription.messages``).

Contract (every implementation):

* **Addressing.** A publisher belongs to one ``(namespace, component)``. A subscription to
  ``(namespace, component, topic)`` receives what every publisher of that component publishes
  under exactly ``topic`` (``topic=""`` subscribes to every topic). Publishers may come and go
  while a subscription lives; it follows them.
* **Ordering.** FIFO per publisher: two messages from one publisher reach a subscriber in the
  order they were published. There is no order between different publishers.
* **At-most-once.** A message reaches each subscriber that is *joined* when it is published at
  most once; nothing is stored or replayed. A subscriber that joins late (including the short
  while a distributed subscription needs to connect, see ``zmq.py``) misses earlier messages,
  and a slow one may lose messages (below). Consumers that need completeness detect gaps with
  the sequence numbers carried in the payloads (``KvCacheEvent.event_id`` increases by one per
  worker) and resynchronise from the source; a consumer with no state at all (just joined)
  must do the same.
* **Never blocks the publisher.** ``publish`` returns without waiting for any subscriber. A
  subscriber that does not keep up has a bounded queue (``max_pending`` messages, the high
  water mark); when it is full, new messages for that subscriber are dropped and counted
  (``EventSubscription.num_dropped``). The first drop of an episode is logged once as a
  warning; when the consumer has drained its queue to the low water mark, one line reports
  how many messages the episode lost, and the warning is re-armed. Memory never grows without
  bound. Distributed implementations may also drop inside their transport (e.g. at a socket's
  high water mark); those drops are not counted here but show up as event-id gaps just the same.
* **Shutdown.** ``close()`` on a subscription ends its iteration (a pending ``__anext__``
  raises ``StopAsyncIteration``); ``close()`` on a publisher withdraws it; ``close()`` on the
  plane closes every publisher and subscription it made. All of them are idempotent.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections import deque
from types import TracebackType
from typing import Any, Generic, NamedTuple, Self, TypeVar

import msgspec

from turnout.errors import ConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")
PlaneT = TypeVar("PlaneT", bound="EventPlane[Any, Any]")
PubT = TypeVar("PubT", bound="EventPublisher[Any]")
SubT = TypeVar("SubT", bound="EventSubscription[Any]")

#: Default high water mark of a subscription's queue, in messages.
DEFAULT_MAX_PENDING = 8192


class Event(NamedTuple):
    """One received message. Unpacks as ``topic, payload``."""

    topic: str
    payload: bytes


# --- msgpack codecs ----------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
# One decoder per target type: building a decoder compiles the type, so it is done once.
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def encode_msg(msg: Any) -> bytes:
    """The msgpack encoding of ``msg`` (a ``msgspec.Struct`` or any msgspec-encodable value)."""
    return _encoder.encode(msg)


def decode_msg(payload: bytes, type_: type[T]) -> T:
    """Decode a payload written by ``encode_msg``; raises ``msgspec.DecodeError`` (or its
    subclass ``ValidationError``) when the payload is not a valid ``type_``."""
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.msgpack.Decoder(type_)
    return decoder.decode(payload)


def check_name(what: str, value: str) -> None:
    """Namespaces and components become path segments (store keys): non-empty, no ``/``."""
    if not value or "/" in value:
        raise ConfigError(f"event plane {what} must be non-empty and contain no '/': {value!r}")


def check_topic(topic: str) -> None:
    """A published topic is a non-empty string (``""`` is the subscribe-to-all wildcard)."""
    if not isinstance(topic, str) or not topic:
        raise ValueError(f"event topic must be a non-empty string, got {topic!r}")


# --- the bounded per-subscription queue --------------------------------------------------------


class EventBuffer:
    """A bounded FIFO from a producer that must never wait to one consumer that may be slow.

    Hand-rolled rather than ``asyncio.Queue`` because it needs what a queue does not give:
    drop-and-count on overflow with once-per-episode reporting, and a ``close`` that wakes
    the consumer. Invariants: ``len(items) <= capacity``; at most one consumer waits (one
    ``take`` at a time); after ``close`` the buffer is empty and ``take`` returns ``None``.

    Overflow drops the *new* message (like a ZeroMQ PUB socket at its high water mark), so
    what the consumer sees is a prefix of the stream, a gap, then the rest: one gap per
    episode, which ``event_id`` checks detect.
    """

    __slots__ = (
        "_closed",
        "_episode_dropped",
        "_items",
        "_overflowing",
        "_waiter",
        "capacity",
        "low_water",
        "name",
        "num_dropped",
        "num_offered",
    )

    def __init__(self, capacity: int, *, name: str = "", low_water: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.low_water = capacity // 2 if low_water is None else min(low_water, capacity - 1)
        self.name = name
        self._items: deque[Event] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._overflowing = False
        # Counters, changed only by offer() and take().
        self.num_offered = 0
        self.num_dropped = 0
        self._episode_dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def offer(self, event: Event) -> bool:
        """Append ``event`` unless the buffer is full (then count a drop) or closed."""
        if self._closed:
            return False
        self.num_offered += 1
        if len(self._items) >= self.capacity:
            self.num_dropped += 1
            self._episode_dropped += 1
            if not self._overflowing:
                self._overflowing = True
                logger.warning(
                    "event subscriber %s is slow: %d messages pending, dropping new ones "
                    "until it drains to %d",
                    self.name,
                    len(self._items),
                    self.low_water,
                )
            return False
        self._items.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return True

    async def take(self) -> Event | None:
        """The oldest message, waiting for one; ``None`` once the buffer is closed."""
        while not self._items:
            if self._closed:
                return None
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                self._waiter = None
        if self._closed:
            return None
        event = self._items.popleft()
        if self._overflowing and len(self._items) <= self.low_water:
            self._overflowing = False
            logger.warning(
                "event subscriber %s caught up; %d messages were dropped while it was behind",
                self.name,
                self._episode_dropped,
            )
            self._episode_dropped = 0
        return event

    def close(self) -> None:
        """Discard what is pending and wake the consumer; idempotent."""
        self._closed = True
        self._items.clear()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


# --- the interface -----------------------------------------------------------------------------


class EventPublisher(abc.ABC, Generic[PlaneT]):
    """Publishes messages for one ``(namespace, component)``; see the module contract.

    The bookkeeping every plane shares lives here: the owning plane, the published count and
    an idempotent ``close`` that withdraws the publisher from its plane; a transport adds
    ``publish_nowait`` and, in ``_release``, whatever it holds (a socket, a lease).
    """

    def __init__(self, plane: PlaneT, namespace: str, component: str) -> None:
        self._plane = plane
        self.namespace = namespace
        self.component = component
        #: Messages accepted so far; transports count each one in ``publish_nowait``.
        self._num_published = 0
        self._closed = False

    @abc.abstractmethod
    def publish_nowait(self, topic: str, payload: bytes) -> None:
        """Send ``payload`` under ``topic`` to every joined subscriber, synchronously.

        Never waits for subscribers (slow ones lose messages; see the module docstring), so
        synchronous engine loops (the mocker's) may call it directly.
        Raises ``ValueError`` for an empty topic and ``RuntimeError`` after ``close``.
        """

    async def publish(self, topic: str, payload: bytes) -> None:
        """``publish_nowait`` for async callers."""
        self.publish_nowait(topic, payload)

    async def publish_msg(self, topic: str, msg: Any) -> None:
        """Publish ``msg`` (a ``msgspec.Struct``) encoded as msgpack."""
        await self.publish(topic, encode_msg(msg))

    @property
    def num_published(self) -> int:
        """Messages accepted by ``publish`` so far."""
        return self._num_published

    def _closed_error(self) -> RuntimeError:
        """What ``publish_nowait`` raises after ``close``."""
        return RuntimeError(
            f"{self._plane.kind} event publisher {self.namespace}/{self.component} is closed"
        )

    async def close(self) -> None:
        """Withdraw the publisher; messages published after this raise. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._plane._publishers.discard(self)
        await self._release()

    async def _release(self) -> None:
        """Free what the transport holds for this publisher (called once, by ``close``)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class EventSubscription(abc.ABC, Generic[PlaneT]):
    """An async iterator of the ``Event`` s of one ``(namespace, component, topic)``.

    Transports feed the ``EventBuffer`` (``self._buffer``) made here; iteration, counters and
    an idempotent ``close`` (which ends the iteration and withdraws the subscription from its
    plane) are shared. A transport frees what it holds in ``_release``. One consumer at a time.
    """

    def __init__(
        self, plane: PlaneT, namespace: str, component: str, topic: str, max_pending: int
    ) -> None:
        self._plane = plane
        self.namespace = namespace
        self.component = component
        self.topic = topic
        self._buffer = EventBuffer(
            max_pending, name=f"{plane.kind}:{namespace}/{component}/{topic}"
        )
        self._closed = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Event:
        event = await self._buffer.take()
        if event is None:
            raise StopAsyncIteration
        return event

    def messages(self, type_: type[T]) -> TypedSubscription[T]:
        """Iterate the payloads decoded as msgpack ``type_`` (see ``TypedSubscription``)."""
        return TypedSubscription(self, type_)

    @property
    def num_received(self) -> int:
        """Messages that reached this subscription, dropped ones included."""
        return self._buffer.num_offered

    @property
    def num_dropped(self) -> int:
        """Messages dropped because the consumer was behind by ``max_pending``."""
        return self._buffer.num_dropped

    @property
    def num_pending(self) -> int:
        return len(self._buffer)

    @property
    def closed(self) -> bool:
        return self._buffer.closed

    async def close(self) -> None:
        """Stop receiving and end the iteration; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._plane._subscriptions.discard(self)
        self._buffer.close()
        await self._release()

    async def _release(self) -> None:
        """Free what the transport holds for this subscription (called once, by ``close``)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class TypedSubscription(Generic[T]):
    """A subscription's payloads decoded as msgpack ``T``.

    A payload that does not decode (a peer running another version, a bug) is skipped and
    counted in ``num_invalid``; the first one is logged with the error. One bad peer must not
    stop a router's event loop.
    """

    __slots__ = ("_logged", "_type", "num_invalid", "subscription")

    def __init__(self, subscription: EventSubscription[Any], type_: type[T]) -> None:
        self.subscription = subscription
        self._type = type_
        self.num_invalid = 0
        self._logged = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> T:
        while True:
            event = await self.subscription.__anext__()
            try:
                return decode_msg(event.payload, self._type)
            except msgspec.DecodeError as e:
                self.num_invalid += 1
                if not self._logged:
                    self._logged = True
                    logger.warning(
                        "skipping undecodable %r message on %s/%s (as %s): %s; "
                        "later ones are only counted",
                        event.topic,
                        self.subscription.namespace,
                        self.subscription.component,
                        getattr(self._type, "__name__", self._type),
                        e,
                    )


class EventPlane(abc.ABC, Generic[PubT, SubT]):
    """Factory of publishers and subscriptions; owns them and closes them on ``close``.

    Shared here: the closed state, the name checks, and the sets of live publishers and
    subscriptions (each removes itself on ``close``). A transport makes the objects
    (``_open_publisher``, ``_open_subscription``) and frees its own state in ``_release``.
    """

    #: Registry name: ``local``, ``zmq``, ``nats``.
    kind: str

    def __init__(self) -> None:
        self._publishers: set[PubT] = set()
        self._subscriptions: set[SubT] = set()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.kind} event plane is closed")

    async def publisher(self, namespace: str, component: str) -> PubT:
        """A new publisher for ``(namespace, component)``, ready to publish."""
        self._check_open()
        check_name("namespace", namespace)
        check_name("component", component)
        pub = await self._open_publisher(namespace, component)
        self._publishers.add(pub)
        return pub

    async def subscribe(
        self,
        namespace: str,
        component: str,
        topic: str,
        *,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> SubT:
        """A new subscription to ``topic`` (``""``: every topic) of ``(namespace, component)``.

        ``max_pending`` is the high water mark of its queue (see the module docstring).
        Distributed implementations join asynchronously: messages published right after this
        returns may be missed (see the implementation's notes on joining).
        """
        self._check_open()
        check_name("namespace", namespace)
        check_name("component", component)
        sub = await self._open_subscription(namespace, component, topic, max_pending)
        self._subscriptions.add(sub)
        return sub

    @abc.abstractmethod
    async def _open_publisher(self, namespace: str, component: str) -> PubT:
        """Make a publisher ready to publish (names already checked)."""

    @abc.abstractmethod
    async def _open_subscription(
        self, namespace: str, component: str, topic: str, max_pending: int
    ) -> SubT:
        """Make a subscription, joined as far as the transport allows (names checked)."""

    async def close(self) -> None:
        """Close every publisher and subscription made by this plane; idempotent."""
        if self._closed:
            return
        self._closed = True
        for sub in list(self._subscriptions):
            await sub.close()
        for pub in list(self._publishers):
            await pub.close()
        await self._release()

    async def _release(self) -> None:
        """Free the transport's own state, after every publisher and subscription closed."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
