"""The request plane's frame bound (``--max-frame-bytes``): a peer announcing a frame over it
is cut off from the 4-byte header, before a byte of the frame is buffered, on the server and
on the client alike; legitimate large frames still pass, batches are split at the bound, and
an item over it fails its own stream, not the connection others share."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import psutil
import pytest
from tests.servers.nats import NatsServerProcess, nats_binary
from tests.servers.process import require
from tests.watchdog import MemoryWatchdog

from turnout.cli.flags import planes_config
from turnout.cli.main import build_parser
from turnout.cli.serve import worker_argv
from turnout.errors import ConfigError, PeerUnavailable, RemoteError, RequestPlaneError
from turnout.protocols.llm import PreprocessedRequest, StopConditions
from turnout.protocols.model import Instance, TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery import FileStore
from turnout.runtime.nats import NatsOptions, connect_nats
from turnout.runtime.request_plane import TcpClient, TcpServer
from turnout.runtime.request_plane.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    HEADER,
    FrameReader,
    FrameTooLarge,
)
from turnout.runtime.request_plane.nats import NatsClient, NatsServer
from turnout.runtime.serving import handler_path

MiB = 1024 * 1024


async def collect(stream: AsyncIterator[bytes]) -> list[bytes]:
    return [item async for item in stream]


# --- the reader ----------------------------------------------------------------------------------


def test_an_announced_oversize_frame_is_refused_from_its_header_alone() -> None:
    reader = FrameReader(2 * MiB)
    with pytest.raises(FrameTooLarge) as caught:
        reader.feed(HEADER.pack(2 * MiB + 1))
    assert (caught.value.size, caught.value.limit) == (2 * MiB + 1, 2 * MiB)


def test_a_frame_buffer_holds_only_what_arrived() -> None:
    """A header announcing a frame within the bound allocates nothing from that length."""
    reader = FrameReader(2 * MiB)
    assert reader.feed(HEADER.pack(2 * MiB) + b"x" * 10) == []
    assert reader.buffered == 14
    assert reader.feed(b"y" * 1000) == []
    assert reader.buffered == 1014


def test_the_bound_is_a_flag_with_an_environment_default(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser().parse_args
    assert planes_config(parse(["worker"])).max_frame_bytes == DEFAULT_MAX_FRAME_BYTES
    assert 64 * MiB >= DEFAULT_MAX_FRAME_BYTES  # far below the old 256 MiB
    assert planes_config(parse(["worker", "--max-frame-bytes", str(8 * MiB)])).max_frame_bytes == (
        8 * MiB
    )
    for command in ("frontend", "router", "serve"):
        args = parse([command, "--max-frame-bytes", str(3 * MiB)])
        assert args.max_frame_bytes == 3 * MiB
    serve = parse(["serve", "--engine", "echo", "--max-frame-bytes", str(3 * MiB)])
    argv = worker_argv(serve, "/s", 1)  # serve's workers get serve's bound
    assert argv[argv.index("--max-frame-bytes") + 1] == str(3 * MiB)
    with pytest.raises(ConfigError, match="--max-frame-bytes must be at least"):
        planes_config(parse(["worker", "--max-frame-bytes", "1000"]))
    monkeypatch.setenv("TURNOUT_MAX_FRAME_BYTES", str(5 * MiB))
    assert planes_config(build_parser().parse_args(["worker"])).max_frame_bytes == 5 * MiB


# --- tcp, in process -----------------------------------------------------------------------------


async def sizes(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    """``b"<count>x<size>"`` -> ``count`` items of ``size`` bytes, all in one loop iteration
    (so the server batches them into one DATA frame unless it must split)."""
    count, size = (int(part) for part in payload.split(b"x"))
    for i in range(count):
        yield bytes([i % 256]) * size


async def length(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield str(len(payload)).encode()


@pytest.fixture
async def tcp_pair() -> AsyncIterator[tuple[TcpClient, TransportAddress]]:
    server = TcpServer(max_frame_bytes=1 * MiB)
    server.register("sizes", sizes)
    server.register("length", length)
    client = TcpClient(max_frame_bytes=1 * MiB)
    address = await server.start()
    try:
        yield client, address
    finally:
        await client.close()
        await server.stop(drain_timeout=0)


async def test_items_batched_past_the_bound_travel_in_several_frames(
    tcp_pair: tuple[TcpClient, TransportAddress],
) -> None:
    client, address = tcp_pair
    got = await collect(client.stream(address, "sizes", b"40x100000", RequestContext()))
    assert got == [bytes([i]) * 100_000 for i in range(40)]  # 4 MB through a 1 MiB bound


async def test_a_reply_item_over_the_bound_fails_its_stream_not_the_connection(
    tcp_pair: tuple[TcpClient, TransportAddress],
) -> None:
    client, address = tcp_pair
    with pytest.raises(RemoteError, match=r"reply item of 2097152 bytes .*--max-frame-bytes"):
        await collect(client.stream(address, "sizes", b"1x2097152", RequestContext()))
    assert await collect(client.stream(address, "sizes", b"2x10", RequestContext())) == [
        b"\0" * 10,
        b"\1" * 10,
    ]


async def test_a_request_over_the_bound_is_refused_before_it_is_sent(
    tcp_pair: tuple[TcpClient, TransportAddress],
) -> None:
    client, address = tcp_pair
    with pytest.raises(RequestPlaneError, match=r"payload of 1048576 bytes .*--max-frame-bytes"):
        await collect(client.stream(address, "length", b"r" * MiB, RequestContext()))
    near = b"r" * (MiB - 4096)
    assert await collect(client.stream(address, "length", near, RequestContext())) == [
        str(len(near)).encode()
    ]


async def test_a_legitimately_large_request_passes_the_default_bound() -> None:
    """A 20 MB request (a long prompt's token ids with a large grammar) is no attack."""
    server = TcpServer()
    server.register("length", length)
    client = TcpClient()
    address = await server.start()
    big = b"g" * (20 * 1000 * 1000)
    try:
        assert await collect(client.stream(address, "length", big, RequestContext())) == [
            b"20000000"
        ]
    finally:
        await client.close()
        await server.stop(drain_timeout=0)


async def test_a_server_announcing_a_huge_reply_is_cut_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker (or whatever answers at its address) cannot make the frontend buffer a
    gigabyte: the reply's header alone ends the connection, and the stream fails at once."""
    announced = 1 << 30

    async def liar(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(4)  # the request has arrived
        writer.write(HEADER.pack(announced) + b"\0" * 1024)
        await writer.drain()
        await reader.read()  # until the client hangs up
        writer.close()

    server = await asyncio.start_server(liar, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = TcpClient(max_frame_bytes=2 * MiB)
    address = TransportAddress(kind="tcp", address=f"127.0.0.1:{port}")
    try:
        with caplog.at_level(logging.WARNING, logger="turnout.runtime"):
            async with asyncio.timeout(5):
                with pytest.raises(PeerUnavailable, match="lost"):
                    await collect(client.stream(address, "p", b"hi", RequestContext()))
        lines = [r.getMessage() for r in caplog.records if "announced a frame" in r.getMessage()]
        assert len(lines) == 1
        assert f"127.0.0.1:{port}" in lines[0] and str(announced) in lines[0]
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


# --- nats ----------------------------------------------------------------------------------------


@pytest.fixture
def nats_server() -> Iterator[NatsServerProcess]:
    require("nats-server", nats_binary() is not None)
    with NatsServerProcess() as server:
        yield server


async def test_nats_bounds_an_item_and_its_reassembly(nats_server: NatsServerProcess) -> None:
    """Items over one NATS message travel as PARTs: the server refuses an item over the
    bound, and a client stops reassembling PARTs past its own bound, whatever a server with
    a larger one sends."""
    conn = await connect_nats(NatsOptions(servers=[nats_server.url]))
    server = NatsServer(conn, max_frame_bytes=4 * MiB)
    server.register("sizes", sizes)
    strict = NatsClient(conn, max_frame_bytes=2 * MiB)
    lenient = NatsClient(conn, max_frame_bytes=4 * MiB)
    try:
        address = await server.start()
        three = 3 * MiB
        got = await collect(
            lenient.stream(address, "sizes", f"1x{three}".encode(), RequestContext())
        )
        assert got == [b"\0" * three]
        with pytest.raises(RemoteError, match="over the request plane's frame limit"):
            await collect(lenient.stream(address, "sizes", b"1x5000000", RequestContext()))
        with pytest.raises(RequestPlaneError, match="frame limit of 2097152"):
            await collect(strict.stream(address, "sizes", f"1x{three}".encode(), RequestContext()))
        assert await collect(strict.stream(address, "sizes", b"1x5", RequestContext())) == [
            b"\0" * 5
        ]
    finally:
        await strict.close()
        await lenient.close()
        await server.stop(drain_timeout=0)
        await conn.close()


# --- a real worker under attack ------------------------------------------------------------------


def _start_worker(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "turnout", "worker", "--engine", "echo",
             "--model-name", "echo", "--store-path", str(tmp_path / "store.sqlite"),
             "--lease-ttl", "2"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return proc, log_path


def _read(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:]


async def _instance(store_path: Path, proc: subprocess.Popen[bytes], log_path: Path) -> Instance:
    store = FileStore(store_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(await asyncio.to_thread(_read, log_path))
            if await asyncio.to_thread(store_path.exists):
                found = await store.get_prefix("v1/instances/")
                if found:
                    return msgspec.json.decode(found[0].value, type=Instance)
            await asyncio.sleep(0.1)
    finally:
        await store.close()
    raise AssertionError("the worker did not register: " + await asyncio.to_thread(_read, log_path))


def _attack(host: str, port: int, announced: int, send: int, outcome: list[str]) -> None:
    """Announce a frame of ``announced`` bytes, then push up to ``send`` bytes of it; record
    how the connection ended and how long it took."""
    started = time.monotonic()
    chunk = b"\0" * MiB
    with socket.create_connection((host, port), timeout=10) as sock:
        try:
            sock.sendall(HEADER.pack(announced))
            for _ in range(send // MiB):
                sock.sendall(chunk)
            end = "open" if sock.recv(1) else "closed"
        except TimeoutError:
            end = "open"  # the server read it all and waits for more: the bug
        except OSError:
            end = "closed"
    outcome.append(f"{end} after {time.monotonic() - started:.1f}s")


@pytest.mark.slow
async def test_a_worker_cuts_off_announced_oversize_frames_without_growing(
    tmp_path: Path,
) -> None:
    """Four connections announce 200 MiB frames (under the old 256 MiB bound, over the
    default) and push 64 MiB each: the worker drops each from its header, with one log line
    naming peer and size, its resident size does not grow, and it serves the next request
    (a legitimately large one) as before."""
    proc, log_path = _start_worker(tmp_path)
    try:
        instance = await _instance(tmp_path / "store.sqlite", proc, log_path)
        host, port = instance.transport.address.rsplit(":", 1)
        announced = 200 * MiB
        outcomes: list[str] = []
        baseline = psutil.Process(proc.pid).memory_info().rss
        with MemoryWatchdog(proc.pid, limit_bytes=baseline + 400 * MiB) as watchdog:
            threads = [
                threading.Thread(
                    target=_attack, args=(host, int(port), announced, 64 * MiB, outcomes)
                )
                for _ in range(4)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                await asyncio.to_thread(thread.join, 30)
            await asyncio.sleep(0.3)  # a watchdog tick or more after the last byte
        watchdog.check()
        grown = watchdog.peak_bytes - baseline
        assert all(o.startswith("closed") for o in outcomes), outcomes
        assert grown < 32 * MiB, f"the worker grew by {grown / MiB:.0f} MiB"
        log = await asyncio.to_thread(log_path.read_text, errors="replace")
        assert log.count(f"announced a frame of {announced} bytes") == 4, log[-3000:]

        # It keeps serving: a 12 MB prompt (4M token ids), two tokens back.
        client = TcpClient()
        request = PreprocessedRequest(
            model="echo", token_ids=[1000] * 4_000_000, stop_conditions=StopConditions(max_tokens=2)
        )
        try:
            async with asyncio.timeout(60):
                items = await collect(
                    client.stream(
                        instance.transport,
                        handler_path(instance.endpoint, instance.instance_id),
                        msgspec.msgpack.encode(request),
                        RequestContext(),
                    )
                )
        finally:
            await client.close()
        assert items and b"error" not in items[-1], items[-3:]
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=10)
