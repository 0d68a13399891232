"""KV router decision latency and KV-event throughput, on one core, without I/O.

For each worker count the index is filled *through KV events* with about a million
(worker, block) pairs (``--target-blocks``): every worker caches conversations that start
with one of a few shared system prompts, as engines serving real traffic do. A worker caches
one conversation at least, so at 1,024 workers with 8K-token conversations the index holds
about half a million pairs (one conversation each) rather than a million. Then
``KvRouterCore.route`` is timed (``time.perf_counter_ns``, and the thread's CPU time) for
prompts of each size, drawn from a mix:

* ``continue``: a cached conversation's first part plus new tokens (long overlap, one worker);
* ``shared``: a shared system prompt plus a new question (medium overlap, many workers);
* ``new``: nothing cached.

In-flight requests are kept at a steady level (the oldest is finished after each decision),
so active-sequence counters are realistic. Decisions are timed as production makes them,
without the per-candidate explanation (``explain=False``). The hot path is also timed in
pieces (thread CPU time: on a shared machine wall time is mostly other processes): hashing,
``find_matches``, ``select_worker``, and ``select_worker(explain=True)`` apart (what
``turnout router`` queries and clients asking for ``nvext`` routing pay).

Run: ``.venv/bin/python benchmarks/router_decision.py`` (defaults: 16/64/256/1,024 workers,
4K/8K-token prompts, block size 16; about a minute on an idle core).
Writes ``benchmarks/results/router_decision.json``. Goals: decision p99 <= 200 us at 64
workers and <= 1 ms at 1,024 workers, 8K-token prompts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from turnout.protocols.block_hashing import compute_block_hashes
from turnout.protocols.kv import BlockRemoved, BlockStored, KvCacheEvent, StoredBlock
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.config import KvRouterConfig, RouterCost
from turnout.router.kv.core import KvRouterCore
from turnout.router.kv.selector import select_worker
from turnout.runtime.progress import track

RESULTS = Path(__file__).parent / "results" / "router_decision.json"
VOCAB = 32000


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx] / 1000.0  # ns -> us


def summarize(values: list[int]) -> dict[str, float]:
    return {
        "p50_us": percentile(values, 50),
        "p90_us": percentile(values, 90),
        "p99_us": percentile(values, 99),
        "max_us": max(values) / 1000.0,
        "mean_us": statistics.fmean(values) / 1000.0,
    }


class Corpus:
    """Token sequences the workers cache, with their block hashes (computed once)."""

    def __init__(self, *, rng: np.random.Generator, block_size: int, conv_tokens: int) -> None:
        self.rng = rng
        self.block_size = block_size
        self.conv_tokens = conv_tokens
        self.system_prompts: list[np.ndarray] = []
        self.conversations: list[np.ndarray] = []
        self.conv_hashes: list[tuple[list[int], list[int]]] = []

    def make_system_prompts(self, count: int, tokens: int) -> None:
        self.system_prompts = [
            self.rng.integers(0, VOCAB, tokens, dtype=np.uint32) for _ in range(count)
        ]

    def add_conversation(self) -> int:
        """A new conversation: a shared system prompt, then its own turns."""
        system = self.system_prompts[int(self.rng.integers(len(self.system_prompts)))]
        rest = self.rng.integers(0, VOCAB, self.conv_tokens - len(system), dtype=np.uint32)
        tokens = np.concatenate([system, rest])
        local, seq = compute_block_hashes(tokens, self.block_size)
        self.conversations.append(tokens)
        self.conv_hashes.append((local, seq))
        return len(self.conversations) - 1


def populate(
    core: KvRouterCore,
    corpus: Corpus,
    workers: list[WorkerKey],
    target_pairs: int,
    *,
    chunk_blocks: int,
    rng: random.Random,
) -> dict[str, Any]:
    """Give every worker conversations until ~target_pairs (worker, block) pairs are indexed.

    A conversation lands on ~2 workers (as a router spreading load would do), so some
    conversations are shared; all share their system prompt blocks. Events are built first,
    then applied and timed.
    """
    blocks_per_conv = corpus.conv_tokens // corpus.block_size
    system_blocks = len(corpus.system_prompts[0]) // corpus.block_size
    num_system = len(corpus.system_prompts)
    # A worker's distinct blocks: its conversations' own blocks, plus each system prompt
    # once. Solve for the number of conversations per worker that gives target_pairs.
    per_worker = target_pairs / len(workers)
    per_worker_convs = int(
        (per_worker - num_system * system_blocks) / (blocks_per_conv - system_blocks)
    )
    if per_worker_convs < num_system:
        per_worker_convs = int(per_worker / blocks_per_conv)
    per_worker_convs = max(1, per_worker_convs)
    num_convs = max(1, len(workers) * per_worker_convs // 2)
    for _ in range(num_convs - len(corpus.conversations)):
        corpus.add_conversation()
    events: list[KvCacheEvent] = []
    next_id = {w: 0 for w in workers}
    held: dict[WorkerKey, list[int]] = {w: [] for w in workers}
    for w in workers:
        for conv in rng.sample(range(num_convs), min(per_worker_convs, num_convs)):
            held[w].append(conv)
            local, seq = corpus.conv_hashes[conv]
            for start in range(0, len(seq), chunk_blocks):
                blocks = [
                    StoredBlock(block_hash=s, tokens_hash=loc, num_tokens=corpus.block_size)
                    for s, loc in zip(
                        seq[start : start + chunk_blocks],
                        local[start : start + chunk_blocks],
                        strict=True,
                    )
                ]
                parent = seq[start - 1] if start else None
                events.append(
                    KvCacheEvent(
                        worker_id=w.worker_id,
                        dp_rank=w.dp_rank,
                        event_id=next_id[w],
                        data=BlockStored(parent_hash=parent, blocks=blocks),
                    )
                )
                next_id[w] += 1
    rng.shuffle(events)  # interleave workers...
    events.sort(key=lambda e: (e.event_id, e.worker_id))  # ...keeping each worker's order
    t0 = time.perf_counter()
    for event in events:
        core.on_kv_event(event)
    elapsed = time.perf_counter() - t0
    blocks = sum(len(e.data.blocks) for e in events if isinstance(e.data, BlockStored))

    # Steady-state churn: stores of new blocks and removals of old ones, as under eviction.
    churn: list[KvCacheEvent] = []
    fresh = iter(range(1, 10**9))
    for i in range(20_000):
        w = workers[(i // 2) % len(workers)]  # a store, then its removal, on one worker
        if i % 2 == 0:
            hashes = [next(fresh) * 0x9E3779B97F4A7C15 % 2**64 for _ in range(chunk_blocks)]
            data: BlockStored | BlockRemoved = BlockStored(
                parent_hash=None,
                blocks=[StoredBlock(block_hash=h, tokens_hash=h, num_tokens=16) for h in hashes],
            )
        else:
            data = BlockRemoved(block_hashes=hashes)
        churn.append(
            KvCacheEvent(worker_id=w.worker_id, dp_rank=w.dp_rank, event_id=next_id[w], data=data)
        )
        next_id[w] += 1
    t1 = time.perf_counter()
    for event in churn:
        core.on_kv_event(event)
    churn_elapsed = time.perf_counter() - t1
    return {
        "events": len(events),
        "blocks_in_events": blocks,
        "populate_s": elapsed,
        "populate_events_per_s": len(events) / elapsed,
        "populate_blocks_per_s": blocks / elapsed,
        "churn_events": len(churn),
        "churn_events_per_s": len(churn) / churn_elapsed,
        "churn_blocks_per_s": len(churn) * chunk_blocks / churn_elapsed,
        "held": held,
    }


def make_queries(
    corpus: Corpus,
    held: dict[WorkerKey, list[int]],
    prompt_tokens: int,
    count: int,
    rng: np.random.Generator,
) -> list[tuple[str, list[int]]]:
    convs = sorted({c for cs in held.values() for c in cs})
    queries: list[tuple[str, list[int]]] = []
    new_tail = max(corpus.block_size, prompt_tokens // 8)
    for i in range(count):
        kind = ("continue", "shared", "new")[i % 3]
        if kind == "continue":
            conv = corpus.conversations[convs[int(rng.integers(len(convs)))]]
            head = conv[: min(len(conv), prompt_tokens - new_tail)]
        elif kind == "shared":
            head = corpus.system_prompts[int(rng.integers(len(corpus.system_prompts)))]
            head = head[: prompt_tokens - new_tail]
        else:
            head = np.empty(0, dtype=np.uint32)
        tail = rng.integers(0, VOCAB, prompt_tokens - len(head), dtype=np.uint32)
        # Requests arrive as lists of ints (PreprocessedRequest.token_ids).
        queries.append((kind, np.concatenate([head, tail]).tolist()))
    return queries


def time_decisions(
    core: KvRouterCore,
    workers: list[WorkerKey],
    queries: list[tuple[str, list[int]]],
    *,
    inflight: int,
    warmup: int,
) -> dict[str, Any]:
    """Wall time and CPU time of each ``route`` call.

    CPU time (``thread_time_ns``) leaves out time the OS gave to other processes: on a shared
    machine the wall-clock tail is mostly preemption, the CPU tail is the code's own.
    """
    pending: deque[str] = deque()
    by_kind: dict[str, list[int]] = {}
    overall: list[int] = []
    cpu: list[int] = []
    wall_clock = time.perf_counter_ns
    cpu_clock = time.thread_time_ns
    now = 0.0
    for i, (kind, tokens) in enumerate(queries):
        request_id = f"q{i}"
        now += 0.001
        c0 = cpu_clock()
        t0 = wall_clock()
        sel = core.route(request_id, tokens, workers, now=now)
        elapsed = wall_clock() - t0
        cpu_elapsed = cpu_clock() - c0
        assert sel.ok
        if i >= warmup:
            overall.append(elapsed)
            cpu.append(cpu_elapsed)
            by_kind.setdefault(kind, []).append(elapsed)
        pending.append(request_id)
        if len(pending) > inflight:
            done = pending.popleft()
            core.on_first_token(done, now=now)
            core.on_finished(done)
    return {
        "route": summarize(overall),
        "route_cpu": summarize(cpu),
        "by_kind": {k: summarize(v) for k, v in by_kind.items()},
    }


def time_pieces(
    core: KvRouterCore, workers: list[WorkerKey], queries: list[tuple[str, list[int]]]
) -> dict[str, dict[str, float]]:
    """The hot path's parts, timed apart in thread CPU time (same queries, no bookkeeping)."""
    config = core.config
    clock = time.thread_time_ns
    rng = random.Random(0)
    hashing: list[int] = []
    matching: list[int] = []
    selecting: list[int] = []
    explaining: list[int] = []
    for _, tokens in queries:
        t0 = clock()
        seq = core.seq_hashes(tokens)
        t1 = clock()
        overlaps = core.index.find_matches(seq)
        t2 = clock()
        new_blocks = -(-len(tokens) // config.block_size)
        select_worker(
            workers, overlaps, core.active, new_blocks, config, rng, loads=core.loads,
            num_tokens=len(tokens), step_models=core.step_models, table=core.cost_table,
        )  # fmt: skip
        t3 = clock()
        select_worker(
            workers, overlaps, core.active, new_blocks, config, rng, loads=core.loads,
            num_tokens=len(tokens), step_models=core.step_models, explain=True,
        )  # fmt: skip
        t4 = clock()
        hashing.append(t1 - t0)
        matching.append(t2 - t1)
        selecting.append(t3 - t2)
        explaining.append(t4 - t3)
    return {
        "hash": summarize(hashing),
        "find_matches": summarize(matching),
        "select": summarize(selecting),
        "select_explain": summarize(explaining),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "config": {
            "workers": args.workers,
            "prompt_tokens": args.prompt_tokens,
            "block_size": args.block_size,
            "target_blocks": args.target_blocks,
            "decisions": args.decisions,
            "inflight_per_worker": args.inflight_per_worker,
            "temperature": args.temperature,
            "gc_freeze": not args.no_gc_freeze,
        },
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_at_start": os.getloadavg(),
        },
        "runs": [],
    }
    conv_tokens = max(args.prompt_tokens)
    for num_workers in track(args.workers, "fleet sizes", label=str):
        rng = random.Random(args.seed)
        nprng = np.random.default_rng(args.seed)
        corpus = Corpus(rng=nprng, block_size=args.block_size, conv_tokens=conv_tokens)
        corpus.make_system_prompts(args.system_prompts, conv_tokens // 2)
        config = KvRouterConfig(
            block_size=args.block_size,
            router_temperature=args.temperature,
            router_cost=RouterCost(args.router_cost),
        )
        core = KvRouterCore(config, rng=random.Random(args.seed), clock=lambda: 0.0)
        # A tuple, as KvRouter passes its live set (one object until membership changes).
        workers = tuple(WorkerKey(i) for i in range(num_workers))
        gc.collect()
        pop = populate(
            core, corpus, workers, args.target_blocks, chunk_blocks=args.chunk_blocks, rng=rng
        )
        held = pop.pop("held")
        stats = core.get_stats().indexer
        assert stats is not None
        if not args.no_gc_freeze:
            # The index is long-lived: move it out of the collector's generations, as a
            # server does after start-up, so full collections do not rescan it.
            gc.collect()
            gc.freeze()
        for prompt_tokens in args.prompt_tokens:
            queries = make_queries(corpus, held, prompt_tokens, args.decisions + args.warmup, nprng)
            decisions = time_decisions(
                core,
                workers,
                queries,
                inflight=args.inflight_per_worker * num_workers,
                warmup=args.warmup,
            )
            pieces = time_pieces(core, workers, queries[args.warmup :])
            row = {
                "workers": num_workers,
                "prompt_tokens": prompt_tokens,
                "blocks_indexed": stats.blocks_indexed,
                "unique_blocks": stats.unique_blocks,
                **decisions,
                "pieces": pieces,
                "events": pop,
                "predicted_hit_rate": core.predicted_hit_rate,
            }
            results["runs"].append(row)
            print_row(row)
        if not args.no_gc_freeze:
            gc.unfreeze()
        del core, corpus
    return results


def print_header() -> None:
    print(
        f"{'workers':>7} {'tokens':>6} {'indexed':>9} {'p50 us':>7} {'p99 us':>7} "
        f"{'cpu p50':>7} {'cpu p99':>7} {'hash':>5} {'match':>5} {'m p99':>5} {'select':>6} "
        f"{'s p99':>6} {'explain':>7} {'ev/s':>7} {'blocks/s':>8} {'churn/s':>7}"
    )
    print(
        f"{'':>26}(wall time; cpu: thread CPU time; pieces: CPU p50 unless p99)",
    )


def print_row(row: dict[str, Any]) -> None:
    p = row["pieces"]
    print(
        f"{row['workers']:>7} {row['prompt_tokens']:>6} {row['blocks_indexed']:>9} "
        f"{row['route']['p50_us']:>7.0f} {row['route']['p99_us']:>7.0f} "
        f"{row['route_cpu']['p50_us']:>7.0f} {row['route_cpu']['p99_us']:>7.0f} "
        f"{p['hash']['p50_us']:>5.0f} {p['find_matches']['p50_us']:>5.0f} "
        f"{p['find_matches']['p99_us']:>5.0f} {p['select']['p50_us']:>6.0f} "
        f"{p['select']['p99_us']:>6.0f} {p['select_explain']['p50_us']:>7.0f} "
        f"{row['events']['populate_events_per_s']:>7.0f} "
        f"{row['events']['populate_blocks_per_s']:>8.0f} "
        f"{row['events']['churn_events_per_s']:>7.0f}",
        flush=True,
    )


#: (workers, prompt tokens) -> decision p99 goal in microseconds.
GOALS_US = {(64, 8192): 200.0, (1024, 8192): 1000.0}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--workers", type=ints, default=[16, 64, 256, 1024])
    parser.add_argument("--prompt-tokens", type=ints, default=[4096, 8192])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--target-blocks", type=int, default=1_000_000)
    parser.add_argument("--decisions", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--inflight-per-worker", type=int, default=4)
    parser.add_argument("--system-prompts", type=int, default=16)
    parser.add_argument("--chunk-blocks", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--router-cost", choices=[c.value for c in RouterCost], default="ttft")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-gc-freeze", action="store_true")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    print_header()
    t0 = time.perf_counter()
    results = run(args)
    results["wall_s"] = time.perf_counter() - t0
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    for row in results["runs"]:
        goal = GOALS_US.get((row["workers"], row["prompt_tokens"]))
        if goal is not None:
            wall, cpu = row["route"]["p99_us"], row["route_cpu"]["p99_us"]
            verdict = "met" if wall <= goal else ("met in CPU time" if cpu <= goal else "MISSED")
            print(
                f"goal ({row['prompt_tokens']} tokens, {row['workers']} workers): p99 <= "
                f"{goal:.0f} us: wall {wall:.0f} us, cpu {cpu:.0f} us -> {verdict}"
            )
    print(f"wrote {args.json} in {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
