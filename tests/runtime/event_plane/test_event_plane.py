"""The event plane contract, run against every implementation (``local``, ``zmq``, ``nats``)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from tests.servers.nats import NatsServerProcess, nats_binary
from tests.servers.process import require

from turnout.errors import ConfigError
from turnout.protocols.kv import (
    KV_EVENTS_TOPIC,
    LOAD_TOPIC,
    AllBlocksCleared,
    BlockStored,
    KvCacheEvent,
    KvEventBatch,
    LoadReport,
    StoredBlock,
)
from turnout.runtime.discovery.file import FileStore
from turnout.runtime.discovery.memory import MemoryStore
from turnout.runtime.event_plane import (
    Event,
    EventPlane,
    EventPublisher,
    EventSubscription,
    encode_msg,
    make_event_plane,
)
from turnout.runtime.event_plane.zmq import ZmqEventPlane, ZmqEventPublisher, publishers_key
from turnout.runtime.nats import NatsConnection, NatsOptions, connect_nats

PROBE = b"\x00probe"
FENCE = b"\x00fence"
_fence_ids = itertools.count()


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    s = MemoryStore()
    yield s
    await s.close()


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServerProcess]:
    """One nats-server for the module's contract tests (they never disrupt it)."""
    require("nats-server", nats_binary() is not None)
    with NatsServerProcess() as server:
        yield server


@pytest.fixture(params=["local", "zmq", "nats"])
async def planes(
    request: pytest.FixtureRequest, store: MemoryStore
) -> AsyncIterator[tuple[EventPlane, EventPlane]]:
    """(publishing plane, subscribing plane): one bus for ``local``; for ``zmq`` two planes
    (two ZeroMQ contexts, as in two processes) sharing the discovery store; for ``nats`` two
    planes on two connections to one nats-server."""
    kind: str = request.param
    conns: list[NatsConnection] = []
    if kind == "local":
        plane = make_event_plane("local", store)
        made = [plane, plane]
    elif kind == "zmq":
        made = [make_event_plane("zmq", store), make_event_plane("zmq", store)]
    else:
        server: NatsServerProcess = request.getfixturevalue("nats_server")
        for _ in range(2):
            conns.append(await connect_nats(NatsOptions(servers=[server.url])))
        made = [make_event_plane("nats", None, nats=conn) for conn in conns]
    yield made[0], made[1]
    for plane in made:
        await plane.close()
    for conn in conns:
        await conn.close()
    # Nothing left behind: no task (watch, reader, lease keep-alive) and no registration.
    current = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    assert left == [], left
    assert await store.get_prefix("v1/event_publishers/") == []


async def join(pub: EventPublisher, sub: EventSubscription, topic: str) -> None:
    """Wait until ``sub`` receives what ``pub`` publishes (ZeroMQ's slow joiner), then leave
    ``sub`` with nothing pending: probe until one arrives, then drain up to a fresh fence.
    Earlier probes and fences (of other joins) may be drained on the way."""
    fence = FENCE + next(_fence_ids).to_bytes(4, "little")
    async with asyncio.timeout(10):
        while True:
            await pub.publish(topic, PROBE)
            try:
                async with asyncio.timeout(0.05):
                    event = await anext(sub)
                    break
            except TimeoutError:
                continue
        await pub.publish(topic, fence)
        while event.payload != fence:
            assert event.payload.startswith(b"\x00"), event
            event = await anext(sub)
    assert sub.num_pending == 0


