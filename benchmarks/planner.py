"""Load-following benchmark: `turnout planner` against fixed fleets sized for the peak and for
the mean, under a day-shaped load.

The day: a ramp from night to the peak, the peak, a fall, a long night, a short burst (a
third of the peak, arriving at once) and night again, compressed into ``--duration`` seconds
of wall time (220 by default). The mocker runs at ``--speedup-ratio`` 3, so the day is 660 s
of mocker time (~10 minutes). Arrivals are Poisson at the curve's rate (seeded, the same for
every run); each request is a streamed ``/v1/completions`` of ``--isl`` random token ids
(no prefix is shared: the cache gives nothing away) and ``--osl`` output tokens
(``ignore_eos``), measured by the client: time to first token, mean inter-token latency
(last minus first token time over tokens - 1), status, and the usage's token count.

A mocker worker here is a small one: ``--max-num-seqs`` 4 running requests, a KV cache of
``--num-gpu-blocks`` 104 blocks of 16 tokens, so that its decode steps slow as its cache
fills (Dynamo's mocker timing); one worker sustains about 2 requests per second of wall
time within the targets, and the peak needs about six.

Three runs, one after another, each on a fresh stack (a frontend with ``--router-mode
least-loaded`` on a file store, tcp, zmq):

* ``planner``: ``turnout planner --connector local`` starts and stops the workers (one
  process each), deciding every ``--interval`` seconds;
* ``peak_fleet``: ``--peak-workers`` workers (6: the fewest that keep the targets at the
  peak here), for the whole day;
* ``mean_fleet``: the peak fleet scaled by the day's mean over its peak, rounded up.

Why least-loaded and not kv: the KV router's predicted TTFT does not count the wait for a
free batch slot, so with 4 slots a worker it thinks cheap may make a request wait a whole
decode (TTFT ~1 s at a fraction of the fleet's capacity); least-loaded counts requests in
flight, which is what a 4-slot worker is short of. The planner's decisions do not depend on
the router mode.

Reported per run: ``slo_attainment`` (requests with TTFT <= ``--ttft-slo`` and mean ITL <=
``--itl-slo``, over all requests sent), ``worker_seconds`` (live instances in the frontend's
``/health``, sampled every 0.5 s, integrated over the day; a fixed fleet's is its size times
the day), ``failed`` (not 200 and not a refusal, a broken stream, no ``[DONE]``, or fewer
tokens than asked), ``rejected`` (429 or 503), ``scaling_actions`` (the planner's
``turnout_planner_scaling_actions_total``; 0 for fixed fleets), and TTFT/ITL percentiles.
Printed as a table, written to ``--out`` (JSON) and plotted beside it (PNG: offered load,
live workers of each run, and TTFT p90 per 5 s against the target).

Usage::

    python benchmarks/planner.py --out benchmarks/results/planner.json     # ~13 minutes
    python benchmarks/planner.py --quick --out /tmp/planner.json             # ~4 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from tests.integration.procs import ProcessSet, health, wait_until  # noqa: E402

from process_groups import stop_process_groups  # noqa: E402
from turnout.frontend.service import free_port  # noqa: E402

MODEL = "day"
#: The day, as (start, end, rate at start, rate at end) in fractions of the duration and of
#: the peak rate.
DAY = (
    (0.00, 0.14, 0.15, 1.00),  # morning ramp
    (0.14, 0.28, 1.00, 1.00),  # peak
    (0.28, 0.42, 1.00, 0.10),  # evening fall
    (0.42, 0.78, 0.10, 0.10),  # night
    (0.78, 0.82, 0.45, 0.45),  # a burst
    (0.82, 1.00, 0.10, 0.10),  # night again
)


def rate_at(fraction: float) -> float:
    """The curve's rate (a fraction of the peak) at ``fraction`` of the day."""
    for start, end, r0, r1 in DAY:
        if start <= fraction < end:
            return r0 + (r1 - r0) * (fraction - start) / (end - start)
    return DAY[-1][3]


def mean_rate() -> float:
    """The day's mean rate as a fraction of the peak (the segments are linear)."""
    return sum((end - start) * (r0 + r1) / 2 for start, end, r0, r1 in DAY)


