"""The ``nats`` request plane's batch messages: the frames of several streams of one client in
one message, and both ends meeting a peer that knows nothing of batches (a client that does not
ask for them, a server that ignores the ask), driven through raw NATS as those peers would be."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from nats.aio.msg import Msg
from tests.servers.nats import NatsServerProcess, nats_binary
from tests.servers.process import require

from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.nats import NatsConnection, NatsOptions, connect_nats
from turnout.runtime.request_plane.framing import Frame, Kind
from turnout.runtime.request_plane.nats import NatsClient, NatsServer
from turnout.runtime.request_plane.nats import wire as rpn


@pytest.fixture(autouse=True)
def _needs_nats() -> None:
    require("nats-server", nats_binary() is not None)


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServerProcess]:
    with NatsServerProcess() as server:
        yield server


@pytest.fixture
async def conn(nats_server: NatsServerProcess) -> AsyncIterator[NatsConnection]:
    c = await connect_nats(NatsOptions(servers=[nats_server.url]))
    yield c
    await c.close()


async def steps(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    """``int(payload)`` items, one per event-loop iteration (as an engine yields tokens)."""
    for i in range(int(payload)):
        yield str(i).encode()
        await asyncio.sleep(0)


async def collect(stream: AsyncIterator[bytes]) -> list[bytes]:
    return [item async for item in stream]


def test_pack_batch_reads_back_as_frames_at_every_header_size() -> None:
    for n in (1, 15, 16, 70000):
        frames = [Frame(Kind.DATA, i + 1, b"x", num=i + 1) for i in range(n)]
        packed = rpn.pack_batch([rpn.encode_frame(f) for f in frames])
        assert rpn.decode_batch(packed) == frames


async def test_streams_to_one_client_share_messages(conn: NatsConnection) -> None:
    """Sixteen streams producing in step reach the client in far fewer messages than
    frames, every item of every stream in order."""
    server = NatsServer(conn)
    server.register("p", steps)
    client = NatsClient(conn)
    messages = {"batch": 0, "single": 0}
    on_msg = client._on_msg

    async def counted(msg: Msg) -> None:
        batch = msg.subject.endswith(f".{rpn.BATCH_SID}")
        messages["batch" if batch else "single"] += 1
        await on_msg(msg)

    client._on_msg = counted  # type: ignore[method-assign]  # before the subscription is made
    try:
        address = await server.start()
        async with asyncio.timeout(10):
            results = await asyncio.gather(
                *(collect(client.stream(address, "p", b"50", RequestContext())) for _ in range(16))
            )
        assert results == [[str(i).encode() for i in range(50)]] * 16
        # 16 x (ACK + 50 items + END) frames; in step, they share messages.
        assert messages["single"] == 0
        assert 0 < messages["batch"] < 16 * 52 / 4
    finally:
        await client.close()
        await server.stop(drain_timeout=0)


async def test_a_client_that_does_not_ask_gets_a_message_per_frame(conn: NatsConnection) -> None:
    """A client that knows nothing of batches (its REQUEST's ``num`` is 0) is answered on its
    stream's own subject, one frame a message, each decodable on its own."""
    server = NatsServer(conn)
    server.register("p", steps)
    reply = conn.client.new_inbox() + ".7"
    frames: asyncio.Queue[Frame] = asyncio.Queue(maxsize=100)

    async def on_reply(msg: Msg) -> None:
        frames.put_nowait(rpn.decode_frame(msg.data))

    sub = await conn.client.subscribe(reply, cb=on_reply)
    try:
        address = await server.start()
        request = Frame(Kind.REQUEST, 0, b"3", "p", 0, "old-client")
        await conn.client.publish(address.address, rpn.encode_frame(request), reply=reply)
        got: list[Frame] = []
        async with asyncio.timeout(5):
            while not got or got[-1].kind != Kind.END:
                got.append(await frames.get())
        items = [f.data for f in got if f.kind == Kind.DATA]
        assert b"".join(i if isinstance(i, bytes) else b"".join(i) for i in items) == b"012"
        assert [f.num for f in got] == list(range(1, len(got) + 1))
        assert all(f.stream_id == 0 for f in got)
    finally:
        await sub.unsubscribe()
        await server.stop(drain_timeout=0)


async def test_a_server_that_ignores_the_ask_is_read_as_well(conn: NatsConnection) -> None:
    """A server that knows nothing of batches answers one message per frame on the stream's
    subject, whatever the REQUEST's ``num`` says: the client reads that stream to its end."""
    subject = rpn.SERVER_PREFIX + "old-server"
    seen: list[int] = []

    async def old_server(msg: Msg) -> None:
        frame = rpn.decode_frame(msg.data)
        if frame.kind != Kind.REQUEST:
            return
        seen.append(frame.num)
        answers = [Frame(Kind.ACK, 0, num=1), Frame(Kind.DATA, 0, b"a", num=2),
                   Frame(Kind.DATA, 0, [b"b", b"c"], num=3), Frame(Kind.END, 0, num=4)]  # fmt: skip
        for answer in answers:
            await conn.client.publish(msg.reply, rpn.encode_frame(answer))

    sub = await conn.client.subscribe(subject, cb=old_server)
    client = NatsClient(conn)
    try:
        address = TransportAddress(kind="nats", address=subject)
        async with asyncio.timeout(5):
            assert await collect(client.stream(address, "p", b"", RequestContext())) == [
                b"a",
                b"b",
                b"c",
            ]
        assert seen == [rpn.TAKES_BATCHES]
    finally:
        await client.close()
        await sub.unsubscribe()
