"""NATS-specific behaviour of the shared connection, the ``nats`` request plane and the ``nats``
event plane: start-up errors, a NATS server restarting under them, a worker process that
vanishes or freezes mid-stream, large items, silent clients and subject escaping. The contract
tests run on nats beside the other kinds in test_request_plane.py and event_plane/."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from tests.polling import eventually
from tests.servers.nats import NatsServerProcess, nats_binary
from tests.servers.process import require

from turnout.errors import (
    ConfigError,
    PeerUnavailable,
    RemoteError,
    RequestPlaneError,
    StreamBroken,
)
from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.event_plane import make_event_plane
from turnout.runtime.event_plane.nats import (
    MAX_CACHED_TOPICS,
    NatsEventPlane,
    subject_token,
    token_name,
)
from turnout.runtime.nats import NatsConnection, NatsOptions, NatsUnavailable, connect_nats
from turnout.runtime.request_plane.base import PeerState
from turnout.runtime.request_plane.framing import Frame, Kind
from turnout.runtime.request_plane.nats import NatsClient, NatsServer
from turnout.runtime.request_plane.nats import wire as rpn


@pytest.fixture(autouse=True)
def _needs_nats() -> None:
    require("nats-server", nats_binary() is not None)


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
    with NatsServerProcess(user="turnout", password="sk-turnout-test-right") as server:
        bad = f"nats://turnout:sk-turnout-test-wrong@{server.host}:{server.port}"
        with pytest.raises(ConfigError, match="cannot reach NATS") as info:
            await connect_nats(NatsOptions(servers=[bad], connect_timeout=2.0))
        assert "sk-turnout-test-wrong" not in str(info.value) and "***" in str(info.value)
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


async def test_a_frozen_worker_is_reported_silent_then_answering(
    conn: NatsConnection, nats_server: NatsServerProcess
) -> None:
    """SIGSTOP: its streams hear nothing past the deadline and it is reported ``SILENT`` (the
    stream still waits: the idle timeout decides that); SIGCONT: its heartbeats come back and
    it is reported ``ANSWERING``."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD_SERVER, nats_server.url, stdout=asyncio.subprocess.PIPE
    )
    client = NatsClient(conn, heartbeat_interval=0.05, idle_timeout=30.0, silence_deadline=0.2)
    heard: list[PeerState] = []
    client.add_peer_listener(lambda address, state: heard.append(state))
    try:
        assert child.stdout is not None
        async with asyncio.timeout(20):
            address = (await child.stdout.readline()).decode().strip()
        stream = client.stream(
            TransportAddress(kind="nats", address=address), "p", b"", RequestContext()
        )
        assert await anext(stream) == b"tick"
        child.send_signal(signal.SIGSTOP)
        await eventually(lambda: heard == [PeerState.SILENT], what="SILENT")
        child.send_signal(signal.SIGCONT)
        await eventually(lambda: heard == [PeerState.SILENT, PeerState.ANSWERING], what="ANSWERING")
        assert await anext(stream) == b"tick"  # the stream went on all along
        await stream.aclose()
    finally:
        if child.returncode is None:
            child.send_signal(signal.SIGCONT)
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


async def test_abort_fails_the_pending_next_and_cancels_the_handler(conn: NatsConnection) -> None:
    """What the endpoint client does to the streams of an instance that left discovery: the
    caller's pending ``__anext__`` raises the given error at once (not after idle_timeout,
    and never while the server's heartbeats keep a hung handler's stream alive), and the
    server, should it still be there, has its handler cancelled."""
    cancelled = asyncio.Event()

    async def hang(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        try:
            yield b"first"
            await asyncio.Event().wait()
        finally:
            if ctx.is_cancelled:
                cancelled.set()

    server = NatsServer(conn, heartbeat_interval=0.05)
    server.register("p", hang)
    client = NatsClient(conn, heartbeat_interval=0.05, idle_timeout=30.0)
    try:
        address = await server.start()
        stream = client.stream(address, "p", b"", RequestContext())
        assert await anext(stream) == b"first"
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.1)  # several heartbeats: the stream is alive and waiting
        assert not pending.done()
        gone = StreamBroken("instance left discovery")
        stream.abort(gone)
        async with asyncio.timeout(1):
            with pytest.raises(StreamBroken) as info:
                await pending
        assert info.value is gone
        stream.abort(StreamBroken("again"))  # a finished stream: no-op
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        async with asyncio.timeout(3):
            await cancelled.wait()
            while server._inflight:
                await asyncio.sleep(0.01)
        assert not client._inboxes
    finally:
        await client.close()
        await server.stop(drain_timeout=0)


