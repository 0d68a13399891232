"""The in-process event plane: publishers hand messages straight to subscriber queues.

One ``LocalEventPlane`` object is one bus: publishers and subscriptions made by the same
object see each other (``turnout serve`` shares one between the frontend and its in-process
workers). No discovery store is needed. A subscription joins the moment ``subscribe``
returns, so unlike the distributed planes there is no joining delay. ``publish`` is a loop
over the matching subscriptions' ``EventBuffer.offer``: it never awaits, and a slow
subscriber drops (and counts) rather than slowing the publisher.
"""

from __future__ import annotations

import logging

from turnout.runtime.event_plane.base import (
    Event,
    EventPlane,
    EventPublisher,
    EventSubscription,
    check_topic,
)

logger = logging.getLogger(__name__)

_Key = tuple[str, str]


class LocalEventPublisher(EventPublisher["LocalEventPlane"]):
    def publish_nowait(self, topic: str, payload: bytes) -> None:
        check_topic(topic)
        if self._closed:
            raise self._closed_error()
        self._num_published += 1
        event = Event(topic, payload)
        for sub in self._plane._routes.get((self.namespace, self.component), ()):
            if not sub.topic or sub.topic == topic:
                sub._buffer.offer(event)


class LocalEventSubscription(EventSubscription["LocalEventPlane"]):
    async def _release(self) -> None:
        self._plane._remove_route(self)


class LocalEventPlane(EventPlane[LocalEventPublisher, LocalEventSubscription]):
    """An in-process bus; see the module docstring."""

    kind = "local"

    def __init__(self) -> None:
        super().__init__()
        #: The subscriptions each publisher delivers to, a list per key: publish iterates in
        #: join order. Only the plane's methods change it (copy-on-write).
        self._routes: dict[_Key, list[LocalEventSubscription]] = {}

    async def _open_publisher(self, namespace: str, component: str) -> LocalEventPublisher:
        return LocalEventPublisher(self, namespace, component)

    async def _open_subscription(
        self, namespace: str, component: str, topic: str, max_pending: int
    ) -> LocalEventSubscription:
        sub = LocalEventSubscription(self, namespace, component, topic, max_pending)
        # Copy-on-write, so a publish loop running over the old list is never disturbed.
        key = (namespace, component)
        self._routes[key] = [*self._routes.get(key, ()), sub]
        return sub

    def _remove_route(self, sub: LocalEventSubscription) -> None:
        key = (sub.namespace, sub.component)
        subs = [s for s in self._routes.get(key, ()) if s is not sub]
        if subs:
            self._routes[key] = subs
        else:
            self._routes.pop(key, None)

    @property
    def num_publishers(self) -> int:
        return len(self._publishers)
