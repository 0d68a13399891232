"""The in-process event plane: publishers hand messages straight to subscriber queues.

One ``LocalEventPlane`` object is one bus: publishers and subscriptions made by the same
object see each other (``turnout serve`` shares one between the frontend and its in-process
workers). No discovery store is needed. A subscription joins the moment ``subscribe``
returns, so unlike the distributed planes there is no joining delay. ``publish`` is a loop
over the matching subscriptions' ``EventBuffer.offer``: it never awaits, and a slow
subscriber drops (and counts) rather than slowing the publisher.
"""

from __future__ import annotations

import itertools
import logging

from turnout.runtime.event_plane.base import (
    DEFAULT_MAX_PENDING,
    Event,
    EventBuffer,
    EventPlane,
    EventPublisher,
    EventSubscription,
    check_name,
    check_topic,
)

logger = logging.getLogger(__name__)

_Key = tuple[str, str]


class LocalEventPublisher(EventPublisher):
    def __init__(self, plane: LocalEventPlane, namespace: str, component: str, publisher_id: int):
        self._plane = plane
        self.namespace = namespace
        self.component = component
        self.publisher_id = publisher_id
        self._closed = False
        self._num_published = 0

    def publish_nowait(self, topic: str, payload: bytes) -> None:
        check_topic(topic)
        if self._closed:
            raise RuntimeError(f"event publisher {self.publisher_id:x} is closed")
        self._num_published += 1
        event = Event(topic, payload)
        for sub in self._plane._subscriptions.get((self.namespace, self.component), ()):
            if not sub.topic or sub.topic == topic:
                sub._buffer.offer(event)

    @property
    def num_published(self) -> int:
        return self._num_published

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._plane._publishers.discard(self)


class LocalEventSubscription(EventSubscription):
    def __init__(
        self,
        plane: LocalEventPlane,
        namespace: str,
        component: str,
        topic: str,
        max_pending: int,
    ) -> None:
        self._plane = plane
        self.namespace = namespace
        self.component = component
        self.topic = topic
        self._buffer = EventBuffer(max_pending, name=f"local:{namespace}/{component}/{topic}")

    async def close(self) -> None:
        self._buffer.close()
        self._plane._remove_subscription(self)


class LocalEventPlane(EventPlane):
    """An in-process bus; see the module docstring."""

    kind = "local"

    def __init__(self) -> None:
        # The plane owns these collections; publishers read them, only the plane's methods and
        # the objects' own close() change them. A list per key: publish iterates in join order.
        self._subscriptions: dict[_Key, list[LocalEventSubscription]] = {}
        self._publishers: set[LocalEventPublisher] = set()
        self._ids = itertools.count(1)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("local event plane is closed")

    async def publisher(self, namespace: str, component: str) -> LocalEventPublisher:
        self._check_open()
        check_name("namespace", namespace)
        check_name("component", component)
        pub = LocalEventPublisher(self, namespace, component, next(self._ids))
        self._publishers.add(pub)
        return pub

    async def subscribe(
        self,
        namespace: str,
        component: str,
        topic: str,
        *,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> LocalEventSubscription:
        self._check_open()
        check_name("namespace", namespace)
        check_name("component", component)
        sub = LocalEventSubscription(self, namespace, component, topic, max_pending)
        # Copy-on-write, so a publish loop running over the old list is never disturbed.
        key = (namespace, component)
        self._subscriptions[key] = [*self._subscriptions.get(key, ()), sub]
        return sub

    def _remove_subscription(self, sub: LocalEventSubscription) -> None:
        key = (sub.namespace, sub.component)
        subs = [s for s in self._subscriptions.get(key, ()) if s is not sub]
        if subs:
            self._subscriptions[key] = subs
        else:
            self._subscriptions.pop(key, None)

    @property
    def num_subscriptions(self) -> int:
        return sum(len(subs) for subs in self._subscriptions.values())

    @property
    def num_publishers(self) -> int:
        return len(self._publishers)

    async def close(self) -> None:
        self._closed = True
        for pub in list(self._publishers):
            await pub.close()
        for subs in list(self._subscriptions.values()):
            for sub in subs:
                await sub.close()
