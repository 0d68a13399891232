"""Discovery across real processes: workers appear, die (kill -9) and vanish with their lease,
and requests go only to the live ones; a worker that dies before answering costs a 503, and
one that dies mid-stream costs nothing: the request migrates."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from tests.integration.procs import ProcessSet, health, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessSet]:
    ps = ProcessSet(tmp_path)
    yield ps
    ps.close()


def instance_of(url: str, model: str = "echo") -> list[str]:
    return health(url).get(model, [])


def test_workers_join_and_leave_with_their_lease(procs: ProcessSet) -> None:
    procs.frontend()
    a = procs.worker("--engine", "echo", "--model-name", "echo")
    wait_until(lambda: len(instance_of(procs.url)) == 1, 60, "worker A", procs.logs)
    a_id = instance_of(procs.url)[0]
    assert [m["id"] for m in httpx.get(procs.url + "/v1/models").json()["data"]] == ["echo"]

    procs.worker("--engine", "echo", "--model-name", "echo")
    wait_until(lambda: len(instance_of(procs.url)) == 2, 60, "worker B", procs.logs)
    b_id = next(i for i in instance_of(procs.url) if i != a_id)

    os.killpg(a.pid, signal.SIGKILL)
    a.wait()
    # Within the lease TTL (2 s) plus the store's poll, A is gone for the frontend.
    wait_until(lambda: instance_of(procs.url) == [b_id], 10, "A's lease to end", procs.logs)
    for _ in range(6):
        r = httpx.post(
            procs.url + "/v1/completions",
            json={"model": "echo", "prompt": "hi there", "max_tokens": 2,
                  "nvext": {"extra_fields": ["worker_id"]}},
            timeout=10,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["nvext"]["worker_id"] == b_id

    os.killpg(procs.procs[-1].pid, signal.SIGKILL)
    wait_until(
        lambda: httpx.get(procs.url + "/v1/models").json()["data"] == [], 10, "model removal"
    )
    r = httpx.post(procs.url + "/v1/completions", json={"model": "echo", "prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_worker_dead_before_answering_is_503(tmp_path: Path) -> None:
    procs = ProcessSet(tmp_path, lease_ttl=30.0)  # the dead worker stays registered
    try:
        procs.frontend()
        w = procs.worker("--engine", "echo", "--model-name", "echo")
        wait_until(lambda: len(instance_of(procs.url)) == 1, 60, "worker", procs.logs)
        os.killpg(w.pid, signal.SIGKILL)
        w.wait()
        r = httpx.post(
            procs.url + "/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
            timeout=20,
        )
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"]
        assert r.json()["error"]["code"] == "service_unavailable"
        assert httpx.get(procs.url + "/live").status_code == 200
        # Seen dead, it stays out of /health while its record lasts: its set-aside ends in a
        # probe that finds nothing there, not in its return.
        assert instance_of(procs.url) == []
        wait_until(
            lambda: "still unreachable" in procs.logs() or instance_of(procs.url) != [],
            30, "a probe, or the instance listed again", procs.logs,
        )  # fmt: skip
        assert instance_of(procs.url) == [], "a dead instance is listed in /health again"
    finally:
        procs.close()


def test_one_model_without_workers_leaves_the_frontend_ready(tmp_path: Path) -> None:
    """``/health`` reports the deployment (503: a model has no live instance); ``/ready`` this
    frontend's readiness (200 while some model is served), so a load balancer keeps it for the
    models that still have workers."""
    procs = ProcessSet(tmp_path, lease_ttl=30.0)  # the dead worker stays registered
    try:
        procs.frontend()
        wait_until(lambda: health(procs.url) == {}, 60, "frontend", procs.logs)
        ready = httpx.get(procs.url + "/ready", timeout=5)
        assert (ready.status_code, ready.json()["status"]) == (503, "not_ready")
        procs.worker("--engine", "echo", "--model-name", "echo")
        other = procs.worker(
            "--engine", "echo", "--model-name", "other", "--endpoint", "turnout/other/generate"
        )
        wait_until(
            lambda: instance_of(procs.url) and instance_of(procs.url, "other"),
            60, "both models", procs.logs,
        )  # fmt: skip
        assert httpx.get(procs.url + "/ready", timeout=5).json()["models_serving"] == 2
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()
        r = httpx.post(
            procs.url + "/v1/chat/completions",
            json={"model": "other", "messages": [{"role": "user", "content": "hi"}]},
            timeout=20,
        )
        assert r.status_code == 503, r.text
        assert httpx.get(procs.url + "/health", timeout=5).status_code == 503
        ready = httpx.get(procs.url + "/ready", timeout=5)
        assert ready.status_code == 200, ready.text
        assert ready.json() == {"status": "ready", "models_serving": 1}
    finally:
        procs.close()


def test_stream_migrates_when_its_worker_dies(procs: ProcessSet) -> None:
    procs.frontend("--migration-limit", "2")
    first = procs.worker("--engine", "echo", "--model-name", "echo", "--echo-delay-ms", "40")
    wait_until(lambda: len(instance_of(procs.url)) == 1, 60, "worker 1", procs.logs)
    first_id = instance_of(procs.url)[0]
    second = procs.worker("--engine", "echo", "--model-name", "echo", "--echo-delay-ms", "40")
    wait_until(lambda: len(instance_of(procs.url)) == 2, 60, "worker 2", procs.logs)
    # Round-robin starts at the lowest instance id.
    victim = (
        first if int(first_id, 16) == min(int(i, 16) for i in instance_of(procs.url)) else second
    )

    api = openai.OpenAI(base_url=procs.url + "/v1", api_key="unused", max_retries=0)
    stream = api.completions.create(
        model="echo", prompt="alpha beta gamma delta epsilon zeta eta theta", max_tokens=40,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    pieces: list[str] = []
    usage = None
    reasons = []
    for n, chunk in enumerate(stream):
        if n == 5:
            os.killpg(victim.pid, signal.SIGKILL)
        for choice in chunk.choices:
            pieces.append(choice.text)
            reasons.append(choice.finish_reason)
        usage = chunk.usage or usage
    assert reasons[-1] == "length"
    assert usage is not None and usage.completion_tokens == 40, "tokens were lost or repeated"
    assert "".join(pieces).startswith("alpha beta")
    metrics = httpx.get(procs.url + "/metrics").text
    assert 'turnout_migrations_total{model="echo"} 1.0' in metrics
