"""The KV router's self-repair and self-report: a router that joins late (or loses events)
resynchronises from the worker's snapshot; a worker that sends no KV events is flagged;
a worker that leaves is forgotten."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import httpx
import pytest
from tests.frontend.stack import ENDPOINT, Stack, echo_engine, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.mocker import MockerConfig, make_mocker_engines
from turnout.protocols.block_hashing import compute_seq_hashes
from turnout.protocols.model import EndpointId
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.router import KvRouter
from turnout.router.service import RouterService


@pytest.fixture
async def mocker_stack(gguf_path: str) -> AsyncIterator[Stack]:
    before = set(asyncio.all_tasks())
    stack = await make_stack()  # round-robin frontend: the KV routers below are extra
    config = MockerConfig(num_gpu_blocks=512, block_size=16, speedup_ratio=0)
    for engine in make_mocker_engines(config, 2, model_path=gguf_path):
        await stack.add_worker(engine, model_name="mock")
    await stack.wait_for_model("mock", instances=2)
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


async def send(stack: Stack, prompt: list[int]) -> int:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        r = await http.post(
            "/v1/completions",
            json={"model": "mock", "prompt": prompt, "max_tokens": 1,
                  "nvext": {"extra_fields": ["worker_id"]}},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        return int(r.json()["nvext"]["worker_id"], 16)


async def test_late_router_resyncs_from_worker_snapshots(mocker_stack: Stack) -> None:
    stack = mocker_stack
    old = [4000 + i for i in range(160)]
    home = await send(stack, old)
    # A router that starts now missed the events above.
    service = RouterService(
        stack.runtime, ENDPOINT, EndpointId(namespace="test", component="router", name="bw"),
        KvRouterConfig(),
    )  # fmt: skip
    await service.start()
    try:
        assert service.router is not None
        seq = compute_seq_hashes(old, 16)
        assert service.router.core.index.find_matches(seq).get(WorkerKey(home, 0)) == 0
        # The next event from each worker carries an id past 0: a gap, then a resync.
        for i in range(2):
            await send(stack, [9000 + 100 * i + j for j in range(48)])
        for _ in range(100):
            if service.router.core.index.find_matches(seq).get(WorkerKey(home, 0)) == 10:
                break
            await asyncio.sleep(0.02)
        assert service.router.core.index.find_matches(seq).get(WorkerKey(home, 0)) == 10
        assert service.router.num_resyncs >= 1
    finally:
        await service.stop()


async def test_worker_leaving_is_forgotten(mocker_stack: Stack) -> None:
    stack = mocker_stack
    client = await stack.runtime.endpoint(ENDPOINT).client()
    router = KvRouter(KvRouterConfig(block_size=16), client, stack.runtime.event_plane, ENDPOINT)
    await router.start()
    try:
        prompt = [5000 + i for i in range(64)]
        home = await send(stack, prompt)
        seq = compute_seq_hashes(prompt, 16)
        for _ in range(100):
            if router.core.index.find_matches(seq).get(WorkerKey(home, 0)) == 4:
                break
            await asyncio.sleep(0.02)
        assert router.core.index.find_matches(seq).get(WorkerKey(home, 0)) == 4
        # Unreachable for a moment is not gone: the cache stays indexed.
        client.report_instance_down(home)
        assert router.core.index.find_matches(seq).get(WorkerKey(home, 0)) == 4
        leaving = next(w for w in stack.workers if w.serving and w.serving.instance_id == home)
        await leaving.stop(drain_timeout=0.5)
        stack.workers.remove(leaving)
        for _ in range(100):
            if router.core.index.find_matches(seq).get(WorkerKey(home, 0)) == 0:
                break
            await asyncio.sleep(0.02)
        assert router.core.index.find_matches(seq).get(WorkerKey(home, 0)) == 0
        assert WorkerKey(home, 0) not in router.candidates()
    finally:
        await router.close()
        await client.close()


async def test_worker_without_kv_events_is_flagged(
    gguf_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    await stack.add_worker(echo_engine(gguf_path))  # echo publishes no KV events
    await stack.wait_for_model("echo")
    client = await stack.runtime.endpoint(ENDPOINT).client()
    router = KvRouter(
        KvRouterConfig(block_size=16), client, stack.runtime.event_plane, ENDPOINT,
        silence_warn_s=0.0,
    )  # fmt: skip
    await router.start()
    try:
        with caplog.at_level(logging.WARNING, logger="turnout.router.kv"):
            for i in range(5):  # shorter than a block: nothing to store, no sign of silence
                router.route(f"short{i}", list(range(10)))
            assert router.num_silent_warnings == 0
            for i in range(5):
                router.route(f"r{i}", list(range(64)))
        assert router.num_silent_warnings == 1  # once per worker, not once per request
        assert "sent no KV event" in caplog.text
    finally:
        await router.close()
        await client.close()
        await stack.close()
    await assert_no_leaked_tasks(before)