async def test_first_use_while_nats_is_frozen_fails_fast_and_starts_over(
    own_nats: NatsServerProcess,
) -> None:
    """The client's first stream subscribes to its reply subjects: with NATS frozen that is
    PeerUnavailable within idle_timeout (not nats-py's 10 s flush error), and nothing is kept,
    so the next stream starts the client properly, idle monitor included."""
    c = await connect_nats(NatsOptions(servers=[own_nats.url]))
    server = NatsServer(c, heartbeat_interval=0.05)
    server.register("p", ticks)
    client = NatsClient(c, heartbeat_interval=0.05, idle_timeout=0.5)
    try:
        address = await server.start()
        subs = len(c.client._subs)
        own_nats.pause()
        started = time.monotonic()
        try:
            with pytest.raises(PeerUnavailable, match="not confirmed"):
                async with asyncio.timeout(3):
                    await anext(client.stream(address, "p", b"1", RequestContext()))
        finally:
            own_nats.resume()
        assert time.monotonic() - started < 2.0
        assert client._outbox is None and client._sub is None and client._monitor is None
        assert client._starting is None and len(c.client._subs) == subs

        # The connection survived the unanswered PING: the next stream starts the client.
        async with asyncio.timeout(5):
            got = await collect(client.stream(address, "p", b"2", RequestContext()))
        assert got == [b"0", b"1"]
        assert client._monitor is not None and not client._monitor.done()
        assert len(c.client._subs) == subs + 1
    finally:
        await client.close()
        await server.stop(drain_timeout=0)
        await c.close()


class _ClosedAsStartEnds(NatsClient):
    """Closes itself the moment its start-up ends, before the stream that started it resumes:
    the close task's first step is queued ahead of the start task's completion callbacks."""

    closing: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        await super()._start()
        self.closing = asyncio.get_running_loop().create_task(self.close())


async def test_close_while_the_first_stream_starts_the_client_fails_that_stream(
    conn: NatsConnection,
) -> None:
    """A client closed between its start-up finishing and the first stream resuming: the
    stream is PeerUnavailable at once (its inbox would otherwise be registered after the
    idle monitor was cancelled, and nothing would ever end it), and no outbox is left."""
    server = NatsServer(conn, heartbeat_interval=0.05)
    server.register("p", ticks)
    client = _ClosedAsStartEnds(conn, heartbeat_interval=0.05, idle_timeout=0.5)
    try:
        address = await server.start()
        with pytest.raises(PeerUnavailable, match="closed"):
            async with asyncio.timeout(3):
                await collect(client.stream(address, "p", b"3", RequestContext()))
        assert client.closing is not None
        async with asyncio.timeout(3):
            await client.closing
        assert not client._inboxes and client._outbox is None
    finally:
        await client.close()
        await server.stop(drain_timeout=0)


async def test_server_start_while_nats_is_frozen_is_a_clear_error(
    own_nats: NatsServerProcess,
) -> None:
    c = await connect_nats(NatsOptions(servers=[own_nats.url]))
    server = NatsServer(c, idle_timeout=0.5)
    server.register("p", ticks)
    client = NatsClient(c)
    try:
        subs = len(c.client._subs)
        own_nats.pause()
        started = time.monotonic()
        try:
            with pytest.raises(RequestPlaneError, match=r"cannot serve.*not confirmed"):
                async with asyncio.timeout(3):
                    await server.start()
        finally:
            own_nats.resume()
        assert time.monotonic() - started < 2.0
        assert server._outbox is None and server._sub is None and server._heartbeats is None
        assert len(c.client._subs) == subs
        async with asyncio.timeout(5):
            address = await server.start()
            assert await collect(client.stream(address, "p", b"1", RequestContext())) == [b"0"]
    finally:
        await client.close()
        await server.stop(drain_timeout=0)
        await c.close()


