"""Instance records say who serves them: host, pid, version and planes, on every plane set."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator

import msgspec
import pytest
from tests.servers.nats import NatsServerProcess, nats_binary
from tests.servers.process import require

import turnout
from turnout.protocols.model import EndpointId, Instance, ProcessIdentity, instance_key
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery import DiscoveryStore, MemoryStore
from turnout.runtime.nats import NatsOptions, connect_nats

EID = EndpointId(namespace="ns", component="backend", name="generate")


async def echo(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield payload


async def served_record(runtime: DistributedRuntime) -> Instance:
    served = await runtime.endpoint(EID).serve(echo)
    kv = await runtime.store.get(instance_key(EID, served.instance_id))
    assert kv is not None
    return msgspec.json.decode(kv.value, type=Instance)


async def test_instance_record_names_host_pid_version_and_planes(store: DiscoveryStore) -> None:
    event_plane = "local" if store.kind == "memory" else "zmq"
    rt = await DistributedRuntime.create(store=store, request_plane="tcp", lease_ttl=2.0)
    try:
        record = await served_record(rt)
    finally:
        await rt.shutdown()
    assert (record.host, record.pid, record.version) == (
        "127.0.0.1",
        os.getpid(),
        turnout.__version__,
    )
    assert (record.request_plane, record.event_plane) == ("tcp", event_plane)
    assert record.where() == f"127.0.0.1:{os.getpid()}" and record.planes() == f"tcp/{event_plane}"


async def test_advertised_host_is_the_record_host() -> None:
    store = MemoryStore()
    rt = await DistributedRuntime.create(
        store=store, request_plane="tcp", advertise_host="localhost", lease_ttl=2.0
    )
    try:
        record = await served_record(rt)
    finally:
        await rt.shutdown()
        await store.close()
    assert record.host == "localhost" and record.transport.address.startswith("localhost:")


async def test_nats_instance_record_names_host_and_pid() -> None:
    """On NATS the address is a subject: host and pid come from the record's own fields."""
    require("nats-server", nats_binary() is not None)
    with NatsServerProcess() as server:
        store = MemoryStore()
        nats = await connect_nats(NatsOptions(servers=[server.url]))
        rt = await DistributedRuntime.create(
            store=store, request_plane="nats", event_plane="nats", nats=nats, lease_ttl=2.0
        )
        try:
            record = await served_record(rt)
        finally:
            await rt.shutdown()
            await store.close()
    assert record.transport.kind == "nats" and "127.0.0.1" not in record.transport.address
    # Bound to loopback, which nothing dials on NATS: the machine's name says where it runs.
    assert (record.host, record.pid) == (socket.gethostname(), os.getpid())
    assert record.planes() == "nats/nats"


def test_a_record_without_identity_fields_still_decodes() -> None:
    """Records of processes that predate the fields read as unknown, and are never held
    against their planes."""
    old = (
        b'{"endpoint":{"namespace":"ns","component":"backend","name":"generate"},'
        b'"instance_id":26,"transport":{"kind":"tcp","address":"10.0.0.5:4000"}}'
    )
    record = msgspec.json.decode(old, type=Instance)
    assert (record.host, record.pid, record.version) == ("", 0, "")
    assert record.where() == "?:?" and record.planes() == "?/?"
    assert not record.runs_other_planes("nats", "nats")


@pytest.mark.parametrize(
    ("request_plane", "event_plane", "other"),
    [("tcp", "zmq", False), ("nats", "zmq", True), ("tcp", "nats", True), ("", "zmq", False)],
)
def test_runs_other_planes(request_plane: str, event_plane: str, other: bool) -> None:
    record = msgspec.json.decode(
        msgspec.json.encode({"request_plane": request_plane, "event_plane": event_plane}),
        type=ProcessIdentity,
    )
    assert record.runs_other_planes("tcp", "zmq") is other
