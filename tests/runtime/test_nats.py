"""NATS-specific behaviour of the shared connection, the ``nats`` request plane and the ``nats``
event plane: start-up errors, a NATS server restarting under them, a worker process that
vanishes or freezes mid-stream, large items, silent clients and subject escaping. The contract
tests run on nats beside the other kinds in test_request_plane.py and event_plane/."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from tests.servers.nats import NatsServerProcess, nats_binary

from turnout.errors import ConfigError, PeerUnavailable, RequestPlaneError, StreamBroken
from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.event_plane import make_event_plane
from turnout.runtime.event_plane.nats import subject_token, token_name
from turnout.runtime.nats import NatsConnection, NatsOptions, connect_nats
from turnout.runtime.request_plane.nats import NatsClient, NatsServer

pytestmark = pytest.mark.skipif(nats_binary() is None, reason="nats-server is not installed")


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServerProcess]:
    """A nats-server shared by the tests that do not disrupt it."""
    with NatsServerProcess() as server:
        yield server


@pytest.fixture
def own_nats() -> Iterator[NatsServerProcess]:
    """A nats-server for one test, which may stop, restart or pause it."""
    with NatsServerProcess() as server:
        yield server


@pytest.fixture
async def conn(nats_server: NatsServerProcess) -> AsyncIterator[NatsConnection]:
    c = await connect_nats(NatsOptions(servers=[nats_server.url]))
    yield c
    await c.close()


async def ticks(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    for i in range(int(payload or b"3")):
        yield str(i).encode()


# --- the connection ------------------------------------------------------------------------------


async def test_unreachable_nats_is_a_quick_config_error() -> None:
    with NatsServerProcess() as server:
        url = server.plain_url
    started = time.monotonic()
    with pytest.raises(
        ConfigError, match=rf"cannot reach NATS at \['{url}'\]: ConnectionRefusedError"
    ):
        await connect_nats(NatsOptions(servers=[url], connect_timeout=5.0))
    assert time.monotonic() - started < 2.0  # one refused connect, not the 5 s budget


async def test_nats_on_another_loopback_address() -> None:
    with NatsServerProcess(host="127.0.0.5") as server:
        c = await connect_nats(NatsOptions(servers=[server.url], name="turnout-test"))
        srv = NatsServer(c)
        srv.register("p", ticks)
        client = NatsClient(c)
        try:
            address = await srv.start()
            assert address.address.startswith("turnout.rp.")
            assert await collect(client.stream(address, "p", b"1", RequestContext())) == [b"0"]
        finally:
            await client.close()
            await srv.stop(drain_timeout=0)
            await c.close()


async def test_wrong_password_is_a_config_error_without_the_password() -> None:
    with NatsServerProcess(user="turnout", password="right") as server:
        bad = f"nats://turnout:wrong@{server.host}:{server.port}"
        with pytest.raises(ConfigError, match="cannot reach NATS") as info:
            await connect_nats(NatsOptions(servers=[bad], connect_timeout=2.0))
        assert "wrong" not in str(info.value) and "***" in str(info.value)
        good = await connect_nats(NatsOptions(servers=[server.url]))
        assert good.is_connected
        await good.close()
        await good.close()  # idempotent


async def test_paused_nats_at_start_times_out_as_config_error() -> None:
    with NatsServerProcess() as server:
        server.pause()
        started = time.monotonic()
        with pytest.raises(ConfigError, match="cannot reach NATS"):
            await connect_nats(NatsOptions(servers=[server.url], connect_timeout=0.5))
        assert time.monotonic() - started < 3.0
        server.resume()


# --- request plane -------------------------------------------------------------------------------


async def collect(stream: AsyncIterator[bytes]) -> list[bytes]:
    return [item async for item in stream]


async def test_nats_restart_requests_and_events_work_again(
    own_nats: NatsServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    c = await connect_nats(NatsOptions(servers=[own_nats.url]))
    server = NatsServer(c)
    server.register("p", ticks)
    client = NatsClient(c, heartbeat_interval=0.05, idle_timeout=0.5)
    plane = make_event_plane("nats", None, nats=c)
    try:
        address = await server.start()
        pub = await plane.publisher("ns", "comp")
        sub = await plane.subscribe("ns", "comp", "load")
        assert await collect(client.stream(address, "p", b"2", RequestContext())) == [b"0", b"1"]

        # Same port: the connection reconnects and re-subscribes. A request sent in the
        # moment before the client notices is lost: PeerUnavailable after idle_timeout.
        own_nats.restart()
        async with asyncio.timeout(10):
            while True:
                try:
                    got = await collect(client.stream(address, "p", b"3", RequestContext()))
                    break
                except (PeerUnavailable, StreamBroken):
                    await asyncio.sleep(0.05)
        assert got == [b"0", b"1", b"2"]
        async with asyncio.timeout(10):
            while True:
                pub.publish_nowait("load", b"after")
                try:
                    async with asyncio.timeout(0.1):
                        assert (await anext(sub)).payload == b"after"
                        break
                except TimeoutError:
                    continue
        messages = [r.getMessage() for r in caplog.records]
        assert sum("lost the NATS server" in m for m in messages) == 1
        assert sum("reconnected to NATS" in m for m in messages) == 1
    finally:
        await plane.close()
        await client.close()
        await server.stop(drain_timeout=0)
        await c.close()


CHILD_SERVER = """
import asyncio, sys
from turnout.runtime.nats import NatsOptions, connect_nats
from turnout.runtime.request_plane.nats import NatsServer

