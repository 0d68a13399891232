"""The HTTP server on real sockets: framing, deadlines, the connection cap, back-pressure."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable

import pytest

from turnout.runtime.http import (
    ClientDisconnected,
    Exchange,
    HttpLimits,
    HttpServer,
    Scope,
)

CHUNK = b"x" * 65536


class App:
    """Echoes bodies; ``/stream`` streams ``CHUNK`` until told to stop or the client goes."""

    def __init__(self) -> None:
        self.chunks_sent = 0
        self.stream_error: BaseException | None = None
        self.stream_done = asyncio.Event()
        self.disconnects = 0

    async def __call__(self, scope: Scope, exchange: Exchange) -> None:
        if scope.path == "/stream":
            stream = exchange.response_stream(200, [("content-type", "text/plain")])
            try:
                for _ in range(4000):
                    await stream.send_bytes(CHUNK)
                    self.chunks_sent += 1
            except ClientDisconnected as exc:
                self.stream_error = exc
            finally:
                self.stream_done.set()
            return
        if scope.path == "/early":  # refused before its body is read (as a 401 is)
            exchange.response_bytes(401, [("content-type", "text/plain")], b"refused")
            return
        if scope.path == "/wait-disconnect":
            await exchange.client_disconnect()
            self.disconnects += 1
            return
        body = await exchange()
        answer = {"method": scope.method, "path": scope.path, "query": scope.query_string,
                  "body": body.decode(), "agent": scope.headers.get("user-agent")}  # fmt: skip
        exchange.response_bytes(200, [("content-type", "application/json")],
                                json.dumps(answer).encode())  # fmt: skip


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., asyncio.Future[tuple[HttpServer, App]]]]:
    servers: list[HttpServer] = []

    async def start(**limits: object) -> tuple[HttpServer, App]:
        app = App()
        server = HttpServer(app, "127.0.0.1", 0, limits=HttpLimits(**limits))  # type: ignore[arg-type]
        await server.start()
        servers.append(server)
        return server, app

    yield start  # type: ignore[misc]
    for server in servers:
        server.stop()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers, body (content-length or chunked)."""
    status_line = await reader.readline()
    assert status_line, "connection closed before a response"
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    parts = []
    while True:
        size = int((await reader.readline()).strip(), 16)
        if size == 0:
            await reader.readline()
            return status, headers, b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readline()


_writers: list[asyncio.StreamWriter] = []


@pytest.fixture(autouse=True)
async def close_writers() -> AsyncIterator[None]:
    yield
    for writer in _writers:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    _writers.clear()


