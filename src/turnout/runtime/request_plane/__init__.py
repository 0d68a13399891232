"""Request planes: how a request reaches one instance and its responses stream back.

``make_server(kind)`` / ``make_client(kind)`` build one by registry name: ``local``
(in-process), ``tcp`` (one multiplexed connection per peer) or ``nats`` (through a NATS
server; needs the process's ``NatsConnection``, see ``turnout.runtime.nats``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from turnout.errors import ConfigError
from turnout.runtime.request_plane.base import Handler, RequestPlaneClient, RequestPlaneServer
from turnout.runtime.request_plane.local import LocalClient, LocalServer
from turnout.runtime.request_plane.tcp import TcpClient, TcpServer

if TYPE_CHECKING:
    from turnout.runtime.nats import NatsConnection

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


def _nats_server(
    host: str, advertise_host: str | None, nats: NatsConnection | None
) -> RequestPlaneServer:
    # Imported on use: a process on the tcp or local plane never loads the NATS client.
    from turnout.runtime.request_plane.nats import NatsServer

    return NatsServer(_need(nats))


def _nats_client(nats: NatsConnection | None) -> RequestPlaneClient:
    from turnout.runtime.request_plane.nats import NatsClient

    return NatsClient(_need(nats))


def _need(nats: NatsConnection | None) -> NatsConnection:
    if nats is None:
        raise ConfigError("the nats request plane needs a NATS connection (--nats-url)")
    return nats


_SERVERS: dict[str, Callable[[str, str | None, NatsConnection | None], RequestPlaneServer]] = {
    "local": lambda host, advertise_host, nats: LocalServer(),
    "nats": _nats_server,
    "tcp": lambda host, advertise_host, nats: TcpServer(host, advertise_host=advertise_host),
}
_CLIENTS: dict[str, Callable[[NatsConnection | None], RequestPlaneClient]] = {
    "local": lambda nats: LocalClient(),
    "nats": _nats_client,
    "tcp": lambda nats: TcpClient(),
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
) -> RequestPlaneServer:
    """A request-plane server of ``kind``; ``host`` is the interface tcp binds and
    ``advertise_host`` the one it publishes (default: the bound address); ``nats`` is the
    connection the ``nats`` kind serves on (``ConfigError`` without one)."""
    factory = _SERVERS.get(kind)
    if factory is None:
        raise _unknown(kind)
    return factory(host, advertise_host, nats)


def make_client(kind: str, *, nats: NatsConnection | None = None) -> RequestPlaneClient:
    """A request-plane client of ``kind`` (``nats``: over the connection ``nats``)."""
    factory = _CLIENTS.get(kind)
    if factory is None:
        raise _unknown(kind)
    return factory(nats)
