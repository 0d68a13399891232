"""``GET /metrics/targets``'s body: one entry per metrics endpoint of the records, frontends
first, instances of one process folded into one target, workers without a metrics endpoint
left out, and a cap on the count."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest
from tests.frontend.stack import echo_engine, make_stack

from turnout.frontend.http import scrape_targets as st
from turnout.protocols.frontend import FrontendRecord
from turnout.protocols.model import EndpointId, Instance, TransportAddress
from turnout.protocols.planner import Candidate, candidates_prefix
from turnout.runtime import identity

ENDPOINT = EndpointId(namespace="prod", component="backend", name="generate")


def instance(instance_id: int, metrics_url: str) -> Instance:
    return Instance(
        endpoint=ENDPOINT,
        instance_id=instance_id,
        transport=TransportAddress(kind="tcp", address="10.0.0.2:9000"),
        metrics_url=metrics_url,
    )


def labels(scheme: str, **turnout: str) -> dict[str, str]:
    """A target's labels: how Prometheus scrapes it, then turnout's own."""
    return {"__scheme__": scheme, "__metrics_path__": "/metrics", **turnout}


def test_frontends_and_workers_with_metrics_are_listed_once_each() -> None:
    frontends = [
        FrontendRecord(frontend_id=2, http_address="https://10.0.0.9:8000"),
        FrontendRecord(frontend_id=1, http_address="http://10.0.0.1:8000/"),
        FrontendRecord(frontend_id=3),  # no address yet: nothing to scrape
    ]
    instances = [
        instance(1, "http://10.0.0.2:8081/metrics"),
        instance(2, "http://10.0.0.2:8081/metrics"),  # same process, one target
        instance(3, ""),  # no --system-port
        instance(4, "not a url"),
    ]
    worker = {"turnout_role": "worker", "turnout_namespace": "prod", "turnout_component": "backend"}
    planners = [
        ("prod", Candidate(host="10.0.0.3", pid=7, url="http://10.0.0.3:9400")),
        ("prod", Candidate(host="10.0.0.4", pid=8)),  # no endpoint: nothing to scrape
    ]
    planner = {"turnout_role": "planner", "turnout_namespace": "prod"}
    assert st.scrape_targets(frontends, instances, planners) == [
        {"targets": ["10.0.0.1:8000"], "labels": labels("http", turnout_role="frontend")},
        # TLS: Prometheus must scrape it over https
        {"targets": ["10.0.0.9:8000"], "labels": labels("https", turnout_role="frontend")},
        {"targets": ["10.0.0.2:8081"], "labels": labels("http", **worker)},
        {"targets": ["10.0.0.3:9400"], "labels": labels("http", **planner)},
    ]


def test_the_list_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(st, "MAX_TARGETS", 3)
    instances = [instance(i, f"http://10.0.1.{i}:8081/metrics") for i in range(10)]
    assert len(st.scrape_targets([], instances)) == 3


async def test_the_route_lists_a_worker_with_metrics_and_fails_when_the_store_stalls(
    gguf_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over HTTP, from the store's records: a worker whose process advertised a metrics
    endpoint; 503 when the store does not answer in time."""
    monkeypatch.setattr(identity, "_metrics_url", "")
    stack = await make_stack()
    try:
        identity.advertise_metrics("http://10.0.0.7:8081/metrics")
        await stack.add_worker(echo_engine(gguf_path), model_name="echo")
        await stack.wait_for_model("echo")
        planner = Candidate(host="10.0.0.8", pid=9, url="http://10.0.0.8:9400")
        await stack.runtime.store.put(candidates_prefix("test") + "1", msgspec.json.encode(planner))
        await stack.runtime.store.put(candidates_prefix("test") + "2", b"{not a record")
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            answer = await http.get(st.SCRAPE_TARGETS)
            assert answer.status_code == 200
            # The frontend's own record is written by ``turnout frontend`` (the CLI), which
            # an in-process stack is not: tests/integration/test_prometheus.py finds it.
            worker = {"turnout_namespace": "test", "turnout_component": "backend"}
            assert answer.json() == [
                {"targets": ["10.0.0.7:8081"],
                 "labels": labels("http", turnout_role="worker", **worker)},
                {"targets": ["10.0.0.8:9400"],
                 "labels": labels("http", turnout_role="planner", turnout_namespace="test")},
            ]  # fmt: skip

            stalled = asyncio.Event()

            async def stall(prefix: str) -> list[object]:
                await stalled.wait()  # never set: the store does not answer
                return []

            monkeypatch.setattr(st, "STORE_TIMEOUT_S", 0.05)
            monkeypatch.setattr(stack.runtime.store, "get_prefix", stall)
            answer = await http.get(st.SCRAPE_TARGETS)
            assert answer.status_code == 503
            error = answer.json()["error"]
            assert error["code"] == "store_unavailable" and error["type"] == "server_error"
    finally:
        monkeypatch.undo()  # the store answers again for the stack's own close
        await stack.close()


async def test_the_route_wants_a_key_when_auth_is_on_unless_public() -> None:
    key = "sk-turnout-test-scrape-targets-0123456789"
    for public, expected in (((), 401), ((st.SCRAPE_TARGETS,), 200)):
        stack = await make_stack(api_keys=[key], public_routes=public)
        try:
            async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
                assert (await http.get(st.SCRAPE_TARGETS)).status_code == expected
                with_key = await http.get(
                    st.SCRAPE_TARGETS, headers={"authorization": f"Bearer {key}"}
                )
                assert with_key.status_code == 200
        finally:
            await stack.close()
