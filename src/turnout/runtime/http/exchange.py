"""What an HTTP route sees of one request and writes of its response.

The contract between ``runtime.http.server`` and the applications it serves (the frontend's
routes): a ``Scope`` (method, path, headers) and an ``Exchange`` that reads the body and
writes one response, whole (``response_bytes``) or streamed (``response_stream``). It follows
the shape of granian's RSGI protocol, which the routes were first written against, with one
difference that is the reason this server exists: ``ResponseStream.send_bytes`` waits while
the client's socket is full, so a slow reader slows its own stream instead of making the
process buffer it, and a reader stalled past the write deadline ends its request.

A client that goes away (connection closed, reset, or stalled past the deadline) raises
``ClientDisconnected`` from any read or write, and resolves ``client_disconnect()``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Protocol

#: Response headers as the routes give them: ``(name, value)`` pairs, names in lower case.
HeaderList = list[tuple[str, str]]


class ClientDisconnected(ConnectionError):
    """The client closed its connection, or stopped reading past the write deadline."""

    #: The status a request that ended this way is counted under (nginx's "client closed").
    status = 499


class Headers:
    """A request's headers: names lower-cased; repeated headers joined with ``", "``."""

    __slots__ = ("_map",)

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()) -> None:
        self._map: dict[str, str] = {}
        for name, value in pairs:
            self.add(name, value)

    def add(self, name: str, value: str) -> None:
        known = self._map.get(name)
        self._map[name] = value if known is None else f"{known}, {value}"

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._map.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._map

    def items(self) -> list[tuple[str, str]]:
        return list(self._map.items())

    def __len__(self) -> int:
        return len(self._map)


class Scope:
    """The request line and headers of one request."""

    __slots__ = ("client", "headers", "http_version", "method", "path", "query_string")

    def __init__(
        self,
        method: str,
        path: str,
        query_string: str,
        headers: Headers,
        http_version: str = "1.1",
        client: str = "",
    ) -> None:
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.http_version = http_version
        #: ``host:port`` of the peer (for logs).
        self.client = client


class ResponseStream(Protocol):
    """The body of a streamed response, written piece by piece."""

    async def send_bytes(self, data: bytes) -> None:
        """Write ``data``; waits while the client's socket is full (back-pressure)."""
        ...


class Exchange(Protocol):
    """One request's body and its one response."""

    async def __call__(self) -> bytes:
        """The whole request body."""
        ...

    def __aiter__(self) -> AsyncIterator[bytes]:
        """The request body in the pieces it arrives in."""
        ...

    def client_disconnect(self) -> asyncio.Future[None]:
        """A future resolved when the client has gone (never, for a client that stays);
        shared by whoever asks: add callbacks to it, never cancel it."""
        ...

    def add_response_header(self, name: str, value: str) -> None:
        """Send ``name: value`` with the response, whichever route or error writes it (set
        before the response starts; the caller vouches for the value: no CR or LF)."""
        ...

    def response_bytes(self, status: int, headers: HeaderList, body: bytes) -> None:
        """Send the whole response."""
        ...

    def response_stream(self, status: int, headers: HeaderList) -> ResponseStream:
        """Start a streamed response; its body follows through the returned stream."""
        ...


class Application(Protocol):
    """What the server runs for each request."""

    async def __call__(self, scope: Scope, exchange: Exchange, /) -> None: ...


async def discard_body(exchange: Exchange, limit: int) -> None:
    """Read and drop up to ``limit`` more bytes of a request body (e.g. before a 413, so
    the client reads the answer instead of a reset)."""
    seen = 0
    async for part in exchange:
        seen += len(part)
        if seen > limit:
            return


__all__ = [
    "Application",
    "ClientDisconnected",
    "Exchange",
    "HeaderList",
    "Headers",
    "ResponseStream",
    "Scope",
    "discard_body",
]
