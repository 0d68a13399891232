"""A TLS peer going away logs nothing at WARNING or above from asyncio: a NATS server under
TLS stopping (nats-py's TLS stream protocol makes asyncio warn "returning true from
eof_received() has no effect when using ssl" at each disconnect, which every command drops),
a peer of the tcp request plane under plane TLS disconnecting, on either side, and a client
of the HTTPS server leaving.

Real servers: nats-server with TLS, run as the CLI runs a command (``run_command``), and a
plane-TLS request-plane server and client in this process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from tests.certs import TestCa
from tests.servers.nats import nats_binary
from tests.servers.process import require

from turnout.cli.lifecycle import run_command
from turnout.frontend.service import free_port, server_ssl_context
from turnout.runtime.asyncio_logs import SslEofFilter
from turnout.runtime.context import RequestContext
from turnout.runtime.http import Exchange, HttpServer, Scope
from turnout.runtime.nats import NatsOptions, connect_nats
from turnout.runtime.plane_tls import PlaneTls
from turnout.runtime.request_plane import TcpClient, TcpServer


def asyncio_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "asyncio" and r.levelno >= 30]


@pytest.fixture(autouse=True)
def asyncio_logger_as_found() -> Iterator[None]:
    """Take off the filter ``run_command`` installs, so other tests see asyncio as it is."""
    logger = logging.getLogger("asyncio")
    before = list(logger.filters)
    yield
    for f in list(logger.filters):
        if f not in before and isinstance(f, SslEofFilter):
            logger.removeFilter(f)


def test_a_nats_server_under_tls_going_away_logs_no_asyncio_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    binary = nats_binary()
    require("nats-server", binary is not None)
    assert binary is not None
    ca = TestCa(tmp_path, name="nats")
    server, client = ca.issue("nats-server"), ca.issue("client")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "-a", "127.0.0.1", "-p", str(port), "--tlsverify", "--tlscert", server.cert,
         "--tlskey", server.key, "--tlscacert", server.ca],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    options = NatsOptions(
        servers=[f"tls://127.0.0.1:{port}"], ca_cert=client.ca, cert=client.cert, key=client.key
    )

    async def main() -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                conn = await connect_nats(options)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        try:
            proc.terminate()  # the server closes its TLS connections as it goes
            async with asyncio.timeout(20):
                while conn.client.is_connected:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0)  # let the transport's close callbacks run
        finally:
            # nats-py's close may find the socket already reset (the server is gone): what
            # is checked here is the log, not how closing a dead connection ends.
            with contextlib.suppress(ConnectionError):
                await conn.close()

    caplog.set_level(logging.WARNING, logger="asyncio")
    try:
        assert run_command(argparse.Namespace(log_level="info"), main) == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert not asyncio_warnings(caplog)


async def echo(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield payload


async def test_a_plane_tls_peer_disconnecting_logs_no_asyncio_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncio")
    leaf = TestCa(tmp_path).issue("node")
    tls = PlaneTls(leaf.ca, leaf.cert, leaf.key)
    server = TcpServer(plane_tls=tls)
    server.register("echo", echo)
    address = await server.start()
    try:
        for _ in range(3):  # the client leaves: the server sees its peer go
            client = TcpClient(plane_tls=tls)
            assert [x async for x in client.stream(address, "echo", b"hi", RequestContext())]
            await client.close()
        client = TcpClient(plane_tls=tls)
        assert [x async for x in client.stream(address, "echo", b"hi", RequestContext())]
    finally:
        await server.stop()  # the server leaves: the client sees its peer go
    async with asyncio.timeout(10):
        while client._conns:  # until the client has seen its connection end
            await asyncio.sleep(0.01)
    await client.close()
    assert not asyncio_warnings(caplog)


async def hello(scope: Scope, proto: Exchange) -> None:
    proto.response_bytes(200, [("content-type", "text/plain")], b"hello")


async def test_an_https_client_disconnecting_logs_no_asyncio_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Clients of the HTTPS server leave with close_notify, mid-keep-alive, and while the
    server is stopping: asyncio says nothing."""
    caplog.set_level(logging.WARNING, logger="asyncio")
    leaf = TestCa(tmp_path).issue("frontend")
    context = server_ssl_context(leaf.cert, leaf.key)
    server = HttpServer(hello, "127.0.0.1", 0, ssl=context)
    await server.start()
    serving = asyncio.create_task(server.serve())
    url = f"https://127.0.0.1:{server.port}/"
    try:
        for _ in range(3):
            async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=leaf.ca)) as c:
                assert (await c.get(url)).text == "hello"
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=leaf.ca)) as c:
            assert (await c.get(url)).text == "hello"
            server.stop()  # the server closes the kept-alive connection, the client too
        async with asyncio.timeout(10):
            while server.num_connections:
                await asyncio.sleep(0.01)
    finally:
        server.stop()
        await serving
    assert not asyncio_warnings(caplog)
