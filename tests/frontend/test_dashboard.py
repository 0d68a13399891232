"""The dashboard (``/dashboard``): its latency history from the frontend's histograms, the
routers' decision log, the page's escaping and completeness without JavaScript, its queries,
and what a KV-routed stack shows of its instances and decisions."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import httpx
import pytest
from tests.frontend.stack import Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.mocker import MockerConfig, make_mocker_engines
from turnout.frontend.dashboard.history import LatencyHistory
from turnout.frontend.dashboard.page import render_page
from turnout.frontend.metrics.frontend import FrontendMetrics
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.decisions import DecisionLog
from turnout.router.mode import RouterMode
from turnout.runtime.histograms import quantile

LONG = [1000 + (i * 37) % 20000 for i in range(200)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_quantiles_interpolate_inside_their_bucket() -> None:
    bounds = (0.1, 0.2, 0.4)
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None
    assert quantile(0.5, bounds, [10, 0, 0, 0]) == pytest.approx(0.05)
    assert quantile(0.5, bounds, [0, 10, 0, 0]) == pytest.approx(0.15)
    assert quantile(0.9, bounds, [5, 0, 5, 0]) == pytest.approx(0.2 + 0.2 * 0.8)
    assert quantile(0.99, bounds, [0, 0, 0, 3]) == 0.4  # above the last bound: the bound


def test_the_history_keeps_one_point_per_interval_from_the_histograms() -> None:
    metrics = FrontendMetrics()
    clock, wall = Clock(), Clock()
    history = LatencyHistory(metrics, interval_s=5, points=3, clock=clock, wall=wall)
    model = metrics.model("m")
    for _ in range(10):
        model.ttft.observe(0.02)  # the 0.01-0.025 bucket
        metrics.count_request("m", "chat_completions", True, 200)
    model.itl.observe(0.004)
    clock.now += 5
    point = history.sample()
    assert point.requests_per_s == pytest.approx(2.0)
    assert point.ttft_count == 10 and point.itl_count == 1
    assert point.ttft[0] == pytest.approx(0.01 + 0.015 * 0.5)
    clock.now += 5
    quiet = history.sample()  # nothing new in this interval
    assert quiet.requests_per_s == 0 and quiet.ttft == (None, None, None)
    for _ in range(3):
        clock.now += 5
        history.sample()
    assert len(history.points) == 3  # bounded


def test_the_decision_log_samples_at_its_rate_and_keeps_the_last_entries() -> None:
    clock = Clock()
    log = DecisionLog(capacity=3, per_second=2, burst=2, clock=clock)
    assert [log.wants_sample() for _ in range(3)] == [True, True, False]
    clock.now += 0.5  # one token back
    assert [log.wants_sample() for _ in range(2)] == [True, False]
    for i in range(5):
        log.record({"n": i})
    assert [e["n"] for e in log.entries()] == [4, 3, 2]


def snapshot(name: str) -> dict[str, object]:
    return {
        "time": 0.0,
        "version": "0",
        "router_mode": "kv",
        "quantiles": [0.5, 0.9, 0.99],
        "series": [
            {"time": 0.0, "requests_per_s": 1.0, "ttft_s": [0.01, 0.02, None], "itl_s": [None] * 3}
        ],
        "admission": {"rejected": {"queue_full": 2.0}},
        "models": [
            {
                "name": name,
                "kv_router": True,
                "instances": [{"id": "ab", "role": "aggregated", "in_flight": 1}],
                "decisions": [
                    {"time": 0.0, "request_id": "<img src=x onerror=alert(1)>", "candidates": []}
                ],
            }
        ],
    }


def test_the_page_escapes_what_the_store_and_clients_name() -> None:
    page = render_page(snapshot("<script>alert('m')</script>"))
    assert "<script>alert" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(&#x27;m&#x27;)&lt;/script&gt;" in page
    assert page.count("<script>") == 1  # the page's own, and only it
    assert "rejected: queue_full" in page and "<polyline" not in page.split("<main")[0]


@pytest.fixture
async def kv_stack(gguf_path: str) -> AsyncIterator[Stack]:
    before = set(asyncio.all_tasks())
    stack = await make_stack(router_mode=RouterMode.KV, kv=KvRouterConfig(block_size=16))
    config = MockerConfig(num_gpu_blocks=256, block_size=16, speedup_ratio=0)
    for engine in make_mocker_engines(config, 2, model_path=gguf_path):
        await stack.add_worker(engine, model_name="mock")
    await stack.wait_for_model("mock", instances=2)
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


async def test_a_kv_stack_shows_its_instances_decisions_and_admission(kv_stack: Stack) -> None:
    instances = {f"{i:x}" for i in kv_stack.frontend.manager.model_instances("mock")}
    async with httpx.AsyncClient(base_url=kv_stack.url, timeout=30) as http:
        for _ in range(3):
            answer = await http.post(
                "/v1/completions",
                json={"model": "mock", "prompt": LONG, "max_tokens": 2},
                headers={"x-request-id": "dash"},
            )
            assert answer.status_code == 200
        state = (await http.get("/dashboard/state.json")).json()
        page = await http.get("/dashboard")
        fragment = await http.get("/dashboard", params={"fragment": "1"})
        bad = await http.get("/dashboard", params={"refresh": "1"})
    (model,) = state["models"]
    assert {i["id"] for i in model["instances"]} == instances
    assert all(i["role"] == "aggregated" for i in model["instances"])
    assert [d["request_id"].split(".")[0] for d in model["decisions"]] == ["dash"] * 3
    first = model["decisions"][-1]
    assert first["prompt_tokens"] == len(LONG) and first["worker_id"] in instances
    assert {c["worker_id"] for c in first["candidates"]} == instances
    assert state["admission"]["in_flight"] == 0 and state["router_mode"] == "kv"
    # Predicted and reported cache hits on one basis (prompt tokens): a repeated prompt the
    # router places on the worker that holds it shows no gap, its partial last block aside.
    assert model["reported_hit_rate"] > 0 and abs(model["hit_rate_gap"]) < 0.01, model
    # With JavaScript off the page is complete: every instance's row is in the HTML.
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'sha256-" in page.headers["content-security-policy"]
    assert all(f"<td>{i}</td>" in page.text for i in instances)
    assert re.search(r"<noscript><meta http-equiv=refresh", page.text)
    assert "<html" not in fragment.text and all(i in fragment.text for i in instances)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "query"


async def test_the_dashboard_needs_a_key_when_auth_is_on_unless_public(gguf_path: str) -> None:
    key = "sk-turnout-test-dashboard-0123456789"
    for public, expected in (((), 401), (("/dashboard",), 200)):
        stack = await make_stack(api_keys=[key], public_routes=public)
        try:
            async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
                assert (await http.get("/dashboard")).status_code == expected
                with_key = await http.get(
                    "/dashboard/state.json", headers={"authorization": f"Bearer {key}"}
                )
                assert with_key.status_code == 200
        finally:
            await stack.close()
