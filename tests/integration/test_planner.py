"""``turnout planner --connector local`` end to end: a real frontend, real planner processes and
the mocker workers they start and stop, on a file store, tcp and zmq.

* a load step up adds workers, and the TTFT clients see comes back under the target;
* a step down drains and removes them, with every stream whole;
* two planners: only the leader acts; when it is killed, the other takes over the workers it
  left (they run in sessions of their own) and acts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from tests.integration.procs import ProcessSet, health, wait_until

from turnout.frontend.service import free_port

pytestmark = pytest.mark.timeout(240)

MODEL = "planned"
TTFT_SLO = 0.5


@dataclass
class Stack:
    procs: ProcessSet
    planners: list[tuple[subprocess.Popen[bytes], int]] = field(default_factory=list)

    def planner(self, *extra: str) -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        proc = self.procs._spawn(
            ["planner", "--connector", "local", "--ttft-slo", str(TTFT_SLO), "--itl-slo", "0.1",
             "--interval", "1", "--up-cooldown", "2", "--down-cooldown", "3",
             "--scale-down-after", "3", "--max-replicas", "4", "--port", str(port),
             "--frontend-url", self.procs.url, *self.procs.common(),
             "--engine", "mocker", "--model-name", MODEL, "--max-num-seqs", "2",
             "--drain-timeout", "10", *extra],
            "planner",
        )  # fmt: skip
        self.planners.append((proc, port))
        return proc, port

    def instances(self) -> int:
        return len(health(self.procs.url).get(MODEL, []))


def decisions(port: int) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"http://127.0.0.1:{port}/planner/decisions", timeout=5).json()
    return body


def actions(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("turnout_planner_scaling_actions_total{")
    )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    procs = ProcessSet(tmp_path, lease_ttl=2.0)
    s = Stack(procs)
    try:
        procs.frontend("--router-mode", "kv")
        yield s
    finally:
        procs.close()
        # Workers a planner started run in sessions of their own, and outlive a killed planner.
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if procs.store_path in " ".join(p.info["cmdline"] or []):
                    p.kill()


@dataclass
class Outcome:
    started: float
    ttft: float | None = None
    tokens: int = 0
    error: str | None = None


async def _one(client: openai.AsyncOpenAI, max_tokens: int, out: list[Outcome]) -> None:
    outcome = Outcome(time.monotonic())
    out.append(outcome)
    try:
        stream = await client.completions.create(
            model=MODEL, prompt=[random.randrange(100, 30000) for _ in range(64)],
            max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and outcome.ttft is None:
                outcome.ttft = time.monotonic() - outcome.started
            if chunk.usage is not None:
                outcome.tokens = chunk.usage.completion_tokens
    except Exception as exc:
        outcome.error = repr(exc)


async def load(url: str, rate: float, seconds: float, max_tokens: int) -> list[Outcome]:
    """Poisson arrivals at ``rate`` for ``seconds``; waits for every request to end."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    out: list[Outcome] = []
    tasks = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tasks.append(asyncio.create_task(_one(client, max_tokens, out)))
        await asyncio.sleep(random.expovariate(rate))
    await asyncio.gather(*tasks)
    await client.close()
    return out


