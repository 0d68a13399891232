"""``/busy_threshold`` end to end: thresholds read and changed over HTTP steer the KV router."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from tests.frontend.stack import ENDPOINT, Stack, echo_engine, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.protocols.kv import LOAD_TOPIC, LoadReport
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.worker_load import WorkerLoads
from turnout.router.mode import RouterMode

MODEL = "echo"


async def start(gguf_path: str, mode: RouterMode, **config: Any) -> Stack:
    stack = await make_stack(router_mode=mode, **config)
    for _ in range(2):
        await stack.add_worker(echo_engine(gguf_path))
    await stack.wait_for_model(MODEL, instances=2)
    return stack


@pytest.fixture
async def kv_stack(gguf_path: str) -> AsyncIterator[Stack]:
    before = set(asyncio.all_tasks())
    stack = await start(gguf_path, RouterMode.KV, kv=KvRouterConfig(busy_num_waiting_threshold=5))
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


async def report_load(stack: Stack, worker_id: int, kv_usage: float) -> None:
    """Publish a load report for ``worker_id`` as its engine would, and wait until the
    frontend's KV router has it."""
    publisher = await stack.runtime.event_plane.publisher(ENDPOINT.namespace, ENDPOINT.component)
    try:
        await publisher.publish_msg(LOAD_TOPIC, LoadReport(worker_id=worker_id, kv_usage=kv_usage))
    finally:
        await publisher.close()
    assert stack.frontend.factory is not None
    loads = stack.frontend.factory.kv_routers[MODEL].core.loads
    async with asyncio.timeout(10):
        while True:
            report = loads.get_report(WorkerKey(worker_id, 0))
            if report is not None and report.kv_usage == kv_usage:
                return
            await asyncio.sleep(0.01)


async def served_by(http: httpx.AsyncClient, n: int) -> set[int]:
    workers = set()
    for i in range(n):
        r = await http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": [9, i, 3, 4] * 4, "max_tokens": 2,
                  "nvext": {"extra_fields": ["worker_id"]}},
            timeout=30,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        workers.add(int(r.json()["nvext"]["worker_id"], 16))
    return workers


async def test_a_lowered_threshold_leaves_a_loaded_worker_out(kv_stack: Stack) -> None:
    loaded, other = kv_stack.frontend.manager.model_instances(MODEL)
    await report_load(kv_stack, loaded, 0.5)
    async with httpx.AsyncClient(base_url=kv_stack.url) as http:
        r = await http.get("/busy_threshold")
        assert r.status_code == 200
        (entry,) = r.json()["thresholds"]
        assert entry["model"] == MODEL and entry["applies"] is True
        assert entry["kv_usage"] is None and entry["num_waiting"] == 5
        assert entry["router_mode"] == "kv"
        assert await served_by(http, 16) == {loaded, other}  # 0.5 is not busy yet

        r = await http.post("/busy_threshold", json={"model": MODEL, "kv_usage": 0.4})
        assert r.status_code == 200, r.text
        assert r.json()["kv_usage"] == 0.4 and r.json()["num_waiting"] == 5
        assert r.json()["active_decode_blocks_threshold"] == 0.4
        assert await served_by(http, 16) == {other}

        # Dynamo's field name for the same threshold; a read returns what was set.
        body = {"model": MODEL, "active_decode_blocks_threshold": 0.9}
        assert (await http.post("/busy_threshold", json=body)).status_code == 200
        r = await http.post("/busy_threshold", json={"model": MODEL})
        assert r.json()["kv_usage"] == 0.9
        assert await served_by(http, 16) == {loaded, other}

        r = await http.post("/busy_threshold", json={"model": MODEL, "num_waiting": 0})
        assert r.status_code == 200 and r.json()["num_waiting"] == 0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope"}, 404, "model"),
        ({"model": MODEL, "kv_usage": 1.5}, 400, "kv_usage"),
        ({"model": MODEL, "kv_usage": "high"}, 400, "kv_usage"),
        ({"model": MODEL, "num_waiting": -1}, 400, "num_waiting"),
        ({"model": MODEL, "num_waiting": 1.5}, 400, "num_waiting"),
        ({"model": MODEL, "threshold": 0.5}, 400, "threshold"),
        ({"model": MODEL, "active_prefill_tokens_threshold": 1000}, 400,
         "active_prefill_tokens_threshold"),
        ({"model": MODEL, "kv_usage": 0.5, "active_decode_blocks_threshold": 0.6}, 400,
         "active_decode_blocks_threshold"),
        ({"kv_usage": 0.5}, 400, None),
    ],
)  # fmt: skip
async def test_bad_requests_name_the_field(
    kv_stack: Stack, body: dict[str, Any], status: int, param: str | None
) -> None:
    async with httpx.AsyncClient(base_url=kv_stack.url) as http:
        r = await http.post("/busy_threshold", json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        if param is not None:
            assert error["param"] == param
        r = await http.post("/busy_threshold", content=b"{not json")
        assert r.status_code == 400
        r = await http.delete("/busy_threshold")
        assert r.status_code == 405
        # Nothing was changed by the refused requests.
        (entry,) = (await http.get("/busy_threshold")).json()["thresholds"]
        assert entry["kv_usage"] is None and entry["num_waiting"] == 5


async def test_thresholds_do_not_apply_outside_kv_mode(gguf_path: str) -> None:
    before = set(asyncio.all_tasks())
    stack = await start(gguf_path, RouterMode.ROUND_ROBIN)
    try:
        async with httpx.AsyncClient(base_url=stack.url) as http:
            (entry,) = (await http.get("/busy_threshold")).json()["thresholds"]
            assert entry["applies"] is False and entry["router_mode"] == "round-robin"
            assert entry["kv_usage"] is None
            r = await http.post("/busy_threshold", json={"model": MODEL})
            assert r.status_code == 200 and r.json()["applies"] is False
            r = await http.post("/busy_threshold", json={"model": MODEL, "num_waiting": 3})
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "num_waiting"
            assert "kv routing only" in r.json()["error"]["message"]
    finally:
        await stack.close()
        await assert_no_leaked_tasks(before)


def test_new_thresholds_judge_the_latest_reports_again() -> None:
    loads = WorkerLoads(report_ttl_s=10.0)
    key = WorkerKey(1, 0)
    loads.on_load(LoadReport(worker_id=1, kv_usage=0.5), now=0.0)
    assert not loads.is_busy(key, 1.0)
    loads.set_thresholds(kv_usage=0.4)
    assert loads.is_busy(key, 1.0)
    assert not loads.is_busy(key, 11.0)  # a stale report still says nothing
    with pytest.raises(ValueError):
        loads.set_thresholds(kv_usage=2.0, num_waiting=1)
    assert loads.busy_num_waiting_threshold is None  # a refused change changes nothing
    loads.set_thresholds(kv_usage=0.6)
    assert not loads.is_busy(key, 1.0)