async def connect(server: HttpServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    _writers.append(writer)
    return reader, writer


async def test_requests_keep_alive_and_pipelining(serve) -> None:  # type: ignore[no-untyped-def]
    server, _ = await serve()
    reader, writer = await connect(server)
    writer.write(
        b"POST /a?x=1 HTTP/1.1\r\nhost: t\r\nuser-agent: t1\r\ncontent-length: 3\r\n\r\nabc"
        b"POST /b HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        b"2\r\nhe\r\n3\r\nllo\r\n0\r\n\r\n"
    )
    status, _, body = await read_response(reader)
    assert status == 200
    assert json.loads(body) == {"method": "POST", "path": "/a", "query": "x=1", "body": "abc",
                                "agent": "t1"}  # fmt: skip
    status, headers, body = await read_response(reader)
    assert status == 200 and json.loads(body)["body"] == "hello"
    assert "date" in headers and headers.get("connection") != "close"
    writer.close()


async def test_an_early_answer_to_a_huge_body_closes_instead_of_reading_it(serve) -> None:  # type: ignore[no-untyped-def]
    server, _ = await serve()
    reader, writer = await connect(server)
    writer.write(b"POST /early HTTP/1.1\r\nhost: t\r\ncontent-length: 100000000000\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert status == 401 and body == b"refused" and headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 30) == b""  # the server ended its side
    # The server drops at most DRAIN_ALLOWANCE more, then closes: a client pushing the body
    # is cut off long before the socket buffers of both ends could take 256 MiB.
    sent = 0
    with pytest.raises(ConnectionError):
        while sent < 256 << 20:
            writer.write(CHUNK)
            await asyncio.wait_for(writer.drain(), 30)
            sent += len(CHUNK)


async def test_an_early_answer_to_a_small_body_keeps_the_connection(serve) -> None:  # type: ignore[no-untyped-def]
    server, _ = await serve()
    reader, writer = await connect(server)
    writer.write(b"POST /early HTTP/1.1\r\nhost: t\r\ncontent-length: 1000\r\n\r\n")
    status, headers, _ = await read_response(reader)
    assert status == 401 and headers.get("connection") != "close"
    writer.write(b"y" * 1000 + b"POST /a HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\nok")
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["body"] == "ok"


async def test_expect_continue(serve) -> None:  # type: ignore[no-untyped-def]
    server, _ = await serve()
    reader, writer = await connect(server)
    writer.write(
        b"POST /a HTTP/1.1\r\nhost: t\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n"
    )
    assert await reader.readline() == b"HTTP/1.1 100 Continue\r\n"
    await reader.readline()
    writer.write(b"ok")
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["body"] == "ok"
    writer.close()


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        # Request smuggling: both framings at once is refused, never guessed.
        (b"POST /a HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\n"
         b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n", 400),
        (b"POST /a HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", 400),
        (b"GET /a HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * 70000 + b"\r\n\r\n", 431),
        (b"NOT-HTTP\r\n\r\n", 400),
    ],
)  # fmt: skip
async def test_malformed_requests_get_a_json_error(serve, raw: bytes, status: int) -> None:  # type: ignore[no-untyped-def]
    server, _ = await serve()
    reader, writer = await connect(server)
    writer.write(raw)
    got, headers, body = await read_response(reader)
    assert got == status
    assert headers["connection"] == "close"
    assert json.loads(body)["error"]["message"]
    assert await reader.read() == b""  # closed
    assert server.closed["bad_request"] == 1


async def test_headers_that_never_end_get_408(serve) -> None:  # type: ignore[no-untyped-def]
    server, _ = await serve(header_timeout=0.3)
    reader, writer = await connect(server)
    writer.write(b"POST /a HTTP/1.1\r\nhost: t\r\n")
    status, _, body = await asyncio.wait_for(read_response(reader), 10)
    assert status == 408
    assert "headers" in json.loads(body)["error"]["message"]
    assert await reader.read() == b""
    assert server.closed["header_timeout"] == 1


async def test_a_body_that_never_comes_gets_408(serve) -> None:  # type: ignore[no-untyped-def]
    server, _ = await serve(body_timeout=0.3)
    reader, writer = await connect(server)
    writer.write(b"POST /a HTTP/1.1\r\nhost: t\r\ncontent-length: 10\r\n\r\nabc")
    status, _, body = await asyncio.wait_for(read_response(reader), 10)
    assert status == 408
    assert "body" in json.loads(body)["error"]["message"]
    assert server.closed["body_timeout"] == 1


async def test_silent_and_idle_connections_are_closed(serve) -> None:  # type: ignore[no-untyped-def]
    server, _ = await serve(header_timeout=0.3, keepalive_timeout=0.3)
    silent_reader, _silent = await connect(server)
    reader, writer = await connect(server)
    writer.write(b"GET /a HTTP/1.1\r\nhost: t\r\n\r\n")
    assert (await read_response(reader))[0] == 200
    # Both are closed by the server (read gives EOF) within the deadline.
    assert await asyncio.wait_for(silent_reader.read(), 10) == b""
    assert await asyncio.wait_for(reader.read(), 10) == b""
    assert server.closed["idle_timeout"] == 2
    assert server.num_connections == 0


async def test_a_flood_of_silent_connections_evicts_them_not_real_clients(serve) -> None:  # type: ignore[no-untyped-def]
    server, _ = await serve(max_connections=50, evict_after=0.0)
    loop = asyncio.get_running_loop()
    silent = []
    for _ in range(200):
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", server.port))
        silent.append(sock)
    try:
        reader, writer = await connect(server)
        writer.write(b"GET /live HTTP/1.1\r\nhost: t\r\n\r\n")
        status, _, _ = await asyncio.wait_for(read_response(reader), 10)
        assert status == 200
        assert server.num_connections <= 50
        assert server.closed["evicted"] >= 150
        writer.close()
    finally:
        for sock in silent:
            sock.close()


async def test_a_client_that_stops_reading_stops_its_stream(serve) -> None:  # type: ignore[no-untyped-def]
    """The response waits for the socket: only what the socket buffers is produced, and a
    client stalled past the write deadline ends the request as a disconnect."""
    server, app = await serve(write_timeout=1.0)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", server.port))
    await loop.sock_sendall(sock, b"GET /stream HTTP/1.1\r\nhost: t\r\n\r\n")
    await asyncio.wait_for(app.stream_done.wait(), 20)
    sock.close()
    assert isinstance(app.stream_error, ClientDisconnected)
    # 4,000 chunks of 64 KiB were asked for; the kernel's buffers hold a few megabytes.
    assert app.chunks_sent < 200, app.chunks_sent
    assert server.closed["write_stall"] == 1


async def test_a_reading_client_gets_the_whole_stream(serve) -> None:  # type: ignore[no-untyped-def]
    server, app = await serve()
    reader, writer = await connect(server)
    writer.write(b"GET /stream HTTP/1.1\r\nhost: t\r\n\r\n")
    status, _, body = await asyncio.wait_for(read_response(reader), 60)
    assert status == 200 and len(body) == 4000 * len(CHUNK)
    assert app.stream_error is None
    writer.close()


async def test_client_disconnect_resolves(serve) -> None:  # type: ignore[no-untyped-def]
    server, app = await serve()
    _reader, writer = await connect(server)
    writer.write(b"GET /wait-disconnect HTTP/1.1\r\nhost: t\r\n\r\n")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while server.num_connections == 0 or not server._busy:  # the request is running
        assert loop.time() < deadline
        await asyncio.sleep(0.01)
    writer.close()
    while app.disconnects == 0:
        assert loop.time() < deadline
        await asyncio.sleep(0.01)


async def test_past_the_cap_a_burst_is_answered_not_cut_off(serve) -> None:  # type: ignore[no-untyped-def]
    """Connections that only just opened are not evicted (their requests are on the way):
    the newcomer gets the reject status with Retry-After instead."""
    server, _ = await serve(max_connections=5, evict_after=60.0, reject_status=429)
    held = [await connect(server) for _ in range(5)]
    reader, _writer = await connect(server)
    status, headers, body = await asyncio.wait_for(read_response(reader), 10)
    assert status == 429 and headers["retry-after"] == "1"
    assert json.loads(body)["error"]["type"] == "overloaded_error"
    assert server.closed["over_capacity"] == 1
    # The held ones still work.
    held_reader, held_writer = held[0]
    held_writer.write(b"GET /a HTTP/1.1\r\nhost: t\r\n\r\n")
    assert (await read_response(held_reader))[0] == 200