@dataclass
class Outcome:
    sent: float
    status: int | None = None
    ttft: float | None = None
    itl: float | None = None
    tokens: int = 0
    done: bool = False
    error: str | None = None


async def one_request(
    session: aiohttp.ClientSession, url: str, prompt: list[int], osl: int, out: Outcome
) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": osl, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    first = last = None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            out.status = resp.status
            if resp.status != 200:
                await resp.read()
                return
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    out.done = True
                elif line.startswith(b"data: "):
                    now = time.monotonic()
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        first = first or now
                        last = now
                    if chunk.get("usage"):
                        out.tokens = chunk["usage"]["completion_tokens"]
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = repr(exc)
    if first is not None:
        out.ttft = first - out.sent
        if last is not None and out.tokens > 1:
            out.itl = (last - first) / (out.tokens - 1)


async def offer_the_day(
    url: str, peak: float, duration: float, isl: int, osl: int, seed: int
) -> tuple[list[Outcome], float]:
    """Open-loop arrivals over the day; returns when every request has ended."""
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task[None]] = []
    timeout = aiohttp.ClientTimeout(total=180, sock_connect=10)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        start = time.monotonic()
        at = 0.0
        while True:
            at += rng.expovariate(peak * rate_at(at / duration))
            if at >= duration:
                break
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = Outcome(time.monotonic())
            outcomes.append(outcome)
            prompt = [rng.randrange(100, 30000) for _ in range(isl)]
            tasks.append(asyncio.create_task(one_request(session, url, prompt, osl, outcome)))
        await asyncio.gather(*tasks)
    return outcomes, start


@dataclass
class Run:
    name: str
    outcomes: list[Outcome]
    start: float
    workers: list[tuple[float, int]]
    scaling_actions: int
    fixed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def result(self, args: argparse.Namespace) -> dict[str, Any]:
        ok = [o for o in self.outcomes if o.status == 200 and o.done and o.tokens == args.osl]
        rejected = [o for o in self.outcomes if o.status in (429, 503)]
        met = [
            o for o in ok
            if o.ttft is not None and o.ttft <= args.ttft_slo and (o.itl or 0.0) <= args.itl_slo
        ]  # fmt: skip
        if self.fixed is not None:
            worker_seconds = self.fixed * args.duration
        else:
            points = [(t - self.start, n) for t, n in self.workers if t >= self.start]
            worker_seconds = sum(
                n * (min(t1, args.duration) - t0)
                for (t0, n), (t1, _) in itertools.pairwise(points)
                if t0 < args.duration
            )
        ttfts = sorted(o.ttft for o in ok if o.ttft is not None)
        itls = sorted(o.itl for o in ok if o.itl is not None)
        return {
            "slo_attainment": round(len(met) / max(len(self.outcomes), 1), 4),
            "worker_seconds": round(worker_seconds, 1),
            "failed": len(self.outcomes) - len(ok) - len(rejected),
            "rejected": len(rejected),
            "scaling_actions": self.scaling_actions,
            "requests": len(self.outcomes),
            "ttft_p50_s": _pct(ttfts, 0.5),
            "ttft_p90_s": _pct(ttfts, 0.9),
            "ttft_p99_s": _pct(ttfts, 0.99),
            "itl_p50_s": _pct(itls, 0.5),
            "itl_p90_s": _pct(itls, 0.9),
            "max_workers": max((n for _, n in self.workers), default=self.fixed or 0),
            **self.extra,
        }


def _pct(values: list[float], q: float) -> float | None:
    return round(values[min(len(values) - 1, int(q * len(values)))], 4) if values else None


def worker_flags(args: argparse.Namespace) -> list[str]:
    return ["--engine", "mocker", "--model-name", MODEL,
            "--speedup-ratio", str(args.speedup_ratio), "--max-num-seqs", str(args.max_num_seqs),
            "--num-gpu-blocks", str(args.num_gpu_blocks), "--block-size", "16",
            "--drain-timeout", "30"]  # fmt: skip


