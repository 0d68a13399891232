"""The event plane: publish/subscribe of KV events and load reports (see ``base`` for the contract).

``make_event_plane(kind, store)`` builds one by name: ``local`` (in-process), ``zmq``
(brokerless ZeroMQ, publishers found through the discovery store) or ``nats`` (subjects of a
NATS server; needs the process's ``NatsConnection``, see ``turnout.runtime.nats``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from turnout.runtime.nats import NatsConnection

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


def _make_local(
    store: DiscoveryStore | None, host: str, nats: NatsConnection | None, **options: Any
) -> EventPlane:
    from turnout.runtime.event_plane.local import LocalEventPlane

    if options:
        raise ConfigError(f"the local event plane takes no options, got {sorted(options)}")
    return LocalEventPlane()


def _make_zmq(
    store: DiscoveryStore | None, host: str, nats: NatsConnection | None, **options: Any
) -> EventPlane:
    # Imported on use: a process on the local plane never loads ZeroMQ.
    from turnout.runtime.event_plane.zmq import make_zmq_event_plane

    return make_zmq_event_plane(store, host, **options)


def _make_nats(
    store: DiscoveryStore | None, host: str, nats: NatsConnection | None, **options: Any
) -> EventPlane:
    # Imported on use, like ZeroMQ.
    from turnout.runtime.event_plane.nats import make_nats_event_plane

    return make_nats_event_plane(nats, **options)


_FACTORIES: dict[str, Callable[..., EventPlane]] = {
    "local": _make_local,
    "zmq": _make_zmq,
    "nats": _make_nats,
}
#: The names ``make_event_plane`` accepts.
EVENT_PLANE_KINDS: tuple[str, ...] = tuple(_FACTORIES)


def make_event_plane(
    kind: str,
    store: DiscoveryStore | None,
    host: str = "127.0.0.1",
    *,
    nats: NatsConnection | None = None,
    **options: Any,
) -> EventPlane:
    """Build the event plane named ``kind``.

    ``store`` is the discovery store (``zmq`` needs one; ``local`` ignores it); ``host`` is
    the interface distributed publishers bind to. ``options`` go to the implementation
    (``zmq``: ``advertise_host``, ``lease_ttl``, ``sndhwm``, ``rcvhwm``, ``plane_tls`` for
    CurveZMQ, ``auth_grace``; ``nats``: ``max_outbox``). ``nats`` is the process's NATS
    connection, which the ``nats`` kind needs and the others ignore. Raises ``ConfigError``
    for an unknown kind, naming the known ones, and for a ``nats`` kind without a connection.
    """
    factory = _FACTORIES.get(kind)
    if factory is None:
        raise ConfigError(
            f"unknown event plane {kind!r}; choose one of: {', '.join(EVENT_PLANE_KINDS)}"
        )
    return factory(store, host, nats, **options)
