"""``turnout router`` as a service: it answers best_worker from the workers' KV events, and
replicas (here a frontend in kv mode and the service) share in-flight requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest
from tests.frontend.stack import ENDPOINT, Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.mocker import MockerConfig, make_mocker_engines
from turnout.protocols.model import EndpointId, Instance, TransportAddress, instance_key
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.config import KvRouterConfig
from turnout.router.mode import RouterMode
from turnout.router.same_planes import SamePlanes
from turnout.router.service import RouterClient, RouterService

ROUTER = EndpointId(namespace="test", component="router", name="best_worker")


@pytest.fixture
async def stack_and_service(gguf_path: str) -> AsyncIterator[tuple[Stack, RouterService]]:
    before = set(asyncio.all_tasks())
    stack = await make_stack(router_mode=RouterMode.KV)
    config = MockerConfig(num_gpu_blocks=512, block_size=16, speedup_ratio=1.0)
    for engine in make_mocker_engines(config, 2, model_path=gguf_path):
        await stack.add_worker(engine, model_name="mock")
    await stack.wait_for_model("mock", instances=2)
    service = RouterService(stack.runtime, ENDPOINT, ROUTER, KvRouterConfig())
    await service.start()
    yield stack, service
    await service.stop()
    await stack.close()
    await assert_no_leaked_tasks(before)


async def test_best_worker_answers_without_dispatching(
    stack_and_service: tuple[Stack, RouterService],
) -> None:
    stack, service = stack_and_service
    prompt = [2000 + i for i in range(320)]
    async with httpx.AsyncClient(base_url=stack.url) as http:
        r = await http.post(
            "/v1/completions",
            json={"model": "mock", "prompt": prompt, "max_tokens": 2,
                  "nvext": {"extra_fields": ["worker_id"]}},
        )  # fmt: skip
        home = int(r.json()["nvext"]["worker_id"], 16)
    client = await RouterClient.connect(stack.runtime, ROUTER)
    try:
        for _ in range(50):
            selection = await client.best_worker(prompt)
            if selection is not None and selection.overlap_blocks == 20:
                break
            await asyncio.sleep(0.05)
        assert selection is not None and selection.ok
        assert selection.worker_id == home
        assert selection.overlap_blocks == 20
        assert service.router is not None
        assert service.router.core.get_stats().requests_routed == 0  # a query books nothing
    finally:
        await client.close()


async def test_replicas_share_in_flight_requests(
    stack_and_service: tuple[Stack, RouterService],
) -> None:
    stack, service = stack_and_service
    assert service.router is not None
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        body = {"model": "mock", "prompt": [3000 + i for i in range(64)], "max_tokens": 60,
                "ignore_eos": True, "stream": True}  # fmt: skip
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                # The frontend booked the request; the service, a replica, sees it too.
                loads = [service.router.core.active.get_load(WorkerKey(w, 0)).num_requests
                         for w in stack.frontend.manager.model_instances("mock")]  # fmt: skip
                if sum(loads) == 1:
                    break
            else:
                pytest.fail("the router service never saw the frontend's request")
    for _ in range(100):
        if len(service.router.core.active) == 0:
            break
        await asyncio.sleep(0.02)
    assert len(service.router.core.active) == 0, "the request's end did not reach the replica"


async def test_router_service_refuses_a_worker_on_other_planes(
    stack_and_service: tuple[Stack, RouterService], caplog: pytest.LogCaptureFixture
) -> None:
    """Like a frontend, the service never picks a worker whose KV events it cannot hear."""
    stack, service = stack_and_service
    assert service.router is not None
    record = Instance(
        endpoint=ENDPOINT, instance_id=0x1A2B,
        transport=TransportAddress(kind="tcp", address="10.0.0.9:4000"),
        host="10.0.0.9", pid=4242, request_plane="tcp", event_plane="zmq",
    )  # fmt: skip
    await stack.runtime.store.put(instance_key(ENDPOINT, 0x1A2B), msgspec.json.encode(record))
    view = service.router.client
    assert isinstance(view, SamePlanes)
    async with asyncio.timeout(5):
        while 0x1A2B not in view.client.instance_ids():
            await asyncio.sleep(0.01)
    assert 0x1A2B not in view.instance_ids() and len(view.instance_ids()) == 2
    warnings = [
        r.getMessage() for r in caplog.records if "every process must use" in r.getMessage()
    ]
    assert warnings == [
        "instance 1a2b at 10.0.0.9:4242 runs request plane tcp, event plane zmq; this router "
        "runs tcp/local: refused; every process must use the same planes"
    ]