def kill_leftovers(procs: ProcessSet) -> None:
    """Workers a planner started run in sessions of their own."""
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if procs.store_path in " ".join(proc.info["cmdline"] or []):
                proc.kill()


def run_one(name: str, args: argparse.Namespace, fixed: int | None) -> Run:
    tmp = Path(tempfile.mkdtemp(prefix=f"planner-bench-{name}-"))
    procs = ProcessSet(tmp, lease_ttl=3.0)
    planner_port = free_port()
    try:
        procs.frontend("--router-mode", "least-loaded")
        if fixed is None:
            i = args.interval
            procs._spawn(
                ["planner", "--connector", "local", "--ttft-slo", str(args.ttft_slo),
                 "--itl-slo", str(args.itl_slo), "--interval", str(i),
                 "--up-cooldown", str(2 * i), "--down-cooldown", str(3 * i),
                 "--scale-down-after", str(3 * i), "--min-replicas", "1",
                 "--max-replicas", str(args.peak_workers + 2), "--frontend-url", procs.url,
                 "--port", str(planner_port), *procs.common(), *worker_flags(args)],
                "planner",
            )  # fmt: skip
            wait_until(lambda: len(health(procs.url).get(MODEL, [])) >= 1, 90,
                       "the planner's first worker", procs.logs)  # fmt: skip
        else:
            procs.worker(*worker_flags(args), "--num-workers", str(fixed))
            wait_until(lambda: len(health(procs.url).get(MODEL, [])) == fixed, 90,
                       f"{fixed} workers", procs.logs)  # fmt: skip
        samples: list[tuple[float, int]] = []

        async def day() -> tuple[list[Outcome], float]:
            stop = asyncio.Event()

            async def sample() -> None:
                async with httpx.AsyncClient(timeout=2) as client:
                    while not stop.is_set():
                        try:
                            body = (await client.get(procs.url + "/health")).json()
                            live = {m["name"]: m["instances"] for m in body["models"]}
                            samples.append((time.monotonic(), len(live.get(MODEL, []))))
                        except (httpx.HTTPError, ValueError, KeyError):
                            pass  # a missed sample: the integral uses the previous one
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), 0.5)

            sampler = asyncio.create_task(sample())
            try:
                return await offer_the_day(procs.url, args.peak_rate, args.duration, args.isl,
                                           args.osl, args.seed)  # fmt: skip
            finally:
                stop.set()
                await sampler

        outcomes, start = asyncio.run(day())
        actions = 0
        extra: dict[str, Any] = {}
        if fixed is None:
            text = httpx.get(f"http://127.0.0.1:{planner_port}/metrics", timeout=5).text
            actions = round(sum(
                float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("turnout_planner_scaling_actions_total{")
            ))  # fmt: skip
            decisions = httpx.get(
                f"http://127.0.0.1:{planner_port}/planner/decisions", timeout=5
            ).json()["decisions"]
            first = decisions[0]["at"] if decisions else 0.0
            extra["decisions"] = [
                {"t": round(d["at"] - first, 1), "action": d["action"], "current": d["current"],
                 "chosen": d["chosen"], "reasons": d["reasons"],
                 "per_worker_rps": d["capacity"]["per_worker_rps"],
                 "capacity_source": d["capacity"]["source"], "correction": d["correction"]}
                for d in decisions if d["action"] != "hold"
            ]  # fmt: skip
        return Run(name, outcomes, start, samples, actions, fixed, extra)
    finally:
        stop_process_groups(procs.procs)
        kill_leftovers(procs)


def table(results: dict[str, dict[str, Any]]) -> str:
    head = f"{'run':<11} {'attain':>7} {'worker-s':>9} {'failed':>7} {'rejected':>9} {'actions':>8} {'ttft p90':>9} {'itl p90':>8} {'max w':>6}"  # noqa: E501
    lines = [head]
    for name, r in results.items():
        lines.append(
            f"{name:<11} {r['slo_attainment']:>7.4f} {r['worker_seconds']:>9.1f} "
            f"{r['failed']:>7} {r['rejected']:>9} {r['scaling_actions']:>8} "
            f"{r['ttft_p90_s'] or 0:>9.3f} {r['itl_p90_s'] or 0:>8.4f} {r['max_workers']:>6}"
        )
    return "\n".join(lines)


