"""The deadlines and bounds of the HTTP server's connections, and why it closes them."""

from __future__ import annotations

from dataclasses import dataclass

from .exchange import ClientDisconnected


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Deadlines (seconds) and bounds of the server's connections."""

    #: From a connection's opening, or its first byte after a response, to the end of the
    #: request's headers (first byte and headers).
    header_timeout: float = 10.0
    #: From the end of the headers to the end of the body.
    body_timeout: float = 60.0
    #: How long a connection may sit idle between requests.
    keepalive_timeout: float = 30.0
    #: How long a response write may wait for a client that does not read.
    write_timeout: float = 60.0
    max_connections: int = 16384
    #: At the cap, a connection idle this long makes room for a new one.
    evict_after: float = 1.0
    #: The answer to a connection past the cap when none can make room (with Retry-After).
    reject_status: int = 503
    max_header_bytes: int = 64 * 1024
    #: Request body bytes read ahead of the route before the connection stops reading.
    max_buffered_body: int = 256 * 1024
    max_pipelined: int = 8
    #: A streamed response's socket buffer above which ``send_bytes`` waits.
    write_high_water: int = 64 * 1024
    backlog: int = 1024


class RequestTimeout(ClientDisconnected):
    """The request's headers or body did not arrive in time (answered 408)."""

    status = 408


class MalformedRequest(ClientDisconnected):
    """The request could not be parsed (answered 400, or 431 for oversized headers)."""

    status = 400


#: Why connections were closed by the server, as ``HttpServer.closed`` counts them.
CLOSE_REASONS = (
    "header_timeout",
    "body_timeout",
    "idle_timeout",
    "write_stall",
    "evicted",
    "over_capacity",
    "bad_request",
)
