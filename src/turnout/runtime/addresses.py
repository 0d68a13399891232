"""Which address a process binds its servers to, and which address it tells others to use.

A server binds ``--bind-host`` (default 127.0.0.1) and publishes ``--advertise-host`` in the
discovery store. Binding a wildcard (``0.0.0.0``, ``::``) without an advertise host would
publish an address nobody can dial, so the advertised address is then the one of the
interface that routes towards the discovery store (or the NATS server): the interface other
hosts of the deployment can reach, found with a connected UDP socket (no packet is sent).

A wrong ``--advertise-host`` starts cleanly and then serves nobody: ``dial_error`` lets a
process dial its own advertised address once, with a short deadline, to say so at start.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
from urllib.parse import urlsplit

from turnout.errors import ConfigError

logger = logging.getLogger("turnout.runtime")

DEFAULT_HOST = "127.0.0.1"
WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", "[::]", ""})


def is_wildcard(host: str) -> bool:
    return host in WILDCARD_HOSTS


def url_host_port(url: str, default_port: int) -> tuple[str, int]:
    """``(host, port)`` of ``scheme://[user@]host[:port]`` (a bare ``host:port`` works too)."""
    parts = urlsplit(url if "://" in url else f"//{url}")
    if not parts.hostname:
        raise ConfigError(f"cannot tell the host of {url!r}")
    try:
        port = parts.port or default_port
    except ValueError as exc:
        raise ConfigError(f"bad port in {url!r}: {exc}") from None
    return parts.hostname, port


def route_source_address(host: str, port: int) -> str | None:
    """The local address this machine would use to reach ``host:port``; None if no route."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect(sockaddr)  # UDP connect: picks a route, sends nothing
            except OSError:
                continue
            address: str = sock.getsockname()[0]
            return address
    return None


def resolve_advertise_host(
    bind_host: str, advertise_host: str | None, peers: list[str] | None = None
) -> str:
    """The host to publish for servers bound to ``bind_host``.

    An explicit ``advertise_host`` wins. A concrete ``bind_host`` is its own address. A
    wildcard bind advertises the address of the interface that routes to the first of
    ``peers`` (store or NATS URLs) that has a route; with none, the address of this
    machine's hostname (with a warning when that is a loopback address, which other hosts
    cannot reach).
    """
    if advertise_host:
        if is_wildcard(advertise_host):
            raise ConfigError(
                f"--advertise-host must be an address others can dial, not {advertise_host!r}"
            )
        return advertise_host
    if not is_wildcard(bind_host):
        return bind_host
    for peer in peers or []:
        host, port = url_host_port(peer, 1)
        source = route_source_address(host, port)
        if source is not None:
            return source
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = DEFAULT_HOST
    if is_loopback(address):
        logger.warning(
            "bound to %s with no --advertise-host and no remote store to route to: advertising "
            "%s, which other hosts cannot reach",
            bind_host,
            address,
        )
    return address


def is_loopback(host: str) -> bool:
    """True for a loopback address or ``localhost``: reachable from this machine only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def format_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def dial_error(
    host: str, port: int, timeout: float, tls: ssl.SSLContext | None = None
) -> str | None:
    """Why a TCP connection to ``host:port`` (with ``tls``: and its handshake, the server's
    certificate checked against ``host``) does not open within ``timeout`` seconds, or None
    when it opens (it is closed at once)."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(
                host, port, ssl=tls, server_hostname=host if tls is not None else None
            )
    except TimeoutError:
        return f"no answer within {timeout:g}s"
    except ssl.SSLError as exc:
        return f"TLS: {exc.reason or exc}"
    except OSError as exc:
        return exc.strerror or str(exc)
    writer.close()
    return None
