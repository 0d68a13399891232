"""Every TLS at once: etcd over mutual TLS for discovery, the nats event plane over NATS's
mutual TLS, and the tcp request plane under plane TLS, each with a CA of its own, in a worker
and a frontend runtime opened from their ``PlanesConfig`` as the CLI opens them."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from tests.certs import Leaf, TestCa
from tests.runtime.conftest import start_etcd
from tests.servers.etcd import TlsFiles
from tests.servers.nats import nats_binary
from tests.servers.process import require

from turnout.frontend.service import free_port
from turnout.protocols.model import EndpointId
from turnout.runtime.context import RequestContext
from turnout.runtime.nats import NatsOptions
from turnout.runtime.plane_tls import PlaneTls
from turnout.runtime.planes import PlanesConfig, open_runtime

EID = EndpointId(namespace="ns", component="backend", name="generate")


def wait_for_port(port: int, deadline: float) -> None:
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def nats_tls(tmp_path: Path) -> Iterator[tuple[str, TestCa]]:
    """A nats-server that requires a client certificate its own CA signed."""
    binary = nats_binary()
    require("nats-server", binary is not None)
    assert binary is not None
    ca = TestCa(tmp_path, name="nats")
    server = ca.issue("nats-server")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "-a", "127.0.0.1", "-p", str(port), "--tlsverify", "--tlscert", server.cert,
         "--tlskey", server.key, "--tlscacert", server.ca],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port, time.monotonic() + 10)
        yield f"tls://127.0.0.1:{port}", ca
    finally:
        proc.kill()
        proc.wait(timeout=10)


def planes(
    endpoints: list[str], etcd: Leaf, nats_url: str, nats: Leaf, plane: Leaf
) -> PlanesConfig:
    return PlanesConfig(
        store="etcd",
        store_options={
            "endpoints": endpoints,
            "ca_cert": etcd.ca,
            "cert": etcd.cert,
            "key": etcd.key,
        },
        request_plane="tcp",
        event_plane="nats",
        nats=NatsOptions(servers=[nats_url], ca_cert=nats.ca, cert=nats.cert, key=nats.key),
        plane_tls=PlaneTls(plane.ca, plane.cert, plane.key),
        lease_ttl=2.0,
    )


async def test_etcd_nats_and_plane_tls_work_together(
    tmp_path: Path, nats_tls: tuple[str, TestCa]
) -> None:
    require("openssl")
    nats_url, nats_ca = nats_tls
    etcd_ca, plane_ca = TestCa(tmp_path, name="etcd"), TestCa(tmp_path, name="plane")
    etcd_server = etcd_ca.issue("etcd-server")
    tls = TlsFiles(
        Path(etcd_server.ca),
        Path(etcd_server.cert),
        Path(etcd_server.key),
        Path(etcd_server.cert),
        Path(etcd_server.key),
    )
    etcd = start_etcd(tmp_path / "etcd", tls=tls)
    try:
        worker = await open_runtime(
            planes(etcd.endpoints, etcd_ca.issue("w-etcd"), nats_url,
                   nats_ca.issue("w-nats"), plane_ca.issue("worker"))
        )  # fmt: skip
        frontend = await open_runtime(
            planes(etcd.endpoints, etcd_ca.issue("f-etcd"), nats_url,
                   nats_ca.issue("f-nats"), plane_ca.issue("frontend"))
        )  # fmt: skip
        try:

            async def generate(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
                yield payload.upper()

            served = await worker.endpoint(EID).serve(generate)
            client = await frontend.endpoint(EID).client()
            await client.wait_for_instances(1, timeout=10)
            stream = client.stream(served.instance_id, b"hello", RequestContext())
            assert [item async for item in stream] == [b"HELLO"]

            subscription = await frontend.event_plane.subscribe("ns", "backend", "kv")
            publisher = await worker.event_plane.publisher("ns", "backend")
            async with asyncio.timeout(10):
                while True:  # the subscription joins asynchronously: publish until heard
                    await publisher.publish("kv", b"event")
                    try:
                        async with asyncio.timeout(0.2):
                            event = await anext(subscription)
                        break
                    except TimeoutError:
                        continue
            assert event.payload == b"event"
            await subscription.close()
            await publisher.close()
        finally:
            await frontend.shutdown()
            await worker.shutdown()
    finally:
        etcd.kill()
