"""An instance announced at an address that does not speak the request plane is set aside.

Whoever can write the discovery store can announce an instance (and its card) anywhere: at a
closed port, at a server that answers garbage, at one that echoes what it hears, at one that
accepts and says nothing. A real frontend (tcp request plane) with a real echo worker gets
such a fake instance of the worker's own model, written straight into the store: every
request must still succeed, retried on the real instance before any token, quickly, and the
fake must not cost every request a try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import msgspec
import pytest
from tests.frontend.stack import ENDPOINT, Stack, echo_engine, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.frontend.service import free_port
from turnout.protocols.model import (
    Instance,
    ModelDeploymentCard,
    TransportAddress,
    instance_key,
    mdc_key,
)
from turnout.runtime.request_plane.tcp.client import HANDSHAKE_TIMEOUT

FAKE = 0xDEAD
REQUESTS = 12


class FakePeer:
    """A tcp server at a fake instance's address; ``behave`` decides what it does with each
    connection. Counts the connections made to it."""

    def __init__(
        self, behave: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
    ):
        self._behave = behave
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._on_connection, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._behave(reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await self._server.wait_closed()


async def _garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An HTTP server, say: its answer is no frame."""
    await reader.read(1)
    writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
    await writer.drain()
    await reader.read()


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Sends back every byte it gets: well-formed frames, of the wrong kind."""
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Accepts, reads, never answers."""
    while await reader.read(65536):
        pass


@pytest.fixture
async def stack(gguf_path: str) -> AsyncIterator[Stack]:
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    await stack.add_worker(echo_engine(gguf_path), model_name="echo")
    await stack.wait_for_model("echo")
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


async def announce_fake(stack: Stack, address: str) -> None:
    """An instance of ``echo`` at ``address``, with the real worker's card, in the store."""
    store = stack.runtime.store
    (kv,) = await store.get_prefix(f"v1/mdc/{ENDPOINT.path()}/")
    card = msgspec.json.decode(kv.value, type=ModelDeploymentCard)
    fake = Instance(
        endpoint=ENDPOINT, instance_id=FAKE, transport=TransportAddress(kind="tcp", address=address)
    )
    await store.put(instance_key(ENDPOINT, FAKE), msgspec.json.encode(fake))
    await store.put(
        mdc_key(ENDPOINT, FAKE),
        msgspec.json.encode(msgspec.structs.replace(card, instance_id=FAKE)),
    )
    await stack.wait_for_model("echo", instances=2)


def closed_port() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.mark.parametrize("kind", ["closed", "garbage", "echo", "silent"])
async def test_a_fake_instance_costs_no_request_and_few_tries(
    stack: Stack, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    behave = {"garbage": _garbage, "echo": _echo, "silent": _silent}.get(kind)
    peer = FakePeer(behave) if behave is not None else None
    address = await peer.start() if peer is not None else closed_port()
    try:
        await announce_fake(stack, address)
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            for i in range(REQUESTS):
                started = time.monotonic()
                reply = await http.post(
                    "/v1/chat/completions",
                    json={
                        "model": "echo",
                        "messages": [{"role": "user", "content": f"hello {i}"}],
                        "max_tokens": 3,
                    },
                )
                took = time.monotonic() - started
                assert reply.status_code == 200, (i, reply.text)
                assert reply.json()["choices"][0]["message"]["content"], reply.text
                # A silent peer costs its first request the handshake bound, no more.
                assert took < HANDSHAKE_TIMEOUT + 2.0, f"request {i} took {took:.1f}s"
        tries = [
            r.getMessage()
            for r in caplog.records
            if f"instance {FAKE:x} " in r.getMessage() or "stream broke" in r.getMessage()
        ]
        if peer is not None:
            assert peer.connections <= 2, peer.connections
        assert len(tries) <= 2, tries
    finally:
        if peer is not None:
            with contextlib.suppress(Exception):
                await peer.stop()
