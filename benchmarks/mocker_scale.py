"""How many simulated mocker workers one Python process can run, and where the CPU goes.

For each worker count (default 8, 32, 64) and speedup (default 0: as fast as possible; 1: real
time; 10: ten times real time), start N ``MockerEngine`` workers in one event loop and drive them
directly through ``generate`` for a fixed wall time, with a fixed number of requests in
flight per worker. Prompts share prefixes (a few system prompts + a unique tail), so the
prefix cache and KV events are exercised. Reported per run:

* simulated requests/s and output tokens/s (wall clock),
* CPU seconds per simulated token (``time.process_time``),
* at speedup > 0, whether the simulation keeps up: ``behind_pct`` is the share of wall time
  the workers' loops fell behind real time and wrote off (0: keeping up), and
  ``sim_utilisation`` the share of wall time the workers' simulated GPU was busy.

One extra run under cProfile (the largest worker count, speedup 0) shows where the CPU goes.
Writes a table to stdout and JSON to ``benchmarks/results/mocker_scale.json``.

    .venv/bin/python benchmarks/mocker_scale.py                # ~1 min
    .venv/bin/python benchmarks/mocker_scale.py --seconds 2 --workers 8 64 --speedups 0
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import random
import time
from pathlib import Path
from typing import Any

from turnout.engines.mocker import MockerConfig, MockerEngine, MockerStats, make_mocker_engines
from turnout.protocols.llm import PreprocessedRequest, StopConditions
from turnout.runtime.context import RequestContext
from turnout.runtime.progress import track

RESULTS = Path(__file__).parent / "results" / "mocker_scale.json"


class CountingSink:
    """Counts KV event batches and load reports (what an event-plane publisher would get)."""

    def __init__(self) -> None:
        self.kv_events = 0
        self.loads = 0

    def publish_kv(self, batch: Any) -> None:
        self.kv_events += len(batch.events)

    def publish_load(self, report: Any) -> None:
        self.loads += 1


def make_prompts(num_prefixes: int, prefix_len: int, tail_len: int, count: int) -> list[list[int]]:
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 30000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        prefixes[i % num_prefixes] + [rng.randrange(1, 30000) for _ in range(tail_len)]
        for i in range(count)
    ]


async def drive(
    num_workers: int, speedup: float, seconds: float, args: argparse.Namespace
) -> dict[str, Any]:
    config = MockerConfig(
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        speedup_ratio=speedup,
    )
    sink = CountingSink()
    engines = make_mocker_engines(config, num_workers, sink=sink)
    for engine in engines:
        await engine.start()
    prompts = make_prompts(args.prefixes, args.prefix_len, args.tail_len, 512)
    done = {"requests": 0, "tokens": 0, "cached": 0, "prompt": 0}
    stop_at = time.perf_counter() + seconds

    async def client(engine: MockerEngine, k: int) -> None:
        i = k
        while time.perf_counter() < stop_at:
            request = PreprocessedRequest(
                model="mock",
                token_ids=prompts[i % len(prompts)],
                stop_conditions=StopConditions(max_tokens=args.max_tokens, ignore_eos=True),
            )
            i += 7
            async for out in engine.generate(request, RequestContext()):
                done["tokens"] += len(out.token_ids)
                if out.usage is not None:
                    done["requests"] += 1
                    done["prompt"] += out.usage.prompt_tokens
                    done["cached"] += out.usage.cached_tokens or 0

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(
        *(client(e, w * 1000 + k) for w, e in enumerate(engines) for k in range(args.inflight))
    )
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    stats = MockerStats()
    for engine in engines:
        stats = stats.add(engine.get_stats())
        await engine.stop()
    tokens = max(done["tokens"], 1)
    return {
        "workers": num_workers,
        "speedup": speedup,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "requests": done["requests"],
        "tokens": done["tokens"],
        "requests_per_s": round(done["requests"] / wall, 1),
        "tokens_per_s": round(done["tokens"] / wall, 1),
        "cpu_us_per_token": round(cpu / tokens * 1e6, 2),
        "steps": stats.num_steps,
        "cache_hit_rate": round(done["cached"] / max(done["prompt"], 1), 3),
        "behind_pct": round(stats.late_s / num_workers / wall * 100, 2) if speedup else None,
        "sim_utilisation": (
            round(stats.simulated_s / speedup / num_workers / wall, 3) if speedup else None
        ),
        "kv_events": sink.kv_events,
        "load_reports": sink.loads,
    }


def profile(num_workers: int, seconds: float, args: argparse.Namespace, top: int) -> list[str]:
    prof = cProfile.Profile()
    prof.enable()
    asyncio.run(drive(num_workers, 0.0, seconds, args))
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    return lines[start : start + top + 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--speedups", type=float, nargs="+", default=[0.0, 1.0, 10.0])
    p.add_argument("--seconds", type=float, default=5.0, help="wall time of each run")
    p.add_argument("--inflight", type=int, default=8, help="requests in flight per worker")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--tail-len", type=int, default=128)
    p.add_argument("--num-gpu-blocks", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--profile-seconds", type=float, default=4.0, help="0 skips the profile")
    p.add_argument("--profile-top", type=int, default=15)
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args()

    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        pass

    runs = []
    header = (
        f"{'workers':>7} {'speedup':>7} {'req/s':>8} {'tok/s':>9} {'cpu us/tok':>10} "
        f"{'hit':>5} {'behind %':>8} {'sim util':>8}"
    )
    print(header)
    for speedup in track(args.speedups, "speedups", label=str):
        for n in args.workers:
            r = asyncio.run(drive(n, speedup, args.seconds, args))
            runs.append(r)
            util = "-" if r["sim_utilisation"] is None else f"{r['sim_utilisation']:.2f}"
            behind = "-" if r["behind_pct"] is None else f"{r['behind_pct']:.1f}"
            print(
                f"{n:>7} {speedup:>7g} {r['requests_per_s']:>8} {r['tokens_per_s']:>9} "
                f"{r['cpu_us_per_token']:>10} {r['cache_hit_rate']:>5} "
                f"{behind:>8} {util:>8}",
                flush=True,
            )
    top: list[str] = []
    if args.profile_seconds > 0:
        top = profile(max(args.workers), args.profile_seconds, args, args.profile_top)
        print(f"\ncProfile, {max(args.workers)} workers, speedup 0 (by own time):")
        print("\n".join(top))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.output.write_text(
        json.dumps(
            {
                "settings": settings,
                "runs": runs,
                "profile_top": top,
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