def plot(runs: list[Run], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    xs = [args.duration * i / 400 for i in range(401)]
    ax1.plot(xs, [args.peak_rate * rate_at(x / args.duration) for x in xs], color="black")
    ax1.set_ylabel("offered load (req/s)")
    ax1.set_title(f"a day in {args.duration:.0f} s (mocker speedup {args.speedup_ratio:g})")
    for run in runs:
        points = [(t - run.start, n) for t, n in run.workers if 0 <= t - run.start <= args.duration]
        ax2.step([p[0] for p in points], [p[1] for p in points], where="post", label=run.name)
    ax2.set_ylabel("live workers")
    ax2.legend(loc="upper right")
    for run in runs:
        bins: dict[int, list[float]] = {}
        for o in run.outcomes:
            if o.ttft is not None:
                bins.setdefault(int((o.sent - run.start) // 5), []).append(o.ttft)
        keys = sorted(bins)
        ax3.plot([k * 5 + 2.5 for k in keys],
                 [sorted(bins[k])[int(0.9 * (len(bins[k]) - 1))] for k in keys],
                 label=run.name)  # fmt: skip
    ax3.axhline(args.ttft_slo, color="red", linestyle="--", label="TTFT target")
    ax3.set_yscale("log")
    ax3.set_ylabel("TTFT p90 per 5 s (s)")
    ax3.set_xlabel("seconds into the day")
    ax3.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/planner.json"))
    p.add_argument("--quick", action="store_true", help="a 70 s day, for a smoke run")
    p.add_argument("--duration", type=float, default=220.0, help="seconds of wall time a day takes")
    p.add_argument("--peak-rate", type=float, default=10.0, help="requests/s at the peak")
    p.add_argument("--peak-workers", type=int, default=6, help="the peak-sized fleet")
    p.add_argument("--speedup-ratio", type=float, default=3.0)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--num-gpu-blocks", type=int, default=104)
    p.add_argument("--isl", type=int, default=256)
    p.add_argument("--osl", type=int, default=128)
    p.add_argument("--ttft-slo", type=float, default=0.25)
    p.add_argument("--itl-slo", type=float, default=0.025)
    p.add_argument("--interval", type=float, default=2.0, help="the planner's, seconds")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--runs", nargs="+", default=["planner", "peak_fleet", "mean_fleet"],
                   choices=["planner", "peak_fleet", "mean_fleet"])  # fmt: skip
    args = p.parse_args(argv)
    if args.quick:
        args.duration = 70.0
    mean_workers = math.ceil(args.peak_workers * mean_rate())
    sizes = {"planner": None, "peak_fleet": args.peak_workers, "mean_fleet": mean_workers}
    runs: list[Run] = []
    results: dict[str, dict[str, Any]] = {}
    began = time.monotonic()
    for name in args.runs:
        print(f"{name}: a {args.duration:.0f} s day ...", flush=True)
        run = run_one(name, args, sizes[name])
        runs.append(run)
        results[name] = run.result(args)
    report: dict[str, Any] = dict(results)
    peak = results.get("peak_fleet")
    planner = results.get("planner")
    if peak and planner:
        report["planner_vs_peak"] = {
            "attainment_ratio": round(
                planner["slo_attainment"] / max(peak["slo_attainment"], 1e-9), 4
            ),
            "worker_seconds_ratio": round(planner["worker_seconds"] / peak["worker_seconds"], 4),
            "goals": "attainment ratio >= 0.95, worker-seconds ratio <= 0.60, no failed request",
        }
    report["setup"] = {
        "day": [list(seg) for seg in DAY], "mean_over_peak": round(mean_rate(), 4),
        "mean_fleet_workers": mean_workers, "wall_seconds": round(time.monotonic() - began, 1),
        **{k: v for k, v in vars(args).items() if k not in ("out", "runs")},
    }  # fmt: skip
    print(table(results))
    if "planner_vs_peak" in report:
        print(json.dumps(report["planner_vs_peak"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    plot(runs, args, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
