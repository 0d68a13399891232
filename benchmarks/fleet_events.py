"""What a fleet of workers publishes on the event plane, extrapolated from simulated workers.

The question behind it: at 10,000 or 100,000 workers, how many KV events and load reports a
second reach the routers, and what they cost. Rather than guess per-worker rates, this runs
``--sim-workers`` mocker engines (the same ``MockerEngine`` the workers run, real step
timing model, real KV pool and event policy) on a virtual clock: an asyncio loop whose time
jumps to the next timer whenever nothing is ready, so ``--seconds`` of simulated serving
take as long as the CPU work they hold, whatever the speed of this machine. Each worker gets
Poisson arrivals at ``--rate`` requests/s: prompts of ``--prompt-tokens`` tokens, the first
``--shared`` share of them one of ``--prefixes`` common prefixes, ``--output-tokens``
generated. Every message is encoded as the worker's event-plane sink encodes it (msgpack), to
count bytes.

Per worker and second it reports KV event batches (messages), events, blocks stored and
removed, load reports, and their bytes; then, for fleets of ``--fleet`` workers, the
messages and bytes per second the fleet publishes, what each router replica receives when
every replica hears every worker (as turnout's frontends do), and what each receives when
the indexer is sharded by worker over ``--shards`` shards. With the per-message costs the
router's own benchmarks measured (``--us-per-report``: ``benchmarks/load_reports.py``;
``--us-per-block``: ``benchmarks/router_decision.py``'s event churn), it turns those rates
into cores.

    .venv/bin/python benchmarks/fleet_events.py     # ~1 min; JSON to results/fleet_events.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from turnout.engines.mocker import MockerConfig, MockerEngine  # noqa: E402
from turnout.protocols.kv import BlockRemoved, BlockStored, KvEventBatch, LoadReport  # noqa: E402
from turnout.protocols.llm import PreprocessedRequest, StopConditions  # noqa: E402
from turnout.runtime.context import RequestContext  # noqa: E402
from turnout.runtime.progress import track  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "fleet_events.json"
_encode = msgspec.msgpack.Encoder().encode


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on simulated time: when no callback is ready, the clock jumps to the
    earliest timer instead of waiting for it. Only for code that does no real I/O."""

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0

    def time(self) -> float:
        return self._now

    def _run_once(self) -> None:
        scheduled = self._scheduled  # type: ignore[attr-defined]
        if not self._ready and scheduled:  # type: ignore[attr-defined]
            self._now = max(self._now, scheduled[0]._when)
        super()._run_once()  # type: ignore[misc]


class MeasuringSink:
    """Counts what one process's event-plane sink would publish, with encoded sizes."""

    def __init__(self) -> None:
        self.kv_batches = self.kv_events = self.blocks_stored = self.blocks_removed = 0
        self.kv_bytes = self.loads = self.load_bytes = 0

    def publish_kv(self, batch: KvEventBatch) -> None:
        self.kv_batches += 1
        self.kv_events += len(batch.events)
        self.kv_bytes += len(_encode(batch))
        for event in batch.events:
            if isinstance(event.data, BlockStored):
                self.blocks_stored += len(event.data.blocks)
            elif isinstance(event.data, BlockRemoved):
                self.blocks_removed += len(event.data.block_hashes)

    def publish_load(self, report: LoadReport) -> None:
        self.loads += 1
        self.load_bytes += len(_encode(report))


