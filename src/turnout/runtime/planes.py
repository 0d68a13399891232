"""Which planes a process uses, and opening them: store, NATS, runtime, in one place.

Every command (frontend, worker, router, status) describes its planes with one
``PlanesConfig`` and opens them with ``open_runtime``, so a deployment is configured the same
way whatever the role, and a service that cannot be reached at start is one clear
``ConfigError`` naming it (the CLI exits 2), never a traceback or a hang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from turnout.runtime.addresses import DEFAULT_HOST, resolve_advertise_host
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.discovery import DiscoveryStore, open_store
from turnout.runtime.request_plane.framing import DEFAULT_MAX_FRAME_BYTES

if TYPE_CHECKING:
    from turnout.runtime.nats import NatsConnection, NatsOptions
    from turnout.runtime.plane_tls import PlaneTls


@dataclass(slots=True)
class PlanesConfig:
    #: Discovery store: ``memory``, ``file`` or ``etcd``.
    store: str = "file"
    #: The SQLite file of the ``file`` store (None: a per-user temp path).
    store_path: str | None = None
    #: Options of the store (``etcd``: endpoints, ca_cert, cert, key, user, password).
    store_options: dict[str, Any] = field(default_factory=dict)
    #: ``tcp``, ``nats`` or ``local``.
    request_plane: str = "tcp"
    #: ``zmq``, ``nats`` or ``local``; None: local on the memory store, else zmq.
    event_plane: str | None = None
    #: How to reach NATS; needed when either plane is ``nats``.
    nats: NatsOptions | None = None
    #: The interface this process's servers (request plane, zmq publishers) bind.
    bind_host: str = DEFAULT_HOST
    #: The host published for them (None: the bound one, or the routed interface for a
    #: wildcard bind).
    advertise_host: str | None = None
    #: Seconds a dead process's registrations outlive it.
    lease_ttl: float = 10.0
    #: The largest request-plane frame this process sends or reads (requests and reply
    #: items alike); a peer announcing more is cut off.
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    #: Mutual TLS on the tcp request plane and CurveZMQ on the zmq event plane (None: plain).
    plane_tls: PlaneTls | None = None

    def uses_nats(self) -> bool:
        return "nats" in (self.request_plane, self.event_plane)

    def peer_urls(self) -> list[str]:
        """The remote services of this deployment, to find the interface that reaches them."""
        urls = list(self.store_options.get("endpoints") or [])
        if self.nats is not None:
            urls += self.nats.servers
        return urls


async def open_runtime(config: PlanesConfig) -> DistributedRuntime:
    """Open the store, NATS (when a plane needs it) and the runtime over them.

    The runtime owns what it opened: ``shutdown`` closes it all. Unreachable services raise
    ``ConfigError`` naming them.
    """
    advertise = resolve_advertise_host(config.bind_host, config.advertise_host, config.peer_urls())
    store = await open_store_only(config)
    nats: NatsConnection | None = None
    try:
        if config.uses_nats():
            nats = await _connect_nats(config)
        runtime = await DistributedRuntime.create(
            store=store,
            request_plane=config.request_plane,
            host=config.bind_host,
            advertise_host=advertise if advertise != config.bind_host else None,
            lease_ttl=config.lease_ttl,
            event_plane=config.event_plane,
            nats=nats,
            max_frame_bytes=config.max_frame_bytes,
            plane_tls=config.plane_tls,
        )
    except BaseException:
        if nats is not None:
            await nats.close()
        await store.close()
        raise
    runtime.own_store()
    return runtime


async def open_store_only(config: PlanesConfig) -> DiscoveryStore:
    """The store alone (``turnout status``, tools): the caller closes it."""
    return await open_store(config.store, config.store_path, **config.store_options)


async def _connect_nats(config: PlanesConfig) -> NatsConnection:
    from turnout.errors import ConfigError
    from turnout.runtime.nats import connect_nats

    if config.nats is None:
        raise ConfigError("the nats planes need --nats-url")
    return await connect_nats(config.nats)
