"""Request planes: how a request reaches one instance and its responses stream back.

``make_server(kind)`` / ``make_client(kind)`` build one by registry name: ``local``
(in-process), ``tcp`` (one multiplexed connection per peer) or ``nats`` (through a NATS
server; needs the process's ``NatsConnection``, see ``turnout.runtime.nats``).

``max_frame_bytes`` bounds what one frame may carry, both ways (``framing``); ``local`` moves
no bytes and ignores it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from turnout.errors import ConfigError
from turnout.runtime.request_plane.base import Handler, RequestPlaneClient, RequestPlaneServer
from turnout.runtime.request_plane.framing import DEFAULT_MAX_FRAME_BYTES
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
    host: str, advertise_host: str | None, nats: NatsConnection | None, max_frame_bytes: int
) -> RequestPlaneServer:
    # Imported on use: a process on the tcp or local plane never loads the NATS client.
    from turnout.runtime.request_plane.nats import NatsServer

    return NatsServer(_need(nats), max_frame_bytes=max_frame_bytes)


def _nats_client(nats: NatsConnection | None, max_frame_bytes: int) -> RequestPlaneClient:
    from turnout.runtime.request_plane.nats import NatsClient

    return NatsClient(_need(nats), max_frame_bytes=max_frame_bytes)


def _need(nats: NatsConnection | None) -> NatsConnection:
    if nats is None:
        raise ConfigError("the nats request plane needs a NATS connection (--nats-url)")
    return nats


_SERVERS: dict[str, Callable[[str, str | None, NatsConnection | None, int], RequestPlaneServer]] = {
    "local": lambda host, advertise_host, nats, max_frame_bytes: LocalServer(),
    "nats": _nats_server,
    "tcp": lambda host, advertise_host, nats, max_frame_bytes: TcpServer(
        host, advertise_host=advertise_host, max_frame_bytes=max_frame_bytes
    ),
}
_CLIENTS: dict[str, Callable[[NatsConnection | None, int], RequestPlaneClient]] = {
    "local": lambda nats, max_frame_bytes: LocalClient(),
    "nats": _nats_client,
    "tcp": lambda nats, max_frame_bytes: TcpClient(max_frame_bytes=max_frame_bytes),
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
) -> RequestPlaneServer:
    """A request-plane server of ``kind``; ``host`` is the interface tcp binds and
    ``advertise_host`` the one it publishes (default: the bound address); ``nats`` is the
    connection the ``nats`` kind serves on (``ConfigError`` without one)."""
    factory = _SERVERS.get(kind)
    if factory is None:
        raise _unknown(kind)
    return factory(host, advertise_host, nats, max_frame_bytes)


def make_client(
    kind: str,
    *,
    nats: NatsConnection | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> RequestPlaneClient:
    """A request-plane client of ``kind`` (``nats``: over the connection ``nats``)."""
    factory = _CLIENTS.get(kind)
    if factory is None:
        raise _unknown(kind)
    return factory(nats, max_frame_bytes)
