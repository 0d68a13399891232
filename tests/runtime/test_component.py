"""The component layer: serving instances under leases, and clients that track and call them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from turnout.errors import ConfigError, PeerUnavailable, StreamBroken
from turnout.protocols.model import EndpointId, Instance, TransportAddress, instance_key, mdc_key
from turnout.runtime import endpoint_client
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery import DiscoveryStore, FileStore, MemoryStore
from turnout.runtime.endpoint_client import EndpointClient

EID = EndpointId(namespace="ns", component="backend", name="generate")


async def echo(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    for part in payload.split(b" "):
        yield part


async def changed(client: EndpointClient, predicate, timeout: float = 3.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.fixture(params=["local", "tcp"])
async def runtime(request: pytest.FixtureRequest) -> AsyncIterator[DistributedRuntime]:
    store = MemoryStore()
    rt = await DistributedRuntime.create(store=store, request_plane=request.param, lease_ttl=1.0)
    yield rt
    await rt.shutdown()
    await store.close()


async def test_serve_then_client_sees_and_calls_instance(runtime: DistributedRuntime) -> None:
    card = b'{"display_name": "m"}'
    served = await runtime.endpoint(EID).serve(
        echo, records=lambda iid: [(mdc_key(EID, iid), card)]
    )
    kv = await runtime.store.get(instance_key(EID, served.instance_id))
    assert kv is not None and kv.lease_id == served.lease.id == served.instance_id
    assert msgspec.json.decode(kv.value, type=Instance) == served.instance
    mdc = await runtime.store.get(mdc_key(EID, served.instance_id))
    assert mdc is not None and mdc.value == card and mdc.lease_id == served.lease.id

    client = await runtime.endpoint(EID).client()
    assert list(client.instance_ids()) == [served.instance_id]  # holds the initial set on return
    assert client.get_instance(served.instance_id) == served.instance
    items = [x async for x in client.stream(served.instance_id, b"a b c", RequestContext())]
    assert items == [b"a", b"b", b"c"]


async def test_instance_stop_drops_it_from_clients(runtime: DistributedRuntime) -> None:
    client = await runtime.endpoint(EID).client()
    calls: list[list[int]] = []
    client.add_listener(lambda: calls.append(list(client.instance_ids())))
    first = await runtime.endpoint(EID).serve(echo)
    second = await runtime.endpoint(EID).serve(echo)
    await client.wait_for_instances(2, timeout=2)
    assert list(client.instance_ids()) == sorted([first.instance_id, second.instance_id])
    await first.stop()
    await changed(client, lambda: list(client.instance_ids()) == [second.instance_id])
    assert await runtime.store.get(instance_key(EID, first.instance_id)) is None
    assert calls[-1] == [second.instance_id]
    with pytest.raises(PeerUnavailable):
        await anext(client.stream(first.instance_id, b"x", RequestContext()))


async def test_stop_drains_in_flight_stream(runtime: DistributedRuntime) -> None:
    release = asyncio.Event()

    async def slow(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        yield b"1"
        await release.wait()
        yield b"2"

    served = await runtime.endpoint(EID).serve(slow)
    client = await runtime.endpoint(EID).client()
    stream = client.stream(served.instance_id, b"", RequestContext())
    assert await anext(stream) == b"1"
    stopping = asyncio.create_task(served.stop(drain_timeout=5))
    await changed(client, lambda: list(client.instance_ids()) == [])  # records go first
    release.set()
    assert [x async for x in stream] == [b"2"]
    await stopping


async def test_stop_cancels_stragglers_after_drain_timeout(runtime: DistributedRuntime) -> None:
    async def stuck(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        yield b"1"
        await asyncio.sleep(60)

    served = await runtime.endpoint(EID).serve(stuck)
    client = await runtime.endpoint(EID).client()
    stream = client.stream(served.instance_id, b"", RequestContext())
    assert await anext(stream) == b"1"
    await served.stop(drain_timeout=0.05)
    with pytest.raises(StreamBroken):
        await anext(stream)


async def test_report_instance_down_sets_aside_until_retry(
    runtime: DistributedRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(endpoint_client, "DOWN_RETRY_SECONDS", 0.2)
    served = await runtime.endpoint(EID).serve(echo)
    client = await runtime.endpoint(EID).client()
    calls: list[list[int]] = []
    client.add_listener(lambda: calls.append(list(client.instance_ids())))
    client.report_instance_down(served.instance_id)
    assert list(client.instance_ids()) == []
    assert client.get_instance(served.instance_id) is not None  # still known, just set aside
    await changed(client, lambda: list(client.instance_ids()) == [served.instance_id])
    assert calls == [[], [served.instance_id]]


async def test_rediscovery_restores_instance_set_aside(runtime: DistributedRuntime) -> None:
    served = await runtime.endpoint(EID).serve(echo)
    client = await runtime.endpoint(EID).client()
    client.report_instance_down(served.instance_id)
    assert list(client.instance_ids()) == []
    key = instance_key(EID, served.instance_id)
    await runtime.store.put(key, msgspec.json.encode(served.instance), lease_id=served.lease.id)
    await changed(client, lambda: list(client.instance_ids()) == [served.instance_id])


async def test_unreachable_instance_is_reported_down(runtime: DistributedRuntime) -> None:
    ghost = Instance(
        endpoint=EID,
        instance_id=0xABC,
        transport=TransportAddress(kind=runtime.request_plane, address="127.0.0.1:1"),
    )
    if runtime.request_plane == "local":
        ghost = Instance(
            endpoint=EID, instance_id=0xABC, transport=TransportAddress(kind="local", address="x")
        )
    await runtime.store.put(ghost.key(), msgspec.json.encode(ghost))
    client = await runtime.endpoint(EID).client()
    assert list(client.instance_ids()) == [0xABC]
    with pytest.raises(PeerUnavailable):
        await anext(client.stream(0xABC, b"", RequestContext()))
    assert list(client.instance_ids()) == []


async def test_malformed_instance_record_is_logged_and_skipped(
    runtime: DistributedRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    await runtime.store.put(f"v1/instances/{EID.path()}/ff", b"{not json")
    await runtime.store.put(f"v1/instances/{EID.path()}/zz", b"{}")
    with caplog.at_level(logging.WARNING, logger="turnout.runtime"):
        client = await runtime.endpoint(EID).client()
        served = await runtime.endpoint(EID).serve(echo)
        await client.wait_for_instances(1, timeout=2)
    assert list(client.instance_ids()) == [served.instance_id]
    assert "malformed instance record" in caplog.text
    assert "not an instance id" in caplog.text


async def test_wait_for_instances_times_out_with_a_clear_message(
    runtime: DistributedRuntime,
) -> None:
    client = await runtime.endpoint(EID).client()
    await runtime.endpoint(EID).serve(echo)
    with pytest.raises(TimeoutError, match=r"3 instance\(s\) of ns/backend/generate, saw 1"):
        await client.wait_for_instances(3, timeout=0.2)


async def test_many_instances_in_one_process(runtime: DistributedRuntime) -> None:
    client = await runtime.endpoint(EID).client()
    served = [await runtime.endpoint(EID).serve(echo) for _ in range(64)]
    await client.wait_for_instances(64, timeout=3)
    assert list(client.instance_ids()) == sorted(s.instance_id for s in served)
    results = await asyncio.gather(
        *(collect(client.stream(s.instance_id, b"p q", RequestContext())) for s in served)
    )
    assert results == [[b"p", b"q"]] * 64


async def collect(stream: AsyncIterator[bytes]) -> list[bytes]:
    return [x async for x in stream]


async def test_two_runtimes_over_a_file_store(tmp_path: Path) -> None:
    """A worker runtime and a frontend runtime, each with its own store handle, as two
    processes would be."""
    worker_store = FileStore(tmp_path / "d.sqlite", poll_interval=0.02)
    frontend_store = FileStore(tmp_path / "d.sqlite", poll_interval=0.02)
    worker = await DistributedRuntime.create(store=worker_store, lease_ttl=1.0)
    frontend = await DistributedRuntime.create(store=frontend_store, lease_ttl=1.0)
    try:
        client = await frontend.endpoint(EID).client()
        served = await worker.endpoint(EID).serve(echo)
        await client.wait_for_instances(1, timeout=3)
        assert [
            x async for x in client.stream(served.instance_id, b"hi there", RequestContext())
        ] == [
            b"hi",
            b"there",
        ]
        await worker.shutdown()
        await changed(client, lambda: list(client.instance_ids()) == [])
    finally:
        await frontend.shutdown()
        await worker.shutdown()
        await frontend_store.close()
        await worker_store.close()


async def test_store_kinds_run_the_same(store: DiscoveryStore) -> None:
    rt = await DistributedRuntime.create(store=store, request_plane="local", lease_ttl=1.0)
    try:
        served = await rt.endpoint(EID).serve(echo)
        client = await rt.endpoint(EID).client()
        await client.wait_for_instances(1, timeout=3)
        assert list(client.instance_ids()) == [served.instance_id]
    finally:
        await rt.shutdown()


@pytest.mark.parametrize(
    ("store_kind", "asked", "expected"),
    [
        ("memory", None, "LocalEventPlane"),
        ("file", None, "ZmqEventPlane"),
        ("file", "local", "LocalEventPlane"),
    ],
)
async def test_event_plane_follows_the_store(
    tmp_path: Path, store_kind: str, asked: str | None, expected: str
) -> None:
    store = MemoryStore() if store_kind == "memory" else FileStore(tmp_path / "d.sqlite")
    rt = await DistributedRuntime.create(store=store, event_plane=asked)
    try:
        assert type(rt.event_plane).__name__ == expected
    finally:
        await rt.shutdown()
        await store.close()


async def test_unknown_planes_are_config_errors() -> None:
    store = MemoryStore()
    with pytest.raises(ConfigError, match="request plane"):
        await DistributedRuntime.create(store=store, request_plane="smoke-signals")
    with pytest.raises(ConfigError, match="event plane"):
        await DistributedRuntime.create(store=store, event_plane="smoke-signals")


async def test_lost_lease_registers_again_under_a_new_id(runtime: DistributedRuntime) -> None:
    """A lease ended behind the process's back (store outage past the TTL, or revoked
    elsewhere) is not fatal: the instance comes back under a new id with its records and
    side handlers, and clients reach it there."""

    async def side(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        yield b"side:" + payload

    served = await runtime.endpoint(EID).serve(
        echo, records=lambda iid: [(mdc_key(EID, iid), f"card {iid:x}".encode())]
    )
    served.add_handler("side", side)
    client = await runtime.endpoint(EID).client()
    old = served.instance_id
    assert list(client.instance_ids()) == [old]

    await runtime.store.revoke_lease(old)  # what an expiry looks like to every watcher
    async with asyncio.timeout(5):
        await served.reregistered.wait()
    new = served.instance_id
    assert new != old
    await changed(client, lambda: list(client.instance_ids()) == [new])
    mdc = await runtime.store.get(mdc_key(EID, new))
    assert mdc is not None and mdc.value == f"card {new:x}".encode()
    assert await runtime.store.get(mdc_key(EID, old)) is None
    items = [x async for x in client.stream(new, b"still here", RequestContext())]
    assert items == [b"still", b"here"]
    side_items = [x async for x in client.call(new, "side", b"x", RequestContext())]
    assert side_items == [b"side:x"]
    await served.stop()
    await changed(client, lambda: list(client.instance_ids()) == [])


async def test_streams_of_an_instance_that_left_discovery_break(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hung or cut-off worker never closes its connection; once its lease has ended (and
    the grace a draining worker gets has passed) with nothing left at its address, its open
    streams fail as broken (migratable) instead of waiting forever."""
    monkeypatch.setattr(endpoint_client, "LEFT_STREAM_GRACE_SECONDS", 0.05)
    store = MemoryStore()
    rt = await DistributedRuntime.create(store=store, request_plane="tcp", lease_ttl=1.0)
    started = asyncio.Event()

    async def hang(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        yield b"first"
        started.set()
        await asyncio.Event().wait()

    try:
        served = await rt.endpoint(EID).serve(hang)
        assert served._guard is not None
        served._guard.cancel()  # a hung process: it will not register again
        client = await rt.endpoint(EID).client()
        stream = client.stream(served.instance_id, b"", RequestContext())
        assert await anext(stream) == b"first"
        await started.wait()
        await store.revoke_lease(served.instance_id)
        async with asyncio.timeout(3):
            with pytest.raises(StreamBroken, match="left discovery"):
                await anext(stream)
        assert not client._open and not client._open_transport
    finally:
        await rt.shutdown()
        await store.close()


async def test_streams_survive_their_worker_registering_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker whose lease was lost (a store outage) registers again under a new id and
    goes on serving its streams: the old id leaving discovery must not break them."""
    # Longer than the worker takes to notice (a keep-alive every TTL/3) and register again.
    monkeypatch.setattr(endpoint_client, "LEFT_STREAM_GRACE_SECONDS", 1.0)
    store = MemoryStore()
    rt = await DistributedRuntime.create(store=store, request_plane="tcp", lease_ttl=1.0)
    release = asyncio.Event()

    async def slow(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        yield b"first"
        await release.wait()
        yield b"second"

    try:
        served = await rt.endpoint(EID).serve(slow)
        client = await rt.endpoint(EID).client()
        old = served.instance_id
        stream = client.stream(old, b"", RequestContext())
        assert await anext(stream) == b"first"
        await store.revoke_lease(old)
        async with asyncio.timeout(5):
            await served.reregistered.wait()
        await changed(client, lambda: list(client.instance_ids()) == [served.instance_id])
        await asyncio.sleep(1.2)  # past the grace
        release.set()
        assert await anext(stream) == b"second"
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        # And the old id still answers, for frontends that have not seen the new one yet.
        assert client.get_instance(old) is None
    finally:
        await rt.shutdown()
        await store.close()
