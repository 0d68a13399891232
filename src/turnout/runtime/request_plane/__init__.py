"""Request planes: how a request reaches one instance and its responses stream back.

``make_server(kind)`` / ``make_client(kind)`` build one by registry name: ``local`` (in-process)
or ``tcp`` (one multiplexed connection per peer).
"""

from __future__ import annotations

from collections.abc import Callable

from turnout.errors import ConfigError
from turnout.runtime.request_plane.base import Handler, RequestPlaneClient, RequestPlaneServer
from turnout.runtime.request_plane.local import LocalClient, LocalServer
from turnout.runtime.request_plane.tcp import TcpClient, TcpServer

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

_SERVERS: dict[str, Callable[[str, str | None], RequestPlaneServer]] = {
    "local": lambda host, advertise_host: LocalServer(),
    "tcp": lambda host, advertise_host: TcpServer(host, advertise_host=advertise_host),
}
_CLIENTS: dict[str, Callable[[], RequestPlaneClient]] = {
    "local": LocalClient,
    "tcp": TcpClient,
}


def request_plane_kinds() -> list[str]:
    return sorted(_SERVERS)


def _unknown(kind: str) -> ConfigError:
    return ConfigError(
        f"unknown request plane {kind!r}; choose one of: {', '.join(request_plane_kinds())}"
    )


def make_server(
    kind: str, host: str = "127.0.0.1", *, advertise_host: str | None = None
) -> RequestPlaneServer:
    """A request-plane server of ``kind``; ``host`` is the interface tcp binds and
    ``advertise_host`` the one it publishes (default: the bound address)."""
    try:
        return _SERVERS[kind](host, advertise_host)
    except KeyError:
        raise _unknown(kind) from None


def make_client(kind: str) -> RequestPlaneClient:
    try:
        return _CLIENTS[kind]()
    except KeyError:
        raise _unknown(kind) from None
