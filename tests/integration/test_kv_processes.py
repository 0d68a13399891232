"""KV routing across real processes: a frontend in kv mode, mocker workers in another
process, KV events over ZeroMQ found through the file store."""

from __future__ import annotations

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
    ps.close()


def test_prefix_follows_its_worker_across_processes(procs: ProcessSet) -> None:
    procs.frontend("--router-mode", "kv")
    procs.worker("--engine", "mocker", "--num-workers", "3", "--model-name", "mock",
                 "--block-size", "16", "--num-gpu-blocks", "512",
                 "--speedup-ratio", "0")  # fmt: skip
    wait_until(lambda: len(health(procs.url).get("mock", [])) == 3, 60, "3 mocker workers",
               procs.logs)  # fmt: skip
    prompt = [7000 + i for i in range(256)]
    body = {"model": "mock", "prompt": prompt, "max_tokens": 2,
            "nvext": {"extra_fields": ["worker_id", "routing"]}}  # fmt: skip
    first = httpx.post(procs.url + "/v1/completions", json=body, timeout=30).json()
    home = first["nvext"]["worker_id"]
    # The worker's KV events travel over zmq; wait until the router has them.
    deadline = time.monotonic() + 10
    while True:
        out = httpx.post(procs.url + "/v1/completions", json=body, timeout=30).json()
        if out["nvext"]["routing"]["overlap_blocks"] == 16 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert out["nvext"]["routing"]["overlap_blocks"] == 16, procs.logs()
    assert out["nvext"]["worker_id"] == home
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 240
    metrics = httpx.get(procs.url + "/metrics").text
    assert 'turnout_kv_events_applied_total{model="mock"}' in metrics
