"""What workers' load reports cost a frontend: CPU seconds per report consumed.

A fleet of ``--workers`` workers (1,024 by default) each publishes load reports with a sample
of its engine steps (``--steps`` each, as the mocker sends), through an in-process event
plane, to the two consumers a KV-mode frontend runs: the model's ``KvRouter`` (busy view and
step-time fits) and a card's ``BusyReports`` (the simple modes' busy view). Reports arrive in
bursts of ``--burst`` per event-loop turn (the ZeroMQ plane's reader hands over up to 256 at
once), or one per turn with ``--burst 1``; a fleet reporting once a second puts ``workers``
reports a second through this path, so ``us_per_report * workers / 1e6`` is the share of a
core it takes.

The figure is process CPU time (``time.process_time``) from the first publish until both
consumers have drained, divided by the reports published (the publishing side, a loop of
``publish_nowait`` into in-process queues, is included and small). CPU time, not wall time:
the machine is shared. Run "before" and "after" trees interleaved (``PYTHONPATH``) and compare
ratios.

Usage: ``python benchmarks/load_reports.py [--workers N] [--reports N] [--steps N]
[--burst N] [--repeat N] [--label NAME]``; appends to ``benchmarks/results/load_reports.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from turnout.protocols.kv import LOAD_TOPIC, LoadReport, StepSample
from turnout.protocols.model import EndpointId
from turnout.router.instance_load import InstanceLoad
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.router import KvRouter
from turnout.router.load_reports import BusyReports
from turnout.runtime.event_plane.local import LocalEventPlane
from turnout.runtime.progress import track

RESULTS = Path(__file__).parent / "results" / "load_reports.json"
ENDPOINT = EndpointId(namespace="bench", component="backend", name="generate")


class Fleet:
    """The instance view the consumers read: a fixed set of workers."""

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids
        self._set = set(ids)

    def instance_ids(self) -> list[int]:
        return self._ids

    def announced_ids(self) -> set[int]:
        return self._set

    def add_listener(self, listener: Callable[[], None]) -> None:
        pass

    def remove_listener(self, listener: Callable[[], None]) -> None:
        pass


def make_payloads(workers: int, reports: int, steps: int, seed: int) -> list[bytes]:
    """``reports`` encoded reports of random workers, each with ``steps`` step samples."""
    rng = random.Random(seed)
    out = []
    for _ in range(reports):
        worker = rng.randrange(workers)
        samples = [
            StepSample(rng.randrange(0, 2048), rng.randrange(0, 64), rng.uniform(0.005, 0.05), 0.3)
            for _ in range(steps)
        ]
        report = LoadReport(
            worker_id=worker + 1,
            kv_usage=rng.random(),
            num_waiting=rng.randrange(8),
            num_running=rng.randrange(64),
            busy=rng.random() < 0.05,
            steps=samples,
            max_num_batched_tokens=8192,
        )
        out.append(msgspec.msgpack.encode(report))
    return out


async def run_once(payloads: list[bytes], workers: int, burst: int) -> float:
    """CPU seconds per report for one pass over ``payloads``."""
    plane = LocalEventPlane()
    fleet = Fleet(list(range(1, workers + 1)))
    router = KvRouter(
        KvRouterConfig(block_size=16, use_kv_events=False),
        fleet,  # type: ignore[arg-type]
        plane,
        ENDPOINT,
        share_active=False,
    )
    busy = BusyReports(plane, ENDPOINT, InstanceLoad(), announced=fleet._set.__contains__)
    await router.start()
    busy.start()
    pub = await plane.publisher(ENDPOINT.namespace, ENDPOINT.component)
    try:
        deadline = time.monotonic() + 10
        while len(plane._subscriptions) < 2:  # BusyReports subscribes in its task
            if time.monotonic() > deadline:
                raise RuntimeError("BusyReports did not subscribe")
            await asyncio.sleep(0.001)
        subs = list(plane._subscriptions)
        t0 = time.process_time()
        for i, payload in enumerate(payloads):
            pub.publish_nowait(LOAD_TOPIC, payload)
            if i % burst == burst - 1:
                await asyncio.sleep(0)
        deadline = time.monotonic() + 60
        while any(s.num_pending for s in subs):
            if time.monotonic() > deadline:
                raise RuntimeError("consumers did not drain")
            await asyncio.sleep(0)
        cpu = time.process_time() - t0
        dropped = sum(s.num_dropped for s in subs)
        if dropped:
            raise RuntimeError(f"{dropped} reports dropped: lower --burst or raise the bound")
        return cpu / len(payloads)
    finally:
        await pub.close()
        await busy.aclose()
        await router.close()
        await plane.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1024)
    parser.add_argument("--reports", type=int, default=20_000)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--burst", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    payloads = make_payloads(args.workers, args.reports, args.steps, seed=1)
    rows: list[dict[str, Any]] = []
    for burst in track(args.burst, "bursts", label=str):
        samples = [
            asyncio.run(run_once(payloads, args.workers, burst)) * 1e6 for _ in range(args.repeat)
        ]
        us = statistics.median(samples)
        row = {
            "label": args.label,
            "workers": args.workers,
            "reports": args.reports,
            "steps": args.steps,
            "burst": burst,
            "us_per_report_median": round(us, 2),
            "us_per_report_min": round(min(samples), 2),
            "core_share_at_1_report_per_worker_s": round(us * args.workers / 1e6, 4),
        }
        rows.append(row)
        print(json.dumps(row))
    RESULTS.parent.mkdir(exist_ok=True)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    old.append({"python": platform.python_version(), "time": time.time(), "rows": rows})
    RESULTS.write_text(json.dumps(old, indent=1) + "\n")


if __name__ == "__main__":
    main()
