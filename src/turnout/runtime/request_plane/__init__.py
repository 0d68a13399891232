"""Request planes: how a request reaches one instance and its responses stream back.

``make_server(kind)`` / ``make_client(kind)`` build one by registry name: ``local``
(in-process), ``tcp`` (one multiplexed connection per peer) or ``nats`` (through a NATS
server; needs the process's ``NatsConnection``, see ``turnout.runtime.nats``).

``max_frame_bytes`` bounds what one frame may carry, both ways (``framing``); ``local`` moves
no bytes and ignores it. ``plane_tls`` (``turnout.runtime.plane_tls``) runs ``tcp`` over
mutual TLS; ``nats`` has its own TLS (``--nats-ca-cert`` ...) and ``local`` no sockets, so
both ignore it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from turnout.errors import ConfigError
from turnout.runtime.request_plane.base import Handler, RequestPlaneClient, RequestPlaneServer
from turnout.runtime.request_plane.framing import DEFAULT_MAX_FRAME_BYTES
from turnout.runtime.request_plane.local import LocalClient, LocalServer
from turnout.runtime.request_plane.tcp import TcpClient, TcpServer

if TYPE_CHECKING:
    from turnout.runtime.nats import NatsConnection
    from turnout.runtime.plane_tls import PlaneTls

__all__ = [
    "Handler",
    "LocalClient",
    "LocalServer",
    "RequestPlaneClient",
    "RequestPlaneServer",
    "TcpClient",
    "TcpServer",
    "make_client",
    "make_server",
    "request_plane_kinds",
]


@dataclass(frozen=True, slots=True)
class _Options:
    """What a request plane may take besides its kind; each kind reads what it knows."""

    host: str
    advertise_host: str | None
    nats: NatsConnection | None
    max_frame_bytes: int
    plane_tls: PlaneTls | None


def _nats_server(o: _Options) -> RequestPlaneServer:
    # Imported on use: a process on the tcp or local plane never loads the NATS client.
    from turnout.runtime.request_plane.nats import NatsServer

    return NatsServer(_need(o.nats), max_frame_bytes=o.max_frame_bytes)


def _nats_client(o: _Options) -> RequestPlaneClient:
    from turnout.runtime.request_plane.nats import NatsClient

    return NatsClient(_need(o.nats), max_frame_bytes=o.max_frame_bytes)


def _need(nats: NatsConnection | None) -> NatsConnection:
    if nats is None:
        raise ConfigError("the nats request plane needs a NATS connection (--nats-url)")
    return nats


_SERVERS: dict[str, Callable[[_Options], RequestPlaneServer]] = {
    "local": lambda o: LocalServer(),
    "nats": _nats_server,
    "tcp": lambda o: TcpServer(
        o.host,
        advertise_host=o.advertise_host,
        max_frame_bytes=o.max_frame_bytes,
        plane_tls=o.plane_tls,
    ),
}
_CLIENTS: dict[str, Callable[[_Options], RequestPlaneClient]] = {
    "local": lambda o: LocalClient(),
    "nats": _nats_client,
    "tcp": lambda o: TcpClient(max_frame_bytes=o.max_frame_bytes, plane_tls=o.plane_tls),
}


def request_plane_kinds() -> list[str]:
    return sorted(_SERVERS)


def _unknown(kind: str) -> ConfigError:
    return ConfigError(
        f"unknown request plane {kind!r}; choose one of: {', '.join(request_plane_kinds())}"
    )


def make_server(
    kind: str,
    host: str = "127.0.0.1",
    *,
    advertise_host: str | None = None,
    nats: NatsConnection | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    plane_tls: PlaneTls | None = None,
) -> RequestPlaneServer:
    """A request-plane server of ``kind``; ``host`` is the interface tcp binds and
    ``advertise_host`` the one it publishes (default: the bound address); ``nats`` is the
    connection the ``nats`` kind serves on (``ConfigError`` without one); ``plane_tls``:
    mutual TLS on tcp (the other kinds ignore it)."""
    factory = _SERVERS.get(kind)
    if factory is None:
        raise _unknown(kind)
    return factory(_Options(host, advertise_host, nats, max_frame_bytes, plane_tls))


def make_client(
    kind: str,
    *,
    nats: NatsConnection | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    plane_tls: PlaneTls | None = None,
) -> RequestPlaneClient:
    """A request-plane client of ``kind`` (``nats``: over the connection ``nats``;
    ``plane_tls``: mutual TLS on tcp, ignored by the other kinds)."""
    factory = _CLIENTS.get(kind)
    if factory is None:
        raise _unknown(kind)
    return factory(_Options("", None, nats, max_frame_bytes, plane_tls))