async def eventually(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not predicate():
            await asyncio.sleep(0.005)


async def collect_until(sub: EventSubscription, last: Callable[[Event], bool]) -> list[Event]:
    """Every event up to and including the first for which ``last`` is true."""
    out: list[Event] = []
    async with asyncio.timeout(10):
        async for event in sub:
            out.append(event)
            if last(event):
                return out
    raise AssertionError(f"subscription ended after {out}")


async def test_round_trip_typed(planes: tuple[EventPlane, EventPlane]) -> None:
    pub_plane, sub_plane = planes
    pub = await pub_plane.publisher("dyn", "backend")
    sub = await sub_plane.subscribe("dyn", "backend", KV_EVENTS_TOPIC)
    await join(pub, sub, KV_EVENTS_TOPIC)

    sent = KvCacheEvent(
        worker_id=7,
        event_id=1,
        data=BlockStored(parent_hash=None, blocks=[StoredBlock(11, 12, 16)], lora_name="a"),
    )
    await pub.publish_msg(KV_EVENTS_TOPIC, sent)
    await pub.publish_msg(
        KV_EVENTS_TOPIC, KvCacheEvent(worker_id=7, event_id=2, data=AllBlocksCleared())
    )
    typed = sub.messages(KvCacheEvent)
    async with asyncio.timeout(10):
        assert await anext(typed) == sent
        second = await anext(typed)
    assert isinstance(second.data, AllBlocksCleared) and second.event_id == 2
    assert pub.num_published >= 2


async def test_per_publisher_fifo_1000(planes: tuple[EventPlane, EventPlane]) -> None:
    pub_plane, sub_plane = planes
    pub = await pub_plane.publisher("dyn", "backend")
    sub = await sub_plane.subscribe("dyn", "backend", LOAD_TOPIC)
    await join(pub, sub, LOAD_TOPIC)
    for i in range(1000):
        await pub.publish(LOAD_TOPIC, i.to_bytes(4, "little"))
    events = await collect_until(sub, lambda e: e.payload == (999).to_bytes(4, "little"))
    assert [int.from_bytes(e.payload, "little") for e in events] == list(range(1000))
    assert sub.num_dropped == 0


async def test_two_publishers_one_subscriber(planes: tuple[EventPlane, EventPlane]) -> None:
    pub_plane, sub_plane = planes
    pubs = [await pub_plane.publisher("dyn", "backend") for _ in range(2)]
    sub = await sub_plane.subscribe("dyn", "backend", LOAD_TOPIC)
    for pub in pubs:
        await join(pub, sub, LOAD_TOPIC)
    n = 200
    for i in range(n):
        for k, pub in enumerate(pubs):
            await pub.publish(LOAD_TOPIC, encode_msg(LoadReport(worker_id=k, num_running=i)))
    seen: dict[int, list[int]] = {0: [], 1: []}
    async with asyncio.timeout(10):
        async for report in sub.messages(LoadReport):
            seen[report.worker_id].append(report.num_running)
            if sum(map(len, seen.values())) == 2 * n:
                break
    # No order between publishers, FIFO within each.
    assert seen == {0: list(range(n)), 1: list(range(n))}


async def test_topic_filtering_is_exact(planes: tuple[EventPlane, EventPlane]) -> None:
    pub_plane, sub_plane = planes
    pub = await pub_plane.publisher("dyn", "backend")
    # "kv" is a byte prefix of "kv_events": ZeroMQ alone would deliver both to it.
    s_kv = await sub_plane.subscribe("dyn", "backend", "kv")
    s_kve = await sub_plane.subscribe("dyn", "backend", "kv_events")
    s_all = await sub_plane.subscribe("dyn", "backend", "")
    other = await sub_plane.subscribe("dyn", "prefill", "kv")  # another component
    await join(pub, s_kv, "kv")
    await join(pub, s_kve, "kv_events")
    await join(pub, s_all, "load")  # last: drains the probes the first two left in s_all

    sent = [("kv_events", b"1"), ("kv", b"2"), ("load", b"3"), ("kv_events", b"4")]
    for topic, payload in sent:
        await pub.publish(topic, payload)
    for topic in ("kv", "kv_events", "load"):
        await pub.publish(topic, b"end")

    def end_of(topic: str) -> Callable[[Event], bool]:
        return lambda e: e.topic == topic and e.payload == b"end"

    assert await collect_until(s_kv, end_of("kv")) == [("kv", b"2"), ("kv", b"end")]
    assert await collect_until(s_kve, end_of("kv_events")) == [
        ("kv_events", b"1"),
        ("kv_events", b"4"),
        ("kv_events", b"end"),
    ]
    got_all = await collect_until(s_all, end_of("load"))
    assert got_all == [*sent, ("kv", b"end"), ("kv_events", b"end"), ("load", b"end")]
    assert other.num_received == 0
    with pytest.raises(ValueError, match="topic"):
        await pub.publish("", b"x")


async def test_slow_subscriber_drops_are_bounded_and_counted(
    planes: tuple[EventPlane, EventPlane], caplog: pytest.LogCaptureFixture
) -> None:
    pub_plane, sub_plane = planes
    pub = await pub_plane.publisher("dyn", "backend")
    sub = await sub_plane.subscribe("dyn", "backend", LOAD_TOPIC, max_pending=10)
    await join(pub, sub, LOAD_TOPIC)
    base = sub.num_received
    caplog.set_level(logging.WARNING, logger="turnout.runtime.event_plane")

    for i in range(100):  # nobody reads meanwhile
        await pub.publish(LOAD_TOPIC, bytes([i]))
    await eventually(lambda: sub.num_received >= base + 100)
    assert sub.num_pending == 10
    assert sub.num_dropped == 90
    slow = [r for r in caplog.records if "is slow" in r.getMessage()]
    assert len(slow) == 1  # reported once, not 90 times

    # What stays is the oldest (the new ones were dropped): a prefix, then a gap.
    got = [(await anext(sub)).payload[0] for _ in range(10)]
    assert got == list(range(10))
    caught_up = [r for r in caplog.records if "caught up" in r.getMessage()]
    assert len(caught_up) == 1 and "90" in caught_up[0].getMessage()

    # Drained: the next message is delivered again, and nothing more was dropped.
    await pub.publish(LOAD_TOPIC, b"\xff")
    async with asyncio.timeout(10):
        assert (await anext(sub)).payload == b"\xff"
    assert sub.num_dropped == 90


async def test_close_ends_iteration_and_rejects_use(planes: tuple[EventPlane, EventPlane]) -> None:
    pub_plane, sub_plane = planes
    pub = await pub_plane.publisher("dyn", "backend")
    sub = await sub_plane.subscribe("dyn", "backend", LOAD_TOPIC)
    waiting = asyncio.create_task(anext(sub))
    await asyncio.sleep(0.01)
    await sub.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(waiting, 5)
    await sub.close()  # idempotent
    await pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        await pub.publish(LOAD_TOPIC, b"x")

    # Closing the plane closes what is still open; a pending read ends.
    sub2 = await sub_plane.subscribe("dyn", "backend", LOAD_TOPIC)
    waiting = asyncio.create_task(anext(sub2))
    await asyncio.sleep(0.01)
    await sub_plane.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(waiting, 5)
    with pytest.raises(RuntimeError, match="closed"):
        await sub_plane.subscribe("dyn", "backend", LOAD_TOPIC)


async def test_undecodable_payload_is_skipped_and_counted(
    planes: tuple[EventPlane, EventPlane],
) -> None:
    pub_plane, sub_plane = planes
    pub = await pub_plane.publisher("dyn", "backend")
    sub = await sub_plane.subscribe("dyn", "backend", LOAD_TOPIC)
    await join(pub, sub, LOAD_TOPIC)
    typed = sub.messages(LoadReport)
    await pub.publish(LOAD_TOPIC, b"\xc1 not msgpack")
    await pub.publish(LOAD_TOPIC, encode_msg(KvEventBatch(events=[])))  # wrong type
    await pub.publish_msg(LOAD_TOPIC, LoadReport(worker_id=3))
    async with asyncio.timeout(10):
        assert (await anext(typed)).worker_id == 3
    assert typed.num_invalid == 2


@pytest.mark.parametrize("bad", ["", "a/b"])
async def test_bad_names_are_config_errors(planes: tuple[EventPlane, EventPlane], bad: str) -> None:
    pub_plane, sub_plane = planes
    with pytest.raises(ConfigError, match="no '/'"):
        await pub_plane.publisher(bad, "backend")
    with pytest.raises(ConfigError, match="no '/'"):
        await sub_plane.subscribe("dyn", bad, LOAD_TOPIC)


def test_make_event_plane_rejects_unknown_kind() -> None:
    with pytest.raises(ConfigError, match=r"'carrier-pigeon'.*local, zmq, nats"):
        make_event_plane("carrier-pigeon", None)
    with pytest.raises(ConfigError, match="discovery store"):
        make_event_plane("zmq", None)
    with pytest.raises(ConfigError, match="NATS connection"):
        make_event_plane("nats", None)


# --- zmq only: discovery-driven connections ----------------------------------------------------


async def test_zmq_publisher_registers_and_revoked_lease_disconnects(store: MemoryStore) -> None:
    async with ZmqEventPlane(store) as pub_plane, ZmqEventPlane(store, lease_ttl=0.6) as sub_plane:
        pub = await pub_plane.publisher("dyn", "backend")
        assert isinstance(pub, ZmqEventPublisher) and pub.lease is not None
        kv = await store.get(publishers_key("dyn", "backend", pub.publisher_id))
        assert kv is not None and kv.lease_id == pub.lease.id
        assert pub.address.startswith("tcp://127.0.0.1:")

        sub = await sub_plane.subscribe("dyn", "backend", LOAD_TOPIC)
        async with asyncio.timeout(10):
            await sub.wait_num_publishers(1)
        assert sub.publisher_addresses == {pub.address}
        await join(pub, sub, LOAD_TOPIC)

        # The lease ends under the publisher (as when its process dies): its record vanishes
        # and the subscriber disconnects; what the publisher still sends no longer arrives.
        await store.revoke_lease(pub.lease.id)
        async with asyncio.timeout(10):
            await sub.wait_num_publishers(0)
        assert sub.publisher_addresses == frozenset()
        await pub.publish(LOAD_TOPIC, b"after")
        await asyncio.sleep(0.1)  # time under test: nothing arrives for a while
        assert sub.num_pending == 0

        # A later publisher is picked up by the same subscription.
        pub2 = await pub_plane.publisher("dyn", "backend")
        async with asyncio.timeout(10):
            await sub.wait_num_publishers(1)
        assert sub.publisher_addresses == {pub2.address}
        await join(pub2, sub, LOAD_TOPIC)
        assert sub.num_pending == 0

        await pub2.close()  # a clean close withdraws the record at once
        async with asyncio.timeout(10):
            await sub.wait_num_publishers(0)


async def test_zmq_publisher_re_registers_after_losing_its_lease(store: MemoryStore) -> None:
    async with ZmqEventPlane(store, lease_ttl=0.3) as plane:
        pub = await plane.publisher("dyn", "backend")
        assert pub.lease is not None
        first_lease = pub.lease.id
        sub = await plane.subscribe("dyn", "backend", LOAD_TOPIC)
        await store.revoke_lease(first_lease)
        # The keep-alive (every ttl/3) notices, then the publisher registers again.
        await eventually(
            lambda: (
                pub.lease is not None and pub.lease.id != first_lease and sub.num_publishers == 1
            )
        )
        await join(pub, sub, LOAD_TOPIC)


async def test_zmq_over_file_store_between_two_store_clients(tmp_path: Path) -> None:
    """Two store objects on one file, as two processes on one machine would have."""
    path = tmp_path / "discovery.db"
    pub_store, sub_store = FileStore(path), FileStore(path)
    try:
        async with ZmqEventPlane(pub_store) as pub_plane, ZmqEventPlane(sub_store) as sub_plane:
            pub = await pub_plane.publisher("dyn", "backend")
            sub = await sub_plane.subscribe("dyn", "backend", KV_EVENTS_TOPIC)
            await join(pub, sub, KV_EVENTS_TOPIC)
            event = KvCacheEvent(worker_id=1, event_id=5, data=AllBlocksCleared())
            await pub.publish_msg(KV_EVENTS_TOPIC, event)
            async with asyncio.timeout(10):
                assert await anext(sub.messages(KvCacheEvent)) == event
            await pub.close()
            async with asyncio.timeout(10):
                await sub.wait_num_publishers(0)
        assert await sub_store.get_prefix("v1/event_publishers/") == []
    finally:
        await pub_store.close()
        await sub_store.close()


async def test_zmq_plane_close_releases_everything(store: MemoryStore) -> None:
    plane = ZmqEventPlane(store)
    pubs = [await plane.publisher("dyn", "backend") for _ in range(3)]
    subs = [await plane.subscribe("dyn", "backend", t) for t in ("a", "b")]
    await plane.close()
    await plane.close()
    assert plane._ctx.closed
    assert all(p._sock.closed for p in pubs) and all(s._sock.closed for s in subs)
    assert await store.get_prefix("v1/event_publishers/") == []
    current = asyncio.current_task()
    assert [t for t in asyncio.all_tasks() if t is not current] == []


async def test_zmq_bad_host_is_a_config_error(store: MemoryStore) -> None:
    async with ZmqEventPlane(store, host="256.1.1.1") as plane:
        with pytest.raises(ConfigError, match="cannot bind"):
            await plane.publisher("dyn", "backend")
    assert await store.get_prefix("v1/event_publishers/") == []


async def test_zmq_plane_closes_cleanly_after_its_store(store: MemoryStore) -> None:
    """A process shutting down in the wrong order still leaves no task or socket behind."""
    plane = ZmqEventPlane(store)
    pub = await plane.publisher("dyn", "backend")
    sub = await plane.subscribe("dyn", "backend", LOAD_TOPIC)
    await join(pub, sub, LOAD_TOPIC)
    await store.close()
    await plane.close()
    assert plane._ctx.closed and pub._sock.closed and sub._sock.closed
    current = asyncio.current_task()
    assert [t for t in asyncio.all_tasks() if t is not current] == []