async def simulate(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    sink = MeasuringSink()
    config = MockerConfig(
        num_gpu_blocks=args.num_gpu_blocks, block_size=args.block_size, speedup_ratio=1.0
    )
    config.validate(num_workers=args.sim_workers)
    engines = [
        MockerEngine(config, worker_id=i, sink=sink, clock=loop.time, validate=False)
        for i in range(args.sim_workers)
    ]
    for engine in engines:
        await engine.start()
    rng = random.Random(0)
    shared = int(args.prompt_tokens * args.shared)
    prefixes = [[rng.randrange(3, 32000) for _ in range(shared)] for _ in range(args.prefixes)]
    end = loop.time() + args.seconds
    done = {"requests": 0, "tokens": 0}
    tasks: set[asyncio.Task[None]] = set()

    async def one(engine: MockerEngine, tokens: list[int]) -> None:
        request = PreprocessedRequest(
            model="mock",
            token_ids=tokens,
            stop_conditions=StopConditions(max_tokens=args.output_tokens, ignore_eos=True),
        )
        async for out in engine.generate(request, RequestContext()):
            done["tokens"] += len(out.token_ids)
        done["requests"] += 1

    async def arrivals(engine: MockerEngine, seed: int) -> None:
        r = random.Random(seed)
        while loop.time() < end:
            await asyncio.sleep(r.expovariate(args.rate))
            tail = [r.randrange(3, 32000) for _ in range(args.prompt_tokens - shared)]
            task = asyncio.create_task(one(engine, prefixes[r.randrange(args.prefixes)] + tail))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    warm = args.warmup_seconds
    await asyncio.gather(*(arrivals(e, i) for i, e in enumerate(engines)), _reset_after(sink, warm))
    if tasks:
        await asyncio.wait(tasks)
    for engine in engines:
        await engine.stop()
    span = args.seconds - warm
    per = args.sim_workers * span
    return {
        "requests_per_worker_s": round(done["requests"] / (args.sim_workers * args.seconds), 3),
        "kv_batches": round(sink.kv_batches / per, 2),
        "kv_events": round(sink.kv_events / per, 2),
        "blocks_stored": round(sink.blocks_stored / per, 2),
        "blocks_removed": round(sink.blocks_removed / per, 2),
        "kv_bytes": round(sink.kv_bytes / per, 1),
        "load_reports": round(sink.loads / per, 2),
        "load_bytes": round(sink.load_bytes / per, 1),
    }


async def _reset_after(sink: MeasuringSink, seconds: float) -> None:
    """Zero the counts once the caches are warm: steady state only."""
    await asyncio.sleep(seconds)
    sink.__init__()  # type: ignore[misc]


def extrapolate(per_worker: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    msgs = per_worker["kv_batches"] + per_worker["load_reports"]
    nbytes = per_worker["kv_bytes"] + per_worker["load_bytes"]
    blocks = per_worker["blocks_stored"] + per_worker["blocks_removed"]
    # CPU a router spends per worker-second: its load reports and its blocks indexed.
    us = per_worker["load_reports"] * args.us_per_report + blocks * args.us_per_block
    for n in track(args.fleet, "fleet sizes", label=str):
        shard = math.ceil(n / args.shards)
        rows.append({
            "workers": n,
            "published_msgs_per_s": round(n * msgs),
            "published_mb_per_s": round(n * nbytes / 1e6, 1),
            "per_replica_msgs_per_s_full": round(n * msgs),
            "per_replica_cores_full": round(n * us / 1e6, 2),
            "shards": args.shards,
            "per_shard_msgs_per_s": round(shard * msgs),
            "per_shard_cores": round(shard * us / 1e6, 2),
            "workers_per_core": round(1e6 / us) if us else None,
        })  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sim-workers", type=int, default=4)
    p.add_argument("--seconds", type=float, default=300.0, help="simulated seconds")
    p.add_argument("--warmup-seconds", type=float, default=120.0, help="until the pool evicts")
    p.add_argument("--rate", type=float, default=2.0, help="requests/s per worker")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--shared", type=float, default=0.5, help="share of a prompt in a prefix")
    p.add_argument("--prefixes", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--num-gpu-blocks", type=int, default=4096)
    p.add_argument("--fleet", type=int, nargs="+", default=[1024, 10_000, 100_000])
    p.add_argument("--shards", type=int, default=16)
    p.add_argument(
        "--us-per-report",
        type=float,
        default=15.0,
        help="router CPU per load report (benchmarks/load_reports.py, after folding)",
    )
    p.add_argument(
        "--us-per-block",
        type=float,
        default=2.0,
        help="router CPU per block stored/removed (router_decision.py churn)",
    )
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args()  # fmt: skip
    loop = VirtualTimeLoop()
    try:
        per_worker = loop.run_until_complete(simulate(args))
    finally:
        loop.close()
    rows = extrapolate(per_worker, args)
    print("per worker and second:", json.dumps(per_worker))
    head = ["workers", "published_msgs_per_s", "published_mb_per_s", "per_replica_cores_full",
            "per_shard_msgs_per_s", "per_shard_cores"]  # fmt: skip
    print(" ".join(f"{h:>22}" for h in head))
    for r in rows:
        print(" ".join(f"{r[h]!s:>22}" for h in head))
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps({"settings": settings, "per_worker_s": per_worker, "fleet": rows}, indent=2)
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
