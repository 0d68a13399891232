"""Which planes a process uses, and opening them: store, NATS, runtime, in one place.

Every command (frontend, worker, router, status) describes its planes with one
``PlanesConfig`` and opens them with ``open_runtime``, so a deployment is configured the same
way whatever the role, and a service that cannot be reached at start is one clear
``ConfigError`` naming it (the CLI exits 2), never a traceback or a hang.

Plane credentials (``--plane-ca/--plane-cert/--plane-key``) protect the tcp request plane and
the zmq event plane; a process on neither refuses them (``ConfigError``: they would protect
nothing, and NATS has its own TLS flags). A process that binds a non-loopback address with
either plane in the clear logs one warning line as it opens its planes.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from turnout.errors import ConfigError
from turnout.runtime.addresses import DEFAULT_HOST, resolve_advertise_host
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.discovery import DiscoveryStore, open_store
from turnout.runtime.request_plane.framing import DEFAULT_MAX_FRAME_BYTES

if TYPE_CHECKING:
    from turnout.runtime.nats import NatsConnection, NatsOptions
    from turnout.runtime.plane_tls import PlaneTls

logger = logging.getLogger("turnout.runtime")


@dataclass(slots=True)
class PlanesConfig:
    #: Discovery store: ``memory``, ``file`` or ``etcd``.
    store: str = "file"
    #: The SQLite file of the ``file`` store (None: a per-user temp path).
    store_path: str | None = None
    #: Options of the store (``etcd``: endpoints, ca_cert, cert, key, user, password); out
    #: of the repr, which must not show the password.
    store_options: dict[str, Any] = field(default_factory=dict, repr=False)
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

    def effective_event_plane(self) -> str:
        """The event plane this process runs (an unset one: local on the memory store, else
        zmq, as ``DistributedRuntime.create`` picks)."""
        return self.event_plane or ("local" if self.store == "memory" else "zmq")

    def tls_planes(self) -> list[str]:
        """The planes of this process that plane TLS protects, as the flags name them."""
        planes = []
        if self.request_plane == "tcp":
            planes.append("the tcp request plane")
        if self.effective_event_plane() == "zmq":
            planes.append("the zmq event plane")
        return planes

    def check_plane_tls(self) -> None:
        """``ConfigError`` for plane credentials on a process none of whose planes uses them."""
        if self.plane_tls is None or self.tls_planes():
            return
        nats = (
            "; secure NATS with --nats-ca-cert, --nats-cert and --nats-key"
            if self.uses_nats()
            else ""
        )
        raise ConfigError(
            "--plane-ca/--plane-cert/--plane-key protect the tcp request plane and the zmq "
            f"event plane; this process runs the {self.request_plane} request plane and the "
            f"{self.effective_event_plane()} event plane, where they would protect nothing: "
            f"leave them out{nats}"
        )

    def maybe_warn_plaintext(self) -> bool:
        """Log one warning when this process binds a non-loopback address with a plane in
        the clear (no plane TLS); True when it did."""
        planes = self.tls_planes()
        if self.plane_tls is not None or not planes or is_loopback(self.bind_host):
            return False
        logger.warning(
            "binding %s with %s unauthenticated and unencrypted: whoever reaches that address "
            "can call this process's endpoints, fetch its artifacts and read its KV events; "
            "give every process --plane-ca/--plane-cert/--plane-key (docs/deploy.md)",
            self.bind_host,
            " and ".join(planes),
        )
        return True

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
    config.check_plane_tls()
    config.maybe_warn_plaintext()
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


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); names and
    wildcards are not (a wildcard binds every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def _connect_nats(config: PlanesConfig) -> NatsConnection:
    from turnout.runtime.nats import connect_nats

    if config.nats is None:
        raise ConfigError("the nats planes need --nats-url")
    return await connect_nats(config.nats)
