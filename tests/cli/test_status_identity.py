"""``turnout status`` shows who runs where: host, pid, version and planes of every instance,
the frontends, and what each frontend holds back, on the file store and on etcd.

In-process: a real worker runtime serving an instance, a real ``turnout frontend``
(``RegisteredFrontend``) on an ephemeral port, and one instance record written as a worker on
the NATS planes writes it, which the frontend refuses.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tests.servers.etcd import EtcdServer, etcd_binary
from tests.servers.process import require

import turnout
from turnout.cli.frontend import RegisteredFrontend
from turnout.cli.status import gather_status, render
from turnout.frontend.service import FrontendConfig, free_port
from turnout.protocols.model import (
    EndpointId,
    Instance,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
    TransportAddress,
    instance_key,
    mdc_key,
)
from turnout.runtime.context import RequestContext
from turnout.runtime.lease import Lease
from turnout.runtime.planes import PlanesConfig, open_runtime

EID = EndpointId(namespace="team", component="backend", name="generate")
REFUSED_ID = 0x1A2B


def card(instance_id: int) -> bytes:
    return msgspec.json.encode(
        ModelDeploymentCard(
            display_name="mock",
            endpoint=EID,
            instance_id=instance_id,
            model_type=ModelType.Chat,
            model_input=ModelInput.Text,
        )
    )


async def echo(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield payload


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    require("etcd", etcd_binary() is not None)
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data").start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(params=["file", "etcd"])
def planes(request: pytest.FixtureRequest, tmp_path: Path) -> PlanesConfig:
    if request.param == "file":
        return PlanesConfig(store="file", store_path=str(tmp_path / "s.sqlite"), lease_ttl=3.0)
    server: EtcdServer = request.getfixturevalue("etcd")
    asyncio.run(server.wipe())
    return PlanesConfig(store="etcd", store_options={"endpoints": server.endpoints}, lease_ttl=3.0)


async def test_status_shows_frontends_held_back_and_who_runs_each_instance(
    planes: PlanesConfig,
) -> None:
    worker = await open_runtime(planes)
    frontend = RegisteredFrontend(
        FrontendConfig(port=free_port(), planes=planes, response_store="off")
    )
    lease: Lease | None = None
    try:
        served = await worker.endpoint(EID).serve(
            echo, records=lambda iid: [(mdc_key(EID, iid), card(iid))]
        )
        # A worker on the NATS planes: its records, under its lease.
        lease = await Lease.grant(worker.store, 3.0)
        nats_record = Instance(
            endpoint=EID, instance_id=REFUSED_ID,
            transport=TransportAddress(kind="nats", address="turnout.team.backend.generate-1a2b"),
            host="10.0.0.7", pid=31337, version="0.1.0", request_plane="nats", event_plane="nats",
        )  # fmt: skip
        await worker.store.put(
            instance_key(EID, REFUSED_ID), msgspec.json.encode(nats_record), lease_id=lease.id
        )
        await worker.store.put(mdc_key(EID, REFUSED_ID), card(REFUSED_ID), lease_id=lease.id)
        await frontend.start()

        async with asyncio.timeout(20):
            while True:
                doc = await gather_status(planes, 0)
                if doc["frontends"] and doc["frontends"][0]["held_back"]:
                    break
                await asyncio.sleep(0.1)
    finally:
        await frontend.stop()
        if lease is not None:
            await lease.revoke()
        await worker.shutdown()

    (fe,) = doc["frontends"]
    assert fe["id"] == f"{frontend.registration.frontend_id:x}"  # type: ignore[union-attr]
    assert (fe["host"], fe["pid"], fe["version"]) == ("127.0.0.1", os.getpid(), turnout.__version__)
    assert (fe["request_plane"], fe["event_plane"]) == ("tcp", "zmq")
    assert fe["http_address"] == frontend.url and fe["router_mode"] == "round-robin"
    (held,) = fe["held_back"]
    assert held == {
        "model": "mock", "instance_id": "1a2b", "checksum": msgspec.json.decode(
            card(REFUSED_ID), type=ModelDeploymentCard).checksum(),
        "reason": "planes_differ", "detail": "instance runs nats/nats, frontend tcp/zmq",
    }  # fmt: skip

    rows: dict[str, dict[str, Any]] = {r["id"]: r for r in doc["namespaces"]["team"]["instances"]}
    ok = rows[f"{served.instance_id:x}"]
    assert (ok["host"], ok["pid"], ok["version"]) == ("127.0.0.1", os.getpid(), turnout.__version__)
    assert (ok["request_plane"], ok["event_plane"], ok["refused"]) == ("tcp", "zmq", False)
    bad = rows["1a2b"]
    assert (bad["host"], bad["pid"], bad["refused"]) == ("10.0.0.7", 31337, True)
    assert bad["held_back"] == [
        {"frontend": fe["id"], "reason": "planes_differ", "detail": held["detail"]}
    ]

    text = render(doc)
    assert f"frontend {fe['id']}  {frontend.url}  host 127.0.0.1 pid {os.getpid()}" in text
    assert "holds back instance 1a2b of model mock" in text
    assert "host 10.0.0.7 pid 31337 v0.1.0 planes nats/nats  no load report  REFUSED" in text


def test_a_wildcard_bound_frontend_records_a_name_others_can_dial() -> None:
    """``turnout status`` shows where to reach each frontend: a wildcard bind (0.0.0.0, as in
    the Kubernetes manifests) is recorded as this machine's name, any other host as it is."""
    wildcard = RegisteredFrontend(FrontendConfig(host="0.0.0.0", port=8000, response_store="off"))
    assert wildcard._reachable_url() == f"http://{socket.gethostname()}:8000"
    bound = RegisteredFrontend(FrontendConfig(host="10.0.0.5", port=8000, response_store="off"))
    assert bound._reachable_url() == "http://10.0.0.5:8000"
