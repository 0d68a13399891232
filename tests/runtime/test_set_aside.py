"""Instances that do not answer are set aside until a probe finds them answering, probed less
often each time they fail again (a worker killed with SIGKILL stays aside while its record
lasts); a tcp peer that does not speak the request plane is told apart at once, not after the
idle timeout; and a worker frozen with its connection open is set aside as soon as it falls
silent.

Real servers and sockets: a memory store, the tcp request plane, instances announced at a
closed port, at a server that echoes what it hears and at one that never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest
from tests.frontend.fake_clock import FakeClock

from turnout.errors import PeerUnavailable
from turnout.frontend.service import free_port
from turnout.protocols.model import EndpointId, Instance, TransportAddress
from turnout.runtime import endpoint_client
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery import MemoryStore
from turnout.runtime.endpoint_client import EndpointClient
from turnout.runtime.request_plane.base import PeerState
from turnout.runtime.request_plane.tcp import TcpClient, TcpServer
from turnout.runtime.request_plane.tcp.client import HANDSHAKE_TIMEOUT
from turnout.runtime.serving import handler_path

EID = EndpointId(namespace="ns", component="backend", name="generate")
GHOST = 0xABC
BASE = 0.3


async def echo(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield payload


@pytest.fixture
async def runtime(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[DistributedRuntime]:
    monkeypatch.setattr(endpoint_client, "DOWN_RETRY_SECONDS", BASE)
    store = MemoryStore()
    rt = await DistributedRuntime.create(store=store, request_plane="tcp", lease_ttl=5.0)
    yield rt
    await rt.shutdown()
    await store.close()


async def announce(runtime: DistributedRuntime, address: str) -> None:
    ghost = Instance(
        endpoint=EID, instance_id=GHOST, transport=TransportAddress(kind="tcp", address=address)
    )
    await runtime.store.put(ghost.key(), msgspec.json.encode(ghost))


async def until(predicate: Callable[[], bool], within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        while not predicate():
            await asyncio.sleep(0.005)


def manual_clock(client: EndpointClient) -> FakeClock:
    """Time ``client``'s set-asides by a clock the test advances."""
    clock = FakeClock()
    client.call_later = clock.call_later
    return clock


def next_probe_in(clock: FakeClock) -> float:
    """Seconds until the one pending set-aside timer fires."""
    assert clock.pending == 1, clock.timers
    return next(t.when for t in clock.timers if not t.cancelled) - clock.time


async def probe(client: EndpointClient, clock: FakeClock, instance_id: int) -> bool:
    """Advance ``clock`` to the next probe of ``instance_id``, let the probe finish; whether
    the instance is back in service."""
    clock.advance(next_probe_in(clock))
    await until(lambda: not isinstance(client._down.get(instance_id), asyncio.Task))
    return instance_id in client.instance_ids()


async def fail_once(client: EndpointClient, instance_id: int) -> None:
    """A stream to ``instance_id`` that cannot reach it: set aside."""
    await until(lambda: instance_id in client.instance_ids())
    with pytest.raises(PeerUnavailable):
        await anext(client.stream(instance_id, b"x", RequestContext()))
    assert instance_id not in client.instance_ids()


async def test_an_unreachable_instance_stays_aside_until_it_answers(
    runtime: DistributedRuntime,
) -> None:
    """Nothing listens at the ghost's address: each probe fails and it stays aside, probed
    twice as late each time; once a server answers there, the next probe brings it back."""
    port = free_port()
    await announce(runtime, f"127.0.0.1:{port}")
    client = await runtime.endpoint(EID).client()
    clock = manual_clock(client)
    await fail_once(client, GHOST)
    for delay in (BASE, 2 * BASE, 4 * BASE, 8 * BASE):
        assert next_probe_in(clock) == pytest.approx(delay)
        assert not await probe(client, clock, GHOST)
        assert GHOST not in client.instance_ids()
    server = TcpServer(port=port)  # a live server there, with no handler of the ghost's
    await server.start()
    try:
        assert next_probe_in(clock) == pytest.approx(16 * BASE)
        assert await probe(client, clock, GHOST)
        assert clock.pending == 0
    finally:
        await client.close()
        await server.stop()


async def test_an_answer_or_a_new_address_starts_afresh(runtime: DistributedRuntime) -> None:
    served = await runtime.endpoint(EID).serve(echo)
    client = await runtime.endpoint(EID).client()
    clock = manual_clock(client)
    # An instance that answered after being set aside is set aside for the base time again.
    client.report_instance_down(served.instance_id)
    assert next_probe_in(clock) == pytest.approx(BASE)
    assert await probe(client, clock, served.instance_id)
    client.report_instance_down(served.instance_id)
    assert next_probe_in(clock) == pytest.approx(BASE)
    assert await probe(client, clock, served.instance_id)

    # A ghost that failed twice, announced at a new address: a fresh start there too.
    await announce(runtime, f"127.0.0.1:{free_port()}")
    await fail_once(client, GHOST)
    assert not await probe(client, clock, GHOST)
    assert next_probe_in(clock) == pytest.approx(2 * BASE)
    await announce(runtime, f"127.0.0.1:{free_port()}")
    await fail_once(client, GHOST)
    assert next_probe_in(clock) == pytest.approx(BASE)
    await client.close()
    await served.stop()


