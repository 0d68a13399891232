"""Request planes (local, tcp and nats) against the RequestPlane contract."""

from __future__ import annotations

import asyncio
import gc
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
from tests.servers.nats import NatsServerProcess, nats_binary
from tests.servers.process import require

from turnout.errors import ConfigError, PeerUnavailable, RemoteError, StreamBroken
from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.nats import NatsConnection, NatsOptions, connect_nats
from turnout.runtime.request_plane import (
    RequestPlaneClient,
    RequestPlaneServer,
    TcpClient,
    TcpServer,
    make_client,
    make_server,
)
from turnout.runtime.request_plane.base import Handler, ResponseStream
from turnout.runtime.request_plane.framing import (
    WINDOW,
    Frame,
    FrameError,
    FrameReader,
    FrameWriter,
    Kind,
)


@dataclass
class Probe:
    """What the handlers under test report: how far they got and how they ended."""

    produced: int = 0
    finally_ran: asyncio.Event = field(default_factory=asyncio.Event)
    ctx: RequestContext | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)


async def count(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    """Yields ``b"<tag>:<i>"`` for i < n, from payload ``b"<tag>:<n>"``."""
    tag, n = payload.split(b":")
    for i in range(int(n)):
        yield tag + b":" + str(i).encode()
        if i % 7 == 0:
            await asyncio.sleep(0)


async def fail_after_one(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield b"first"
    raise ValueError("boom")


def endless(probe: Probe, delay: float = 0.0) -> Handler:
    async def handler(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        probe.ctx = ctx
        probe.started.set()
        try:
            while True:
                probe.produced += 1
                yield b"x"
                await asyncio.sleep(delay)
        finally:
            probe.finally_ran.set()

    return handler


@dataclass
class Plane:
    server: RequestPlaneServer
    client: RequestPlaneClient
    address: TransportAddress

    def stream(self, path: str, payload: bytes = b"") -> ResponseStream:
        return self.client.stream(self.address, path, payload, RequestContext())


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServerProcess]:
    """One nats-server for the module's contract tests (they never disrupt it)."""
    require("nats-server", nats_binary() is not None)
    with NatsServerProcess() as server:
        yield server


@pytest.fixture(params=["local", "tcp", "nats"])
async def plane(request: pytest.FixtureRequest) -> AsyncIterator[Plane]:
    """Each request plane kind in turn: the contract tests run against all of them."""
    conn: NatsConnection | None = None
    if request.param == "nats":
        nats_server: NatsServerProcess = request.getfixturevalue("nats_server")
        conn = await connect_nats(NatsOptions(servers=[nats_server.url]))
    server = make_server(request.param, nats=conn)
    server.register("ns/c/count", count)
    server.register("ns/c/fail", fail_after_one)
    address = await server.start()
    client = make_client(request.param, nats=conn)
    yield Plane(server, client, address)
    await client.close()
    await server.stop(drain_timeout=0)
    if conn is not None:
        await conn.close()


async def collect(stream: AsyncIterator[bytes]) -> list[bytes]:
    return [item async for item in stream]


async def test_many_concurrent_streams_in_order(plane: Plane) -> None:
    results = await asyncio.gather(
        *(collect(plane.stream("ns/c/count", f"s{i}:200".encode())) for i in range(40))
    )
    for i, items in enumerate(results):
        assert items == [f"s{i}:{j}".encode() for j in range(200)]
    if isinstance(plane.client, TcpClient):
        assert len(plane.client._conns) == 1  # one multiplexed connection for all 40
        assert isinstance(plane.server, TcpServer) and len(plane.server._conns) == 1


async def test_handler_error_is_remote_error_and_server_keeps_serving(plane: Plane) -> None:
    stream = plane.stream("ns/c/fail")
    assert await anext(stream) == b"first"
    with pytest.raises(RemoteError, match="ValueError: boom"):
        await anext(stream)
    assert await collect(plane.stream("ns/c/count", b"a:3")) == [b"a:0", b"a:1", b"a:2"]


async def test_abort_fails_the_pending_next_and_cancels_the_handler(plane: Plane) -> None:
    """What the endpoint client does to the streams of an instance known to be gone: the
    caller's pending ``__anext__`` raises the given error at once, the stream is over after
    it, and the handler (its server still there) is cancelled. The same on every plane."""
    probe = Probe()
    plane.server.register("ns/c/endless", endless(probe, delay=3600.0))
    stream = plane.stream("ns/c/endless")
    assert await anext(stream) == b"x"
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    assert not pending.done()
    gone = StreamBroken("instance left discovery")
    stream.abort(gone)
    async with asyncio.timeout(5):
        with pytest.raises(StreamBroken) as info:
            await pending
    assert info.value is gone
    stream.abort(StreamBroken("again"))  # a finished stream: no-op
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    async with asyncio.timeout(5):
        await probe.finally_ran.wait()
    assert probe.ctx is not None and probe.ctx.is_cancelled


async def test_unknown_endpoint_is_remote_error(plane: Plane) -> None:
    with pytest.raises(RemoteError, match="ns/c/nope"):
        await collect(plane.stream("ns/c/nope"))


@pytest.mark.parametrize("how", ["aclose", "task_cancel", "drop"])
async def test_client_cancel_reaches_handler(plane: Plane, how: str) -> None:
    probe = Probe()
    plane.server.register("ns/c/endless", endless(probe, delay=0.001))
    stream = plane.stream("ns/c/endless")
    if how == "aclose":
        assert await anext(stream) == b"x"
        await stream.aclose()
    elif how == "task_cancel":

        async def consume() -> None:
            async for _ in stream:
                pass

        task = asyncio.create_task(consume())
        await probe.started.wait()
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        assert await anext(stream) == b"x"
        del stream
        gc.collect()
    async with asyncio.timeout(2.0):
        await probe.finally_ran.wait()
    assert probe.ctx is not None and probe.ctx.is_cancelled


async def test_server_stopped_mid_stream_is_stream_broken(plane: Plane) -> None:
    probe = Probe()
    plane.server.register("ns/c/endless", endless(probe, delay=0.01))
    stream = plane.stream("ns/c/endless")
    assert await anext(stream) == b"x"
    await plane.server.stop(drain_timeout=0)
    with pytest.raises(StreamBroken):
        async with asyncio.timeout(2.0):
            while True:
                await anext(stream)
    assert probe.finally_ran.is_set()


async def test_stop_drains_in_flight_and_refuses_new(plane: Plane) -> None:
    stream = plane.stream("ns/c/count", b"d:50")
    assert await anext(stream) == b"d:0"
    stopping = asyncio.create_task(plane.server.stop(drain_timeout=5.0))
    await asyncio.sleep(0.01)
    rest = await collect(stream)
    assert rest == [f"d:{j}".encode() for j in range(1, 50)]
    await stopping
    with pytest.raises(PeerUnavailable):
        await collect(plane.stream("ns/c/count", b"e:1"))


async def test_unregistered_path_is_refused_as_peer_unavailable(plane: Plane) -> None:
    plane.server.unregister("ns/c/count")
    with pytest.raises(PeerUnavailable):
        await collect(plane.stream("ns/c/count", b"a:1"))


async def test_drain_one_path_cancels_its_stragglers(plane: Plane) -> None:
    probe = Probe()
    plane.server.register("ns/c/endless", endless(probe, delay=0.01))
    stream = plane.stream("ns/c/endless")
    assert await anext(stream) == b"x"
    plane.server.unregister("ns/c/endless")
    await plane.server.drain("ns/c/endless", drain_timeout=0.05)
    with pytest.raises(StreamBroken):
        async with asyncio.timeout(2.0):
            while True:
                await anext(stream)
    # Other paths are untouched.
    assert await collect(plane.stream("ns/c/count", b"a:1")) == [b"a:0"]


@pytest.mark.parametrize("kind", ["local", "tcp", "nats"])
async def test_nothing_listening_is_peer_unavailable(
    kind: str, request: pytest.FixtureRequest
) -> None:
    conn: NatsConnection | None = None
    if kind == "nats":
        nats_server: NatsServerProcess = request.getfixturevalue("nats_server")
        conn = await connect_nats(NatsOptions(servers=[nats_server.url]))
        address = TransportAddress(kind="nats", address="turnout.rp.nobody-here")
    elif kind == "tcp":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        address = TransportAddress(kind="tcp", address=f"127.0.0.1:{port}")
    else:
        address = TransportAddress(kind="local", address="nobody-here")
    client = make_client(kind, nats=conn)
    try:
        with pytest.raises(PeerUnavailable, match=address.address):
            async with asyncio.timeout(2):
                await collect(client.stream(address, "a/b/c", b"", RequestContext()))
    finally:
        await client.close()
        if conn is not None:
            await conn.close()


async def test_slow_consumer_bounds_the_handler(plane: Plane) -> None:
    probe = Probe()
    plane.server.register("ns/c/endless", endless(probe))
    stream = plane.stream("ns/c/endless")
    consumed = 0
    for _ in range(3):
        await anext(stream)
        consumed += 1
        await asyncio.sleep(0.2)  # the consumer stalls; the handler must stall too
        assert probe.produced - consumed <= WINDOW + 2, probe.produced
    for _ in range(5 * WINDOW):
        await anext(stream)
        consumed += 1
        assert probe.produced - consumed <= WINDOW + 2
    assert probe.produced > 4 * WINDOW  # it does move on as credit comes back
    await stream.aclose()


CHILD_SERVER = """
import asyncio
from turnout.runtime.request_plane import TcpServer

async def endless(payload, ctx):
    while True:
        yield b"tick"
        await asyncio.sleep(0.01)

async def main():
    server = TcpServer()
    server.register("p", endless)
    print((await server.start()).address, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_tcp_peer_killed_mid_stream_is_stream_broken() -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD_SERVER, stdout=asyncio.subprocess.PIPE
    )
    client = TcpClient()
    try:
        assert child.stdout is not None
        async with asyncio.timeout(20):
            address = (await child.stdout.readline()).decode().strip()
        stream = client.stream(
            TransportAddress(kind="tcp", address=address), "p", b"", RequestContext()
        )
        assert await anext(stream) == b"tick"
        child.kill()
        with pytest.raises(StreamBroken, match=address):
            async with asyncio.timeout(5):
                while True:
                    await anext(stream)
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
        await client.close()


def test_unknown_plane_is_config_error() -> None:
    with pytest.raises(ConfigError, match="local, nats, tcp"):
        make_server("carrier-pigeon")
    with pytest.raises(ConfigError, match="local, nats, tcp"):
        make_client("carrier-pigeon")


def test_nats_plane_without_a_connection_is_config_error() -> None:
    with pytest.raises(ConfigError, match="NATS connection"):
        make_server("nats")
    with pytest.raises(ConfigError, match="NATS connection"):
        make_client("nats")


async def test_non_bytes_item_is_remote_error_not_a_broken_connection(plane: Plane) -> None:
    async def wrong(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        yield bytearray(b"ok")  # type: ignore[misc]
        yield "text"  # type: ignore[misc]

    plane.server.register("ns/c/wrong", wrong)
    stream = plane.stream("ns/c/wrong")
    assert await anext(stream) == b"ok"
    with pytest.raises(RemoteError, match="must yield bytes, got str"):
        await anext(stream)
    assert await collect(plane.stream("ns/c/count", b"a:2")) == [b"a:0", b"a:1"]


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_frame_reader_reassembles_any_split(chunk: int) -> None:
    frames = [
        Frame(Kind.REQUEST, 1, b"payload", "ns/c/e", 0, "rid"),
        Frame(Kind.DATA, 1, b"\x00" * 300),
        Frame(Kind.CREDIT, 1, num=16),
        Frame(Kind.END, 1),
    ]
    writer = FrameWriter()
    for frame in frames:
        writer.append(frame)
    wire = bytes(writer.take())
    reader = FrameReader()
    got = []
    for i in range(0, len(wire), chunk):
        got += reader.feed(wire[i : i + chunk])
    assert got == frames


def test_frame_reader_rejects_absurd_length() -> None:
    with pytest.raises(FrameError, match="exceeds"):
        FrameReader().feed(b"\xff\xff\xff\xff" + b"\x00" * 8)


async def test_a_peer_sending_past_its_credit_ends_the_stream() -> None:
    """A server may run at most ``WINDOW`` items ahead of the consumer; one that sends more
    (broken or hostile) ends the stream instead of growing the client's buffer."""
    answered = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        frames = FrameReader()
        request: list[Frame] = []
        while not request:
            request = frames.feed(await reader.read(65536))
        out = FrameWriter()
        sid = request[0].stream_id
        out.append(Frame(Kind.ACK, sid))
        out.append(Frame(Kind.DATA, sid, [b"x"] * (WINDOW + 1)))
        writer.write(bytes(out.take()))
        await writer.drain()
        answered.set()
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(flood, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = TcpClient()
    try:
        stream = client.stream(
            TransportAddress(kind="tcp", address=f"127.0.0.1:{port}"), "p", b"", RequestContext()
        )
        with pytest.raises(StreamBroken, match="more items than it was credited"):
            async with asyncio.timeout(10):
                await anext(stream)
        assert answered.is_set()
    finally:
        await client.close()
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()
