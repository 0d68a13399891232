"""The event plane: publish/subscribe of KV events and load reports (see ``base`` for the contract).

``make_event_plane(kind, store)`` builds one by name: ``local`` (in-process) or ``zmq``
(brokerless ZeroMQ, publishers found through the discovery store).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from turnout.errors import ConfigError
from turnout.runtime.discovery.base import DiscoveryStore
from turnout.runtime.event_plane.base import (
    DEFAULT_MAX_PENDING,
    Event,
    EventBuffer,
    EventPlane,
    EventPublisher,
    EventSubscription,
    TypedSubscription,
    decode_msg,
    encode_msg,
)

__all__ = [
    "DEFAULT_MAX_PENDING",
    "EVENT_PLANE_KINDS",
    "Event",
    "EventBuffer",
    "EventPlane",
    "EventPublisher",
    "EventSubscription",
    "TypedSubscription",
    "decode_msg",
    "encode_msg",
    "make_event_plane",
]


def _make_local(store: DiscoveryStore | None, host: str, **options: Any) -> EventPlane:
    from turnout.runtime.event_plane.local import LocalEventPlane

    if options:
        raise ConfigError(f"the local event plane takes no options, got {sorted(options)}")
    return LocalEventPlane()


def _make_zmq(store: DiscoveryStore | None, host: str, **options: Any) -> EventPlane:
    # Imported on use: a process on the local plane never loads ZeroMQ.
    from turnout.runtime.event_plane.zmq import make_zmq_event_plane

    return make_zmq_event_plane(store, host, **options)


_FACTORIES: dict[str, Callable[..., EventPlane]] = {"local": _make_local, "zmq": _make_zmq}
#: The names ``make_event_plane`` accepts.
EVENT_PLANE_KINDS: tuple[str, ...] = tuple(_FACTORIES)


def make_event_plane(
    kind: str, store: DiscoveryStore | None, host: str = "127.0.0.1", **options: Any
) -> EventPlane:
    """Build the event plane named ``kind``.

    ``store`` is the discovery store (``zmq`` needs one; ``local`` ignores it); ``host`` is
    the interface distributed publishers bind to. ``options`` go to the implementation
    (``zmq``: ``advertise_host``, ``lease_ttl``, ``sndhwm``, ``rcvhwm``). Raises
    ``ConfigError`` for an unknown kind, naming the known ones.
    """
    factory = _FACTORIES.get(kind)
    if factory is None:
        raise ConfigError(
            f"unknown event plane {kind!r}; choose one of: {', '.join(EVENT_PLANE_KINDS)}"
        )
    return factory(store, host, **options)
