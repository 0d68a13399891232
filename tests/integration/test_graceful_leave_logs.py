"""A worker that leaves on purpose (SIGTERM) makes its frontend log nothing at WARNING or
above: the instance record deleted is a normal leave, said at info at most. Real processes:
a frontend routing by KV events and two slow mocker workers fed prompts long enough to fill
cache blocks (so KV events flow), one of them stopped while streams run on both."""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.integration.procs import ProcessSet, health, wait_until

pytestmark = pytest.mark.slow

PROMPT = " ".join(f"word{i}" for i in range(150))
ALARMING = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) ", re.MULTILINE)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessSet]:
    ps = ProcessSet(tmp_path)
    yield ps
    ps.close()


def complete(url: str, model: str, n: int, max_tokens: int, statuses: list[int]) -> None:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": model, "prompt": f"{PROMPT} {n}", "max_tokens": max_tokens},
        timeout=120,
    )
    statuses.append(r.status_code)


def test_a_worker_stopped_with_sigterm_logs_nothing_alarming(procs: ProcessSet) -> None:
    frontend = procs.frontend("--router-mode", "kv")
    leaving = procs.worker("--engine", "mocker", "--speedup-ratio", "0.2")
    procs.worker("--engine", "mocker", "--speedup-ratio", "0.2")

    def both_served() -> bool:
        served = health(procs.url)
        return len(served) == 1 and len(next(iter(served.values()))) == 2

    wait_until(both_served, 60, "two workers", procs.logs)
    model = next(iter(health(procs.url)))
    statuses: list[int] = []
    for n in range(4):  # cache blocks on both workers: KV events flow from each
        complete(procs.url, model, n, 2, statuses)
    streams = [
        threading.Thread(target=complete, args=(procs.url, model, 10 + n, 30, statuses))
        for n in range(4)
    ]
    for thread in streams:
        thread.start()

    def all_streaming() -> bool:
        metrics = httpx.get(procs.url + "/metrics", timeout=5).text
        line = f'turnout_inflight_requests{{model="{model}"}} '
        return any(m.startswith(line) and float(m[len(line):]) >= 4 for m in metrics.splitlines())

    # The leave must happen with streams in flight, else it shows nothing of their failover.
    wait_until(all_streaming, 30, "four streams in flight", procs.logs)
    leaving.send_signal(signal.SIGTERM)
    assert leaving.wait(timeout=60) == 0
    for thread in streams:
        thread.join(120)
    wait_until(lambda: len(next(iter(health(procs.url).values()))) == 1, 30, "the leave")
    for n in range(4):
        complete(procs.url, model, 20 + n, 2, statuses)
    assert statuses == [200] * len(statuses), statuses

    frontend.send_signal(signal.SIGTERM)
    assert frontend.wait(timeout=60) == 0
    log = "\n".join(p.read_text() for p in procs.tmp.glob("frontend-*.log"))
    assert not ALARMING.findall(log), "\n".join(
        line for line in log.splitlines() if ALARMING.match(line + "\n")
    )