@pytest.mark.parametrize("lose", ["ack", "ack and data", "ack, slow handler"])
async def test_a_lost_ack_is_not_peer_unavailable(conn: NatsConnection, lose: str) -> None:
    """NATS may drop any message. Only the ACK lost: the frames after it prove delivery and
    the stream goes on. More lost: StreamBroken, since the request ran (PeerUnavailable would
    have it retried elsewhere as if it had not)."""
    ran = 0

    async def handler(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        nonlocal ran
        ran += 1
        if lose == "ack, slow handler":
            await asyncio.sleep(0.3)  # heartbeats come first
        yield b"a"
        yield b"b"

    server = NatsServer(conn, heartbeat_interval=0.05)
    server.register("p", handler)
    client = NatsClient(conn, heartbeat_interval=0.05, idle_timeout=2.0)
    deliver = client._on_frame
    dropped: list[int] = []

    def lossy(sid: int, inbox: Any, frame: Frame) -> None:
        kind = frame.kind
        targeted = kind == Kind.ACK or (lose == "ack and data" and kind == Kind.DATA)
        if targeted and kind not in dropped:
            dropped.append(kind)
            return
        deliver(sid, inbox, frame)

    client._on_frame = lossy  # type: ignore[method-assign]
    try:
        address = await server.start()
        stream = client.stream(address, "p", b"", RequestContext())
        async with asyncio.timeout(5):
            if lose == "ack and data":
                with pytest.raises(StreamBroken, match="lost"):
                    await collect(stream)
            else:
                assert await collect(stream) == [b"a", b"b"]
        assert Kind.ACK in dropped and ran == 1
    finally:
        await client.close()
        await server.stop(drain_timeout=0)


async def test_a_huge_error_message_is_truncated_to_fit(conn: NatsConnection) -> None:
    """A handler's exception text longer than a NATS message: the client gets RemoteError
    with the text cut, at once, not StreamBroken when its idle timeout runs out."""

    async def fail(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        yield b"ok"
        raise ValueError("é" * conn.max_payload)

    server = NatsServer(conn)
    server.register("p", fail)
    client = NatsClient(conn, idle_timeout=2.0)
    try:
        address = await server.start()
        stream = client.stream(address, "p", b"", RequestContext())
        started = time.monotonic()
        assert await anext(stream) == b"ok"
        with pytest.raises(RequestPlaneError) as info:
            await anext(stream)
        assert time.monotonic() - started < 1.0
        # Compared by hand: pytest cannot render a failed match against a 2 MiB message.
        text = str(info.value)
        assert isinstance(info.value, RemoteError), f"{type(info.value).__name__}: {text[:80]}"
        cut = text.startswith("ValueError: éé") and text.endswith("[truncated]")
        assert cut, f"{text[:40]} ... {text[-40:]}"
        assert len(text.encode()) < conn.max_payload
    finally:
        await client.close()
        await server.stop(drain_timeout=0)


def test_fit_text_cuts_on_a_character_boundary() -> None:
    assert rpn.fit_text("short", 100) == "short"
    cut = rpn.fit_text("€" * 100, 60)
    assert cut.endswith(rpn.TRUNCATED) and len(cut.encode()) <= 60
    assert set(cut.removesuffix(rpn.TRUNCATED)) == {"€"}


# --- event plane ---------------------------------------------------------------------------------


async def test_subscribe_while_nats_is_frozen_leaks_no_subscription(
    own_nats: NatsServerProcess,
) -> None:
    """A subscribe NATS does not confirm fails within subscribe_timeout with a turnout error
    and removes its subscription (which the client library would otherwise restore and
    feed after the next reconnect, with no one to close it)."""
    c = await connect_nats(NatsOptions(servers=[own_nats.url]))
    plane = NatsEventPlane(c, subscribe_timeout=0.5)
    try:
        subs = len(c.client._subs)
        own_nats.pause()
        started = time.monotonic()
        try:
            with pytest.raises(NatsUnavailable, match="not confirmed"):
                async with asyncio.timeout(3):
                    await plane.subscribe("ns", "comp", "load")
        finally:
            own_nats.resume()
        assert time.monotonic() - started < 2.0
        assert len(c.client._subs) == subs and not plane._subscriptions
        async with asyncio.timeout(5):
            pub = await plane.publisher("ns", "comp")
            sub = await plane.subscribe("ns", "comp", "load")
            pub.publish_nowait("load", b"after")
            assert (await anext(sub)).payload == b"after"
        await plane.close()
        assert len(c.client._subs) == subs
        await c.close()
        with pytest.raises(NatsUnavailable):
            await NatsEventPlane(c).subscribe("ns", "comp", "load")
    finally:
        await plane.close()
        await c.close()


async def test_wildcard_subscription_caches_a_bounded_number_of_topics(
    conn: NatsConnection,
) -> None:
    plane = make_event_plane("nats", None, nats=conn)
    try:
        pub = await plane.publisher("ns", "comp")
        sub = await plane.subscribe("ns", "comp", "")
        count = MAX_CACHED_TOPICS + 50
        for i in range(count):
            pub.publish_nowait(f"t.{i}", b"")  # escaped tokens: decoded, then cached
        async with asyncio.timeout(10):
            topics = [(await anext(sub)).topic for _ in range(count)]
        assert topics == [f"t.{i}" for i in range(count)]
        assert len(sub._topics) == MAX_CACHED_TOPICS  # type: ignore[attr-defined]
    finally:
        await plane.close()


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
        await asyncio.sleep(0.05)  # time under test: nothing more arrives for a while
        assert sub1.num_pending == 0 and sub2.num_pending == 0 and star.num_received == 0
    finally:
        await plane.close()
