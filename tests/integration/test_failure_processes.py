"""Failures across real processes: a frozen worker (SIGSTOP) under streaming load, a mocker
whose step loop dies, an engine that is overloaded or refuses a request. Timeouts here are
short for speed but every assertion allows a generous margin for a slow 2-core CI."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.integration.procs import ProcessSet, health, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessSet]:
    ps = ProcessSet(tmp_path)
    yield ps
    for proc in ps.procs:  # a stopped process cannot die of SIGKILL's default until resumed
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)
    ps.close()


def instances(url: str, model: str) -> list[str]:
    return health(url).get(model, [])


def stream_completion(url: str, model: str, max_tokens: int, out: dict[str, object]) -> None:
    """One streamed completion; records its chunk count, finish reason, usage and errors."""
    body = {"model": model, "prompt": "alpha beta gamma delta epsilon zeta eta theta",
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "nvext": {"extra_fields": ["migrations"]}}  # fmt: skip
    start = time.monotonic()
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]
                    continue
                out["chunks"] = int(out.get("chunks", 0)) + 1  # type: ignore[call-overload]
                for choice in chunk.get("choices", []):
                    if choice.get("finish_reason"):
                        out["finish"] = choice["finish_reason"]
                    if (chunk.get("nvext") or {}).get("migrations") is not None:
                        out["migrations"] = chunk["nvext"]["migrations"]
                if chunk.get("usage"):
                    out["usage"] = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out["seconds"] = time.monotonic() - start


def run_streams(url: str, model: str, n: int, max_tokens: int) -> tuple[list[dict], list]:
    results: list[dict[str, object]] = [{} for _ in range(n)]
    threads = [
        threading.Thread(target=stream_completion, args=(url, model, max_tokens, results[i]))
        for i in range(n)
    ]
    for t in threads:
        t.start()
    return results, threads


def test_a_frozen_worker_costs_no_request(procs: ProcessSet) -> None:
    """SIGSTOP one of two echo workers under streaming load: every stream finishes, whole and
    within its deadline, by migrating off the frozen worker after the stall timeout."""
    procs.frontend("--migration-limit", "3", "--stall-timeout", "1.5", "--ttft-timeout", "4",
                   "--request-timeout", "40")  # fmt: skip
    a = procs.worker("--engine", "echo", "--model-name", "echo", "--echo-delay-ms", "25")
    wait_until(lambda: len(instances(procs.url, "echo")) == 1, 60, "worker A", procs.logs)
    procs.worker("--engine", "echo", "--model-name", "echo", "--echo-delay-ms", "25")
    wait_until(lambda: len(instances(procs.url, "echo")) == 2, 60, "worker B", procs.logs)

    results, threads = run_streams(procs.url, "echo", 8, 60)
    wait_until(lambda: all(r.get("chunks", 0) >= 3 for r in results), 30, "streams to flow")
    os.killpg(a.pid, signal.SIGSTOP)
    for t in threads:
        t.join(timeout=60)
    for r in results:
        assert r.get("status") == 200 and "error" not in r, (r, procs.logs())
        assert r.get("finish") == "length", r
        assert r.get("usage") == 60, f"tokens were lost or repeated: {r}"
        assert float(r["seconds"]) < 40, r  # type: ignore[arg-type]
    assert any(r.get("migrations") for r in results), results
    os.killpg(a.pid, signal.SIGCONT)


def test_a_mocker_whose_loop_fails_leaves_discovery_and_its_requests_migrate(
    tmp_path: Path,
) -> None:
    """The failing worker's instance leaves discovery at once (its lease TTL is 30 s), its
    in-flight streams finish on the other worker, and its process exits non-zero."""
    procs = ProcessSet(tmp_path, lease_ttl=30.0)
    try:
        procs.frontend("--migration-limit", "2")
        a = procs.worker("--engine", "mocker", "--model-name", "mock", "--fail-after-steps",
                         "40")  # fmt: skip
        wait_until(lambda: len(instances(procs.url, "mock")) == 1, 60, "worker A", procs.logs)
        a_id = instances(procs.url, "mock")[0]
        procs.worker("--engine", "mocker", "--model-name", "mock")
        wait_until(lambda: len(instances(procs.url, "mock")) == 2, 60, "worker B", procs.logs)

        results, threads = run_streams(procs.url, "mock", 6, 80)
        for t in threads:
            t.join(timeout=60)
        assert a.wait(timeout=30) not in (0, None), procs.logs()
        for r in results:
            assert r.get("status") == 200 and "error" not in r, (r, procs.logs())
            assert r.get("usage") == 80, f"tokens were lost or repeated: {r}"
        assert any(r.get("migrations") for r in results), results
        # Gone from discovery long before its 30 s lease could have run out.
        wait_until(lambda: a_id not in instances(procs.url, "mock"), 5, "A to leave")
        log = next(procs.tmp.glob("worker-1.log")).read_text()
        assert "engine failed" in log and "--fail-after-steps" in log, log[-3000:]
    finally:
        procs.close()


def test_engine_refusals_map_to_400_and_503(procs: ProcessSet) -> None:
    """``bad_request`` from the engine is a 400; ``overloaded`` (the waiting queue is full)
    a 503 with ``Retry-After``. One slow mocker worker: one running slot, one waiting."""
    procs.frontend()
    procs.worker("--engine", "mocker", "--model-name", "mock", "--max-num-seqs", "1",
                 "--max-waiting", "1", "--no-chunked-prefill", "--max-num-batched-tokens", "64",
                 "--block-size", "16", "--speedup-ratio", "0.02")  # fmt: skip
    wait_until(lambda: len(instances(procs.url, "mock")) == 1, 60, "worker", procs.logs)

    # Longer than one step's token budget with chunked prefill off: the engine refuses it.
    r = httpx.post(procs.url + "/v1/completions", timeout=30,
                   json={"model": "mock", "prompt": "word " * 200, "max_tokens": 2})  # fmt: skip
    assert r.status_code == 400, r.text
    assert "chunked prefill is off" in r.json()["error"]["message"]

    # One request runs (slowly), one waits; the next finds the queue full.
    running, _ = run_streams(procs.url, "mock", 1, 1000)
    wait_until(
        lambda: running[0].get("chunks", 0) >= 1, 60, "the first request to run",
        lambda: f"{running}\n{procs.logs()}",
    )  # fmt: skip
    run_streams(procs.url, "mock", 1, 1000)
    deadline = time.monotonic() + 60
    status = 0
    r = httpx.Response(0)
    while status != 503 and time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            r = httpx.post(procs.url + "/v1/completions", timeout=3,
                           json={"model": "mock", "prompt": "hi", "max_tokens": 2})  # fmt: skip
            status = r.status_code
        except httpx.ReadTimeout:
            # It took the waiting slot before the second request did; leaving cancels it.
            continue
    assert r.status_code == 503, r.text
    assert r.headers.get("retry-after"), r.headers
    assert "overloaded" in r.json()["error"]["message"]