def kv_workers(url: str) -> set[str]:
    """The workers the frontend's KV router keeps state for (its per-worker series)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return set(re.findall(r'^turnout_kv_worker_step_model\{[^}]*worker="([0-9a-f]+)"', text, re.M))


def status_planners(stack: Stack) -> list[dict[str, Any]]:
    """``turnout status --json``'s planners."""
    out = subprocess.run(
        [sys.executable, "-m", "turnout", "status", "--json", "--load-wait", "0",
         *stack.procs.common()],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    planners: list[dict[str, Any]] = json.loads(out.stdout)["planners"]
    return planners


def p90(values: list[float]) -> float:
    values = sorted(values)
    return values[int(0.9 * (len(values) - 1))]


def test_step_up_adds_workers_and_step_down_drains_them(stack: Stack) -> None:
    _, port = stack.planner()
    url = stack.procs.url
    wait_until(lambda: stack.instances() == 1, 60, "the planner's first worker", stack.procs.logs)

    async def step_up() -> tuple[list[Outcome], list[Outcome]]:
        # One worker runs two requests at a time (~0.35 s each): 12/s needs three or more.
        before = await load(url, 12.0, 6.0, 60)
        wait_until(lambda: stack.instances() >= 3, 60, "workers added", stack.procs.logs)
        # TTFT recovers: a window of requests after the scale-up meets the target.
        deadline = time.monotonic() + 60
        while True:
            after = await load(url, 12.0, 3.0, 60)
            ttfts = [o.ttft for o in after if o.ttft is not None]
            if ttfts and p90(ttfts) < TTFT_SLO:
                return before, after
            assert time.monotonic() < deadline, f"TTFT p90 stayed {p90(ttfts):.3f}s"

    before, after = asyncio.run(step_up())
    up = decisions(port)["decisions"]
    assert any(d["action"] == "scale_up" and d["acted"] for d in up)
    assert any(r.startswith("slo: ttft") for d in up for r in d["reasons"]), up
    peak = stack.instances()
    known = kv_workers(url)
    assert len(known) >= 2, known  # the KV router holds state for the workers added

    async def step_down() -> list[Outcome]:
        # Few, long streams while the planner sheds workers: they run on workers being drained.
        return await load(url, 1.0, 12.0, 400)

    down = asyncio.run(step_down())
    wait_until(lambda: stack.instances() == 1, 60, "workers removed", stack.procs.logs)
    entries = decisions(port)["decisions"]
    assert any(d["action"] == "scale_down" and d["acted"] for d in entries)
    every = [*before, *after, *down]
    failed = [o for o in every if o.error is not None]
    assert not failed, failed[:3]
    short = [o for o in [*before, *after] if o.tokens != 60] + [o for o in down if o.tokens != 400]
    assert not short, short[:3]
    assert peak >= 3
    # The KV router forgot the removed workers.
    wait_until(
        lambda: kv_workers(url) <= set(health(url)[MODEL]),
        30,
        "the KV router to forget them",
        lambda: f"{kv_workers(url)} {health(url)}",
    )
    # The drained workers' processes are gone, not merely out of discovery.
    workers = [
        p for p in psutil.process_iter(["cmdline"])
        if stack.procs.store_path in " ".join(p.info["cmdline"] or [])
        and "worker" in p.info["cmdline"]
    ]  # fmt: skip
    wait_until(
        lambda: (
            sum(1 for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE) == 1
        ),
        60,
        "the drained workers to exit",
    )


def test_two_planners_only_the_leader_acts_and_the_other_takes_over(stack: Stack) -> None:
    first, first_port = stack.planner()
    wait_until(lambda: decisions(first_port)["leader"], 60, "the first planner to lead")
    wait_until(lambda: stack.instances() == 1, 60, "the leader's first worker", stack.procs.logs)
    _, second_port = stack.planner()
    wait_until(lambda: decisions(second_port)["decisions"], 60, "the second planner's decisions")
    assert not decisions(second_port)["leader"]
    assert decisions(second_port)["leading_planner"]["pid"] == first.pid
    # The stand-by decides and explains, but never acts.
    assert all(not d["acted"] for d in decisions(second_port)["decisions"])
    assert actions(second_port) == 0
    assert stack.instances() == 1
    assert [(p["pid"], p["leader"]) for p in status_planners(stack)] == [
        (first.pid, True),
        (stack.planners[1][0].pid, False),
    ]

    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    wait_until(lambda: decisions(second_port)["leader"], 30, "the second planner to lead")
    # It adopts the worker the first one left: one worker, none started.
    assert stack.instances() == 1
    assert actions(second_port) == 0
    # And it acts: the worker dies, the pool is under its minimum, the new leader starts one.
    (orphan,) = [
        p for p in psutil.process_iter(["cmdline"])
        if stack.procs.store_path in " ".join(p.info["cmdline"] or [])
        and "worker" in p.info["cmdline"]
    ]  # fmt: skip
    orphan.kill()
    wait_until(lambda: actions(second_port) >= 1, 60, "the new leader to act", stack.procs.logs)
    wait_until(lambda: stack.instances() == 1, 60, "a replacement worker", stack.procs.logs)
    wait_until(lambda: len(status_planners(stack)) == 1, 30, "the dead planner's candidacy to end")
    assert [(p["pid"], p["leader"]) for p in status_planners(stack)] == [
        (stack.planners[1][0].pid, True)
    ]
    last = [d for d in decisions(second_port)["decisions"] if d["acted"]][-1]
    assert last["action"] == "scale_up" and "bound: min 1" in last["reasons"], last


def _run_planner(tmp: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnout", "planner", "--store", "file", "--store-path",
         str(tmp / "s.sqlite"), "--port", "0", *args],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "TURNOUT_LOG_LEVEL": "INFO"},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ttft-slo", "1", "--itl-slo", "0.1"], "--connector is required"),
        (["--connector", "local", "--itl-slo", "0.1"], "--ttft-slo is required"),
        (["--connector", "local", "--ttft-slo", "0", "--itl-slo", "0.1"], "--ttft-slo must be"),
        (
            ["--connector", "local", "--ttft-slo", "1", "--itl-slo", "0.1", "--deployment", "x=y"],
            "--deployment is the kubernetes connector's",
        ),
        (
            [
                "--connector",
                "metrics-only",
                "--ttft-slo",
                "1",
                "--itl-slo",
                "0.1",
                "--max-num-seqs",
                "4",
            ],
            "--max-num-seqs: worker flags are for --connector local",
        ),
        (
            [
                "--connector",
                "local",
                "--ttft-slo",
                "1",
                "--itl-slo",
                "0.1",
                "--min-replicas",
                "3",
                "--max-replicas",
                "2",
            ],
            "--max-replicas 2 of pool aggregated is below its --min-replicas 3",
        ),
        (
            [
                "--connector",
                "local",
                "--ttft-slo",
                "1",
                "--itl-slo",
                "0.1",
                "--min-replicas",
                "gpu=2",
            ],
            "--min-replicas: unknown pool 'gpu'",
        ),
        (
            ["--connector", "kubernetes", "--ttft-slo", "1", "--itl-slo", "0.1"],
            "--connector kubernetes needs --deployment",
        ),
        (
            ["--connector", "local", "--ttft-slo", "1", "--itl-slo", "0.1", "--season", "3600"],
            "--season is the seasonal-naive predictor's; this planner runs --predictor "
            "moving-average",
        ),
        (
            [
                "--connector",
                "local",
                "--ttft-slo",
                "1",
                "--itl-slo",
                "0.1",
                "--predictor",
                "last",
                "--predictor-window",
                "3",
            ],
            "--predictor-window is the moving-average predictor's",
        ),
    ],
)
def test_bad_flags_exit_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    result = _run_planner(tmp_path, *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_profile_file_errors_name_the_file(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"prefill_tokens_per_s": -1, "decode_tokens_per_s": 10}))
    result = _run_planner(
        tmp_path, "--connector", "local", "--ttft-slo", "1", "--itl-slo", "0.1",
        "--profile", str(profile),
    )  # fmt: skip
    assert result.returncode == 2
    assert f"--profile {profile}: aggregated.prefill_tokens_per_s must be a number above 0" in (
        result.stderr
    )


def test_dry_run_and_metrics_only_decide_but_never_start_a_worker(stack: Stack) -> None:
    """A dry run explains what it would do; the metrics-only connector exports it."""
    port = free_port()
    proc = stack.procs._spawn(
        ["planner", "--connector", "metrics-only", "--ttft-slo", "0.5", "--itl-slo", "0.1",
         "--interval", "1", "--min-replicas", "2", "--port", str(port),
         "--frontend-url", stack.procs.url, *stack.procs.common()],
        "planner",
    )  # fmt: skip
    dry, dry_port = stack.planner("--dry-run", "--min-replicas", "3")
    wait_until(
        lambda: (
            'turnout_planner_desired_replicas{pool="aggregated"} 2.0'
            in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        ),
        60,
        "the desired replicas gauge",
        stack.procs.logs,
    )
    wait_until(lambda: decisions(dry_port)["decisions"], 60, "the dry run's decisions")
    entry = decisions(dry_port)["decisions"][-1]
    assert entry["chosen"] == 3 and entry["current"] == 0 and not entry["acted"]
    assert "dry run: not acting" in entry["reasons"]
    assert decisions(dry_port)["dry_run"] is True
    assert stack.instances() == 0
    assert proc.poll() is None and dry.poll() is None