async def endless(payload, ctx):
    while True:
        yield b"tick"
        await asyncio.sleep(0.01)

async def main():
    conn = await connect_nats(NatsOptions(servers=[sys.argv[1]]))
    server = NatsServer(conn, heartbeat_interval=0.05)
    server.register("p", endless)
    print((await server.start()).address, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


@pytest.mark.parametrize("how", ["kill", "freeze"])
async def test_worker_vanishing_mid_stream_is_stream_broken(
    conn: NatsConnection, nats_server: NatsServerProcess, how: str
) -> None:
    """Killed: NATS drops its subscription and answers the next credit with no-responders.
    Frozen (SIGSTOP): the connection stays, only the missing heartbeats tell."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD_SERVER, nats_server.url, stdout=asyncio.subprocess.PIPE
    )
    client = NatsClient(conn, heartbeat_interval=0.05, idle_timeout=0.4)
    try:
        assert child.stdout is not None
        async with asyncio.timeout(20):
            address = (await child.stdout.readline()).decode().strip()
        stream = client.stream(
            TransportAddress(kind="nats", address=address), "p", b"", RequestContext()
        )
        assert await anext(stream) == b"tick"
        if how == "kill":
            child.kill()
        else:
            child.send_signal(19)  # SIGSTOP
        started = time.monotonic()
        with pytest.raises(StreamBroken, match=address):
            async with asyncio.timeout(5):
                while True:
                    await anext(stream)
        assert time.monotonic() - started < 3.0  # idle_timeout 0.4 s, with room for a slow CI
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
        await client.close()


async def test_silent_client_gets_its_handler_cancelled(nats_server: NatsServerProcess) -> None:
    server_conn = await connect_nats(NatsOptions(servers=[nats_server.url]))
    client_conn = await connect_nats(NatsOptions(servers=[nats_server.url]))
    server = NatsServer(server_conn, heartbeat_interval=0.05, idle_timeout=0.3)
    cancelled = asyncio.Event()

    async def endless(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"x"
                await asyncio.sleep(0.01)
        finally:
            if ctx.is_cancelled:
                cancelled.set()

    server.register("p", endless)
    client = NatsClient(client_conn, heartbeat_interval=10.0, idle_timeout=10.0)
    try:
        address = await server.start()
        stream = client.stream(address, "p", b"", RequestContext())
        assert await anext(stream) == b"x"
        await client_conn.close()  # the client process is gone without a CANCEL
        async with asyncio.timeout(3):
            await cancelled.wait()
            while server._inflight:
                await asyncio.sleep(0.01)
    finally:
        await client.close()
        await server.stop(drain_timeout=0)
        await server_conn.close()


async def test_items_larger_than_a_nats_message_are_chunked(conn: NatsConnection) -> None:
    big = bytes(range(256)) * (3 * 4096 + 7)  # about 3 MiB, NATS takes 1 MiB per message
    exact = b"e" * (conn.max_payload - 512)

    async def mixed(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        yield b"small"
        yield big
        yield b"between"
        yield exact
        yield big
        yield b"last"

    server = NatsServer(conn)
    server.register("p", mixed)
    client = NatsClient(conn)
    try:
        address = await server.start()
        got = await collect(client.stream(address, "p", b"", RequestContext()))
        assert got == [b"small", big, b"between", exact, big, b"last"]
        with pytest.raises(RequestPlaneError, match="exceeds what one NATS message"):
            await collect(client.stream(address, "p", big, RequestContext()))
    finally:
        await client.close()
        await server.stop(drain_timeout=0)


async def test_back_pressure_bounds_what_the_client_holds(conn: NatsConnection) -> None:
    """A stalled consumer: the handler stops WINDOW items ahead, the client holds at most that."""
    produced = 0

    async def endless(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        nonlocal produced
        while True:
            produced += 1
            yield b"y" * 1000

    server = NatsServer(conn, heartbeat_interval=0.05)
    server.register("p", endless)
    client = NatsClient(conn, heartbeat_interval=0.05)
    try:
        address = await server.start()
        stream = client.stream(address, "p", b"", RequestContext())
        await anext(stream)
        await asyncio.sleep(0.3)  # several heartbeats and credit repeats: still bounded
        held = sum(len(inbox.items) for inbox in client._inboxes.values())
        assert produced <= 64 + 2 and held <= 64
        for _ in range(500):
            await anext(stream)
        assert produced >= 500
        await stream.aclose()
    finally:
        await client.close()
        await server.stop(drain_timeout=0)


async def test_bad_address_is_peer_unavailable(conn: NatsConnection) -> None:
    client = NatsClient(conn)
    try:
        with pytest.raises(PeerUnavailable, match="bad nats address"):
            await collect(
                client.stream(
                    TransportAddress(kind="nats", address="x.y"), "p", b"", RequestContext()
                )
            )
    finally:
        await client.close()


# --- event plane ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a.b", "*", ">", "a b", "~7e", "ü-ns", "plain_name-1"])
def test_subject_tokens_are_single_safe_tokens(name: str) -> None:
    token = subject_token(name)
    assert not set(token) & set(".*> \t\r\n")
    assert token_name(token) == name


async def test_names_with_subject_syntax_do_not_cross(conn: NatsConnection) -> None:
    """``a.b``/``c`` and ``a``/``b.c`` would be one subject unescaped; ``*`` a wildcard."""
    plane = make_event_plane("nats", None, nats=conn)
    try:
        pub1 = await plane.publisher("a.b", "c")
        pub2 = await plane.publisher("a", "b.c")
        sub1 = await plane.subscribe("a.b", "c", "")
        sub2 = await plane.subscribe("a", "b.c", "t.x")
        star = await plane.subscribe("*", "*", "")
        pub1.publish_nowait("t.x", b"1")
        pub2.publish_nowait("t.x", b"2")
        pub2.publish_nowait("t>", b"3")
        async with asyncio.timeout(5):
            assert tuple(await anext(sub1)) == ("t.x", b"1")
            assert tuple(await anext(sub2)) == ("t.x", b"2")
        await asyncio.sleep(0.05)
        assert sub1.num_pending == 0 and sub2.num_pending == 0 and star.num_received == 0
    finally:
        await plane.close()
