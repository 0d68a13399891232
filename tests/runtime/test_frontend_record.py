"""A frontend's record under its lease, and what a worker checks at start against the store."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from tests.certs import TestCa
from tests.polling import eventually

import turnout
from turnout.errors import ConfigError
from turnout.protocols.frontend import (
    FRONTENDS_ROOT,
    MAX_HELD_BACK,
    FrontendRecord,
    HeldBackCard,
    HoldReason,
    frontend_key,
)
from turnout.protocols.model import EndpointId
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery import DiscoveryStore, FileStore, MemoryStore
from turnout.runtime.frontend_record import FrontendRegistration
from turnout.runtime.plane_tls import PlaneTls
from turnout.runtime.start_checks import check_advertised_addresses, check_frontend_planes

EID = EndpointId(namespace="ns", component="backend", name="generate")


async def read_records(store: DiscoveryStore) -> list[FrontendRecord]:
    kvs = await store.get_prefix(f"{FRONTENDS_ROOT}/")
    return [msgspec.json.decode(kv.value, type=FrontendRecord) for kv in kvs]


def held(n: int) -> list[HeldBackCard]:
    return [
        HeldBackCard(model="m", instance_id=f"{i:x}", checksum="c", reason=HoldReason.CARD_DIFFERS)
        for i in range(1, n + 1)
    ]


@pytest.fixture
async def runtime(store: DiscoveryStore) -> AsyncIterator[DistributedRuntime]:
    rt = await DistributedRuntime.create(store=store, request_plane="tcp", lease_ttl=0.9)
    yield rt
    await rt.shutdown()


async def test_frontend_record_follows_what_it_holds_back(runtime: DistributedRuntime) -> None:
    holding: list[HeldBackCard] = []
    changed = asyncio.Event()
    reg = FrontendRegistration(
        runtime,
        http_address="http://127.0.0.1:8000",
        router_mode="kv",
        namespace=None,
        held_back=lambda: list(holding),
        changed=changed,
        min_interval=0.0,
    )
    await reg.start()
    try:
        (record,) = await read_records(runtime.store)
        assert record.frontend_id == reg.frontend_id and record.key() == frontend_key(
            reg.frontend_id
        )
        assert (record.host, record.pid, record.version) == (
            "127.0.0.1",
            os.getpid(),
            turnout.__version__,
        )
        assert (record.http_address, record.router_mode, record.held_back) == (
            "http://127.0.0.1:8000", "kv", []
        )  # fmt: skip
        assert record.planes() == f"tcp/{runtime.event_plane.kind}"
        kv = await runtime.store.get(record.key())
        assert kv is not None and kv.lease_id == reg.frontend_id

        holding[:] = held(MAX_HELD_BACK + 3)
        changed.set()

        async def written() -> FrontendRecord:
            (record,) = await read_records(runtime.store)
            return record

        async with asyncio.timeout(5):
            while (await written()).held_back_total != MAX_HELD_BACK + 3:
                await asyncio.sleep(0.01)
        record = await written()
        assert record.held_back == holding[:MAX_HELD_BACK]  # bounded, the total said
    finally:
        await reg.stop()
    assert await read_records(runtime.store) == []


async def test_frontend_record_comes_back_under_a_new_lease() -> None:
    store = MemoryStore()
    rt = await DistributedRuntime.create(store=store, request_plane="tcp", lease_ttl=0.3)
    reg = FrontendRegistration(
        rt, http_address="http://h:1", router_mode="round-robin", namespace="team",
        held_back=list, changed=asyncio.Event(), min_interval=0.0,
    )  # fmt: skip
    await reg.start()
    try:
        first = reg.frontend_id
        await store.revoke_lease(first)  # the store ended it (an outage past the TTL)
        await eventually(lambda: reg.frontend_id != first and reg.record is not None, timeout=5)
        (record,) = await read_records(store)
        assert record.frontend_id == reg.frontend_id != first and record.namespace == "team"
    finally:
        await reg.stop()
        await rt.shutdown()
        await store.close()


# -- the worker's start checks ------------------------------------------------------------------


async def put_frontend(
    store: DiscoveryStore,
    frontend_id: int,
    planes: tuple[str, str],
    namespace: str | None = None,
) -> None:
    record = FrontendRecord(
        frontend_id=frontend_id, host="10.0.0.1", pid=77,
        request_plane=planes[0], event_plane=planes[1], namespace=namespace,
    )  # fmt: skip
    await store.put(frontend_key(frontend_id), msgspec.json.encode(record))


async def test_worker_with_no_frontend_on_its_planes_stops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Frontends on other planes would each refuse the worker: it stops with one error; with
    one frontend on its planes it serves that one and warns of the others; none: no check."""
    store = FileStore(tmp_path / "s.sqlite")
    rt = await DistributedRuntime.create(store=store, request_plane="tcp", lease_ttl=2.0)
    try:
        await check_frontend_planes(rt)  # no frontend yet: nothing to say
        await put_frontend(store, 0xAB, ("nats", "nats"))
        await store.put(frontend_key(0xAC), b"{not json")  # skipped, never fatal
        with pytest.raises(ConfigError) as err:
            await check_frontend_planes(rt)
        assert str(err.value) == (
            "this worker runs request plane tcp, event plane zmq, and no frontend does "
            "(frontend ab at 10.0.0.1:77 runs nats/nats): each would refuse it; every process "
            "must use the same planes (--request-plane, --event-plane)"
        )
        await put_frontend(store, 0xAD, ("tcp", "zmq"))
        caplog.clear()
        await check_frontend_planes(rt)
        (line,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert line.levelno == logging.WARNING and "frontend ab at 10.0.0.1:77" in line.getMessage()
    finally:
        await rt.shutdown()
        await store.close()


async def test_frontends_of_other_namespaces_do_not_stop_the_worker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A frontend with ``--namespace`` watches only that namespace: on other planes, it would
    never see this worker, so it neither stops it nor is warned about; a global one is."""
    store = FileStore(tmp_path / "s.sqlite")
    rt = await DistributedRuntime.create(store=store, request_plane="tcp", lease_ttl=2.0)
    try:
        await rt.endpoint(EID).serve(echo)
        await put_frontend(store, 0xAB, ("nats", "nats"), namespace=EID.namespace + "-other")
        caplog.clear()
        await check_frontend_planes(rt)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        await put_frontend(store, 0xAC, ("nats", "nats"), namespace="global")
        with pytest.raises(ConfigError, match=r"frontend ac at 10\.0\.0\.1:77 runs nats/nats"):
            await check_frontend_planes(rt)
    finally:
        await rt.shutdown()
        await store.close()


async def echo(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield payload


@pytest.mark.parametrize(
    ("advertise", "reachable"), [(None, True), ("127.0.0.2", False), ("192.0.2.1", False)]
)
async def test_advertised_address_that_does_not_reach_the_worker_is_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, advertise: str | None, reachable: bool
) -> None:
    """Bound to 127.0.0.1 and advertising 127.0.0.2 (nothing listens there) or TEST-NET
    192.0.2.1 (routes nowhere): the request plane and the event publisher are named in one
    warning that points at --advertise-host and --bind-host."""
    store = FileStore(tmp_path / "s.sqlite")
    rt = await DistributedRuntime.create(
        store=store, request_plane="tcp", advertise_host=advertise, lease_ttl=2.0
    )
    try:
        await rt.endpoint(EID).serve(echo)
        publisher = await rt.event_plane.publisher("ns", "backend")
        caplog.clear()
        failed = await check_advertised_addresses(rt, dial_timeout=0.3)
        await publisher.close()
    finally:
        await rt.shutdown()
        await store.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if reachable:
        assert failed == [] and warnings == []
        return
    assert len(failed) == 2
    assert failed[0].startswith(f"tcp request plane {advertise}:")
    assert failed[1].startswith(f"zmq event publisher {advertise}:")
    (warning,) = warnings
    assert "--advertise-host" in warning and "--bind-host" in warning
    assert all(f in warning for f in failed)


async def test_advertised_address_check_with_plane_tls_is_quiet(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With plane TLS the request plane is dialled with a handshake, as a peer would: the
    server logs no refused handshake, and a certificate that does not name the advertised
    host would be the reason given."""
    leaf = TestCa(tmp_path).issue("worker")
    store = FileStore(tmp_path / "s.sqlite")
    rt = await DistributedRuntime.create(
        store=store, request_plane="tcp", lease_ttl=2.0,
        plane_tls=PlaneTls(leaf.ca, leaf.cert, leaf.key),
    )  # fmt: skip
    try:
        await rt.endpoint(EID).serve(echo)
        caplog.clear()
        assert await check_advertised_addresses(rt, dial_timeout=2.0) == []
    finally:
        await rt.shutdown()
        await store.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
