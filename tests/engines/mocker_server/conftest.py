"""Fixtures of the mocker-server tests: servers started in this process on ephemeral ports,
stopped afterwards, with no task left behind."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.mocker import MockerConfig
from turnout.engines.mocker_server.metrics import Api
from turnout.engines.mocker_server.server import MockerServer, MockerServerConfig

StartServer = Callable[..., Awaitable[MockerServer]]


@pytest.fixture
async def start_server() -> AsyncIterator[StartServer]:
    """``await start_server(api, **config)``: a running server (stopped at teardown).
    ``mocker=`` takes ``MockerConfig`` fields; the default runs at ``speedup_ratio=0``."""
    before = asyncio.all_tasks()
    servers: list[MockerServer] = []

    async def start(api: Api, *, mocker: dict[str, Any] | None = None, **kw: Any) -> MockerServer:
        settings = {"speedup_ratio": 0.0, "num_gpu_blocks": 1024, "block_size": 16}
        settings.update(mocker or {})
        server = MockerServer(
            MockerServerConfig(api=api, port=0, mocker=MockerConfig(**settings), **kw)
        )
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()
    await assert_no_leaked_tasks(before)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample of ``name`` whose labels include ``labels``."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.match(r"([^{\s]+)(?:\{([^}]*)\})?\s+(\S+)", line)
        if match is None or match.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return None


async def wait_for_metric(
    client: httpx.AsyncClient,
    name: str,
    check: Callable[[float | None], bool],
    timeout: float = 10.0,
    **labels: str,
) -> float | None:
    """Poll ``/metrics`` until ``check(value)`` holds; fail at the deadline."""
    deadline = time.monotonic() + timeout
    value: float | None = None
    while time.monotonic() < deadline:
        value = metric((await client.get("/metrics")).text, name, **labels)
        if check(value):
            return value
        await asyncio.sleep(0.02)
    pytest.fail(f"{name}{labels} never satisfied the check (last value {value})")


def sse_events(body: str) -> list[Any]:
    """The JSON payloads of an SSE body, ``[DONE]`` excluded (asserted last)."""
    import json

    payloads = [line[len("data: ") :] for line in body.splitlines() if line.startswith("data: ")]
    assert payloads and payloads[-1] == "[DONE]", body[-200:]
    return [json.loads(p) for p in payloads[:-1]]
