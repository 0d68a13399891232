"""A scriptable HTTP server for the attach engine's tests: each route answers what a test
says (JSON, an SSE stream, an error, garbage, silence, a cut), and every request is recorded.

Routes are ``(method, path) -> handler``; a handler gets the parsed JSON body and returns a
``Reply``. One request per connection (``Connection: close``) keeps it small.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reply:
    status: int = 200
    #: A JSON body (``json``), raw bytes (``raw``), or SSE events (``events``: each is a
    #: JSON-able object, or bytes sent as they are, written ``delay`` seconds apart).
    json: Any = None
    raw: bytes | None = None
    events: list[Any] | None = None
    delay: float = 0.0
    #: After the events: stay silent until the client leaves (a hung server).
    hang: bool = False
    #: After the events: close the connection without ending the chunked body (a crash).
    cut: bool = False


Handler = Callable[[Any], Reply]


@dataclass
class FakeServer:
    routes: dict[tuple[str, str], Handler] = field(default_factory=dict)
    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    #: Each request's headers (names lower-cased), in the order of ``requests``.
    headers: list[dict[str, str]] = field(default_factory=list)
    #: Connections closed by the client while their stream was being written.
    client_gone: int = 0
    port: int = 0
    _server: asyncio.Server | None = None
    _open: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def body(self, path: str) -> Any:
        """The JSON body of the last request to ``path``."""
        return next(b for _, p, b in reversed(self.requests) if p == path)

    def route(self, method: str, path: str, handler: Handler | Reply) -> None:
        self.routes[(method, path)] = handler if callable(handler) else (lambda _b, r=handler: r)

    async def start(self) -> FakeServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._open):
                writer.transport.abort()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {
                k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)
            }
            body_bytes = await reader.readexactly(int(headers.get("content-length", "0")))
            body = json.loads(body_bytes) if body_bytes else None
            self.requests.append((method, path, body))
            self.headers.append(headers)
            handler = self.routes.get((method, path))
            reply = (
                handler(body) if handler else Reply(404, json={"error": {"message": "no route"}})
            )
            await self._write(reply, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.client_gone += 1
        finally:
            self._open.discard(writer)
            writer.close()

    async def _write(
        self, reply: Reply, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Server Error"}
        status = f"HTTP/1.1 {reply.status} {reason.get(reply.status, 'X')}\r\n"
        if reply.events is None:
            data = reply.raw if reply.raw is not None else json.dumps(reply.json).encode()
            writer.write(
                (status + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
                + data
            )
            await writer.drain()
            return
        writer.write((status + "Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                      "Connection: close\r\n\r\n").encode())  # fmt: skip
        for event in reply.events:
            if reply.delay:
                await asyncio.sleep(reply.delay)
            line = event if isinstance(event, bytes) else b"data: " + json.dumps(event).encode()
            chunk = line + b"\n\n"
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        if reply.cut:
            writer.transport.abort()
            return
        if reply.hang:
            await reader.read(1)  # b"" once the client closes the connection
            raise ConnectionResetError
        writer.write(b"0\r\n\r\n")
        await writer.drain()