async def test_a_silent_peer_with_no_instance_here_is_not_recorded(
    runtime: DistributedRuntime,
) -> None:
    """The request plane reports every peer it talks to; the client records as silent only
    addresses of its own instances (so unrelated peers do not pile up), and an instance
    announced later at an address reported silent before is set aside for the base time."""
    client = await runtime.endpoint(EID).client()
    clock = manual_clock(client)
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    for port in range(1000, 1100):
        other = TransportAddress(kind="tcp", address=f"127.0.0.2:{port}")
        client.peer_state(other, PeerState.SILENT)
    client.peer_state(TransportAddress(kind="tcp", address=address), PeerState.SILENT)
    assert not client._silent
    await announce(runtime, address)
    await fail_once(client, GHOST)
    assert next_probe_in(clock) == pytest.approx(BASE)
    await client.close()


WORKER_SERVER = """
import asyncio, sys
from turnout.runtime.request_plane import TcpServer

async def echo(payload, ctx):
    yield payload

async def main():
    server = TcpServer()
    server.register(sys.argv[1], echo)
    address = await server.start()
    print(address.address, flush=True)
    await asyncio.get_running_loop().create_future()

asyncio.run(main())
"""


async def test_a_killed_worker_is_never_listed_again_while_its_record_stays(
    runtime: DistributedRuntime,
) -> None:
    """A worker process killed with SIGKILL keeps its record until its lease runs out: once a
    request found it gone, it stays out of ``instance_ids()`` (routing and ``/health``) probe
    after probe, however long the record stays, while a live instance keeps serving."""
    live = await runtime.endpoint(EID).serve(echo)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WORKER_SERVER, handler_path(EID, GHOST),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            address = (await proc.stdout.readline()).decode().strip()
        await announce(runtime, address)
        client = await runtime.endpoint(EID).client()
        clock = manual_clock(client)
        await until(lambda: GHOST in client.instance_ids())
        assert [x async for x in client.stream(GHOST, b"hi", RequestContext())] == [b"hi"]

        proc.kill()
        await proc.wait()
        with pytest.raises(PeerUnavailable):
            async with asyncio.timeout(10):
                await anext(client.stream(GHOST, b"x", RequestContext()))
        for _ in range(5):
            assert list(client.instance_ids()) == [live.instance_id]
            assert not await probe(client, clock, GHOST)
        assert list(client.instance_ids()) == [live.instance_id]
        assert GHOST in client.announced_ids()
        got = [x async for x in client.stream(live.instance_id, b"ok", RequestContext())]
        assert got == [b"ok"]
        await client.close()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        await live.stop()


Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _echo_bytes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while await reader.read(65536):
        pass


@pytest.mark.parametrize(
    ("behave", "within", "why"),
    [
        (_echo_bytes, 1.0, "which no server sends"),
        (_silent, HANDSHAKE_TIMEOUT + 1.0, "no answer within"),
    ],
    ids=["echoes", "silent"],
)
async def test_a_peer_that_does_not_speak_the_plane_is_unavailable(
    behave: Behaviour, within: float, why: str
) -> None:
    """Its request fails as ``PeerUnavailable`` (nothing was delivered: try another
    instance) well before the idle timeout, with the reason."""
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(ConnectionError):
            await behave(reader, writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = TcpClient()
    try:
        started = time.monotonic()
        stream = client.stream(
            TransportAddress(kind="tcp", address=f"127.0.0.1:{port}"),
            "ns/x",
            b"hello",
            RequestContext(),
        )
        with pytest.raises(PeerUnavailable, match=why):
            async with asyncio.timeout(within + 5):
                await anext(stream)
        assert time.monotonic() - started < within
    finally:
        await client.close()
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


FROZEN_SERVER = """
import asyncio, sys
from turnout.runtime.request_plane import TcpServer

async def hang(payload, ctx):
    yield b"first"
    await asyncio.get_running_loop().create_future()

async def main():
    server = TcpServer(heartbeat_interval=0.05)
    server.register(sys.argv[1], hang)
    address = await server.start()
    print(address.address, flush=True)
    await asyncio.get_running_loop().create_future()

asyncio.run(main())
"""


async def test_a_frozen_worker_is_set_aside_at_once_and_back_when_it_answers(
    runtime: DistributedRuntime,
) -> None:
    """A worker process stopped with SIGSTOP keeps its TCP connection and its record; its
    silence on the request plane sets it aside within the silence deadline (new requests and
    migrations go elsewhere) while a live instance keeps serving, and it is back as soon as
    its connection answers again, not after the set-aside's retry delay."""
    runtime.use_request_plane_client(TcpClient(heartbeat_interval=0.05, silence_deadline=0.3))
    live = await runtime.endpoint(EID).serve(echo)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FROZEN_SERVER, handler_path(EID, GHOST),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stream = None
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            address = (await proc.stdout.readline()).decode().strip()
        await announce(runtime, address)
        client = await runtime.endpoint(EID).client()
        await until(lambda: list(client.instance_ids()) == sorted([live.instance_id, GHOST]))
        stream = client.stream(GHOST, b"", RequestContext("on-the-frozen-one"))
        assert await anext(stream) == b"first"

        proc.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        await until(lambda: GHOST not in client.instance_ids())
        assert time.monotonic() - frozen_at < 5.0  # the deadline is 0.3 s; the idle timeout 10 s
        assert list(client.instance_ids()) == [live.instance_id]
        got = [x async for x in client.stream(live.instance_id, b"hi", RequestContext())]
        assert got == [b"hi"]

        proc.send_signal(signal.SIGCONT)
        resumed_at = time.monotonic()
        await until(lambda: GHOST in client.instance_ids())
        assert time.monotonic() - resumed_at < endpoint_client.DOWN_RETRY_SECONDS
        await client.close()
    finally:
        if stream is not None:
            await stream.aclose()  # type: ignore[attr-defined]
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        await proc.wait()
        await live.stop()
