"""Disaggregated serving: the same simulated workers aggregated, and split into prefill and
decode pools.

For each trace and each setup a fresh stack is started on a private file store: one
``turnout frontend --router-mode kv`` and mocker worker processes, ``--workers`` of them in all:

* ``agg``: every worker aggregated (whole requests);
* ``P:D`` (default ``1:1`` and ``1:3``): ``workers x P/(P+D)`` prefill workers (their own
  process, ``--role prefill``) and the rest decode workers (``--role decode``).

The trace is replayed open-loop over HTTP (streamed ``/v1/completions`` with token-id
prompts, ``ignore_eos``) with ``benchmarks/routing_quality.py``'s client and figures: TTFT and
ITL percentiles (ITL per request = (e2e - TTFT) / (output tokens - 1); and the gaps between
consecutive streamed chunks, pooled, whose tail shows decodes stalled behind prefills) in
*simulated* milliseconds (wall x ``--speedup-ratio``), output tokens per simulated second,
and, from the frontend's metrics, how many requests went through the prefill stage and how
many ran whole (short prompts, or prompts their decode worker mostly held).

**Traces.** ``long``: ``--requests`` prompts of ``--isl`` (8192) unique tokens, ``--osl`` (256)
output tokens each, Poisson arrivals. ``mooncake``: a window of the Mooncake conversation
trace (``../shared/traces/mooncake_conversation.jsonl``; records ``--window-start`` on, prompts
cut to 16,384 tokens, outputs to ``--osl``); skipped with a note when the file is absent.

**Load.** As in routing_quality: arrivals are scaled so that the prompt tokens no cache could
serve arrive at ``--load`` x the prefill capacity of *all* ``--workers`` workers at a full
chunk. A disaggregated setup prefills on fewer workers: at load L, P prefill workers of W run
at L x W / P of their capacity (``1:3`` at load 0.3 with 4 workers: 1.2, past saturation).

Usage::

    .venv/bin/python benchmarks/disagg.py            # both traces, agg / 1:1 / 1:3 (~4 min)
    .venv/bin/python benchmarks/disagg.py --quick    # a ~1 minute smoke run
    .venv/bin/python benchmarks/disagg.py --traces long --setups agg 1:1 --load 0.2 0.4

Writes ``benchmarks/results/disagg.json`` and ``disagg.png`` (``_quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks.traces import (  # noqa: E402
    Segment,
    SegmentKind,
    Trace,
    TraceRequest,
    load_mooncake,
    oracle_hit_rate,
)

from benchmarks import routing_quality as rq  # noqa: E402
from turnout.runtime.progress import track  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_SETUPS = ["agg", "1:1", "1:3"]
DEFAULT_TRACES = ["long", "mooncake"]
#: ``--quick``: fewer requests (each still overridable on the command line).
QUICK = {"requests": 24, "mooncake_requests": 40}
#: Frontend metrics of the prefill router, read after each run.
_SAMPLE = re.compile(r"^(turnout_disagg_\w+)\{([^}]*)\} (\S+)$")


@dataclass(frozen=True, slots=True)
class Setup:
    """How the workers split: ``prefill`` prefill workers, ``decode`` decode (or, with no
    prefill worker, aggregated) workers."""

    name: str
    prefill: int
    decode: int

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0


def parse_setup(spec: str, workers: int) -> Setup:
    """``agg`` or ``P:D`` over ``workers`` workers (the split must come out whole)."""
    if spec == "agg":
        return Setup(spec, 0, workers)
    try:
        p, d = (int(x) for x in spec.split(":"))
    except ValueError:
        raise SystemExit(f"setup {spec!r}: say agg or P:D, e.g. 1:3") from None
    if p <= 0 or d <= 0 or workers * p % (p + d):
        raise SystemExit(f"setup {spec}: {workers} workers do not split {p}:{d}")
    prefill = workers * p // (p + d)
    return Setup(spec, prefill, workers - prefill)


def long_prompt_trace(requests: int, isl: int, osl: int, seed: int) -> Trace:
    """``requests`` unique prompts of ``isl`` tokens, ``osl`` outputs, Poisson arrivals at one
    per trace second (the load scaling sets the real rate)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0, size=requests))
    items = [
        TraceRequest(
            arrival_s=float(t - arrivals[0]), session_id=f"r{i}", turn=0, input_length=isl,
            output_length=osl, segments=(Segment(SegmentKind.USER_TEXT, i, isl),),
        )
        for i, t in enumerate(arrivals)
    ]  # fmt: skip
    params = {"requests": requests, "isl": isl, "osl": osl, "seed": seed}
    return Trace("long", items, token_seed=seed, params=params, has_sessions=False)


def disagg_counters(metrics_text: str) -> dict[str, dict[str, float]]:
    """``turnout_disagg_*`` samples by name, keyed by their stage or reason label (histogram
    buckets and sums, and the client library's ``_created`` timestamps, left out)."""
    out: dict[str, dict[str, float]] = {}
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1).endswith(("_bucket", "_sum", "_created")):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        key = labels.get("stage") or labels.get("reason") or "total"
        out.setdefault(match.group(1), {})[key] = float(match.group(3))
    return out


@dataclass
class DisaggStack(rq.Stack):
    """``rq.Stack`` plus a second worker process of prefill workers."""

    prefill_args: list[str] = field(default_factory=list)

    def start_prefill(self, count: int, timeout: float = 120) -> str | None:
        """Start the prefill workers; None once the frontend lists ``count`` of them."""
        proc = self._spawn("prefill", ["worker", *self._common(), *self.prefill_args])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"prefill workers exited with {proc.returncode}: {self.log_tail('prefill')}"
            try:
                models = httpx.get(self.url + "/health", timeout=2).json().get("models", [])
                for model in models:
                    disagg = model.get("disaggregation") or {}
                    if len(disagg.get("prefill_instances", [])) >= count:
                        return None
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        return f"{count} prefill workers did not register: {self.log_tail('prefill')}"


def run_setup(
    setup: Setup, trace: Trace, plan: rq.CellPlan, args: argparse.Namespace
) -> dict[str, Any]:
    """One replay of ``trace`` on a fresh stack split as ``setup``."""
    common = [
        "--engine", "mocker", "--model-name", rq.MODEL_NAME,
        "--speedup-ratio", repr(plan.speedup), "--block-size", str(args.block_size),
        "--num-gpu-blocks", str(args.num_gpu_blocks),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--seed", str(args.seed),
        "--context-length", str(max(8192, rq.trace_context_length(trace))),
    ]  # fmt: skip
    decode_role = ["--role", "decode"] if setup.disaggregated else []
    entry: dict[str, Any] = {"setup": setup.name, "prefill": setup.prefill, "decode": setup.decode}
    with tempfile.TemporaryDirectory(prefix="turnout-disagg-") as tmp:
        stack = DisaggStack(
            Path(tmp),
            ["--router-mode", "kv", "--prefill-min-tokens", str(args.prefill_min_tokens)],
            [*common, "--num-workers", str(setup.decode), *decode_role],
            prefill_args=[*common, "--num-workers", str(setup.prefill), "--role", "prefill",
                          "--kv-transfer", args.kv_transfer],
        )  # fmt: skip
        try:
            problem = stack.start_frontend() or stack.start_workers(setup.decode)
            if problem is None and setup.disaggregated:
                problem = stack.start_prefill(setup.prefill)
            if problem is not None:
                entry["skipped"] = problem
                return entry
            print(f"[{trace.kind} {setup.name}] replaying {len(trace.requests)} requests over "
                  f"{plan.wall_span_s:.0f} s", flush=True)  # fmt: skip
            results, elapsed = rq._replay(stack.url, trace, plan, args, None)
            entry["summary"] = rq.summarize(results, elapsed, plan.speedup, setup.decode, plan)
            entry["summary"].pop("ttft_sim_s_sorted", None)
            entry["disagg"] = disagg_counters(httpx.get(stack.url + "/metrics", timeout=10).text)
            if entry["summary"]["num_ok"] == 0:
                entry["frontend_log_tail"] = stack.log_tail("frontend", 20)
        finally:
            stack.stop()
    return entry


def make_traces(args: argparse.Namespace) -> list[Trace | str]:
    """The traces to replay, or for one that cannot be had, why not."""
    out: list[Trace | str] = []
    for kind in track(args.traces, "traces", label=str):
        if kind == "long":
            out.append(long_prompt_trace(args.requests, args.isl, args.osl, args.seed))
            continue
        path = Path(args.mooncake_file or rq.MOONCAKE_FILE)
        if not path.exists():
            out.append(f"mooncake: no trace file at {path} (pass --mooncake-file)")
            continue
        out.append(
            load_mooncake(
                path, window_start=args.window_start, max_requests=args.mooncake_requests,
                max_input_length=16384, max_output_length=args.osl, token_seed=args.seed,
            )
        )  # fmt: skip
    return out


def disagg_share(entry: dict[str, Any]) -> float | None:
    """Requests that went through the prefill stage, over those that completed."""
    ok = entry.get("summary", {}).get("num_ok")
    staged = entry.get("disagg", {}).get("turnout_disagg_requests_total", {}).get("prefill")
    if not ok or staged is None:
        return None
    return staged / ok


def print_trace(block: dict[str, Any]) -> None:
    plan = block["plan"]
    print(f"\n== {block['trace']['kind']} trace, {block['trace']['summary']['num_requests']} "
          f"requests, {plan['workers']} workers, load {plan['load']:g}, speedup "
          f"{plan['speedup_ratio']:g}; simulated ms")  # fmt: skip
    header = (f"{'setup':<6} {'P/D':>5} {'ok':>4} {'err':>4} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'ITL p50':>8} {'ITL p99':>8} {'gap p99':>8} {'gap p99.9':>9} {'tok/s':>7} "
              f"{'disagg':>7}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for entry in block["setups"]:
        split = f"{entry['prefill']}/{entry['decode']}"
        if "skipped" in entry:
            print(f"{entry['setup']:<6} {split:>5} skipped: {entry['skipped'][:80]}")
            continue
        s = entry["summary"]
        gaps = s["token_gap_sim_ms"]
        share = disagg_share(entry)
        print(
            f"{entry['setup']:<6} {split:>5} {s['num_ok']:>4} {s['num_errors']:>4} "
            f"{s['ttft_sim_ms'].get('p50', 0):>9.1f} {s['ttft_sim_ms'].get('p99', 0):>9.1f} "
            f"{s['itl_sim_ms'].get('p50', 0):>8.2f} {s['itl_sim_ms'].get('p99', 0):>8.2f} "
            f"{gaps.get('p99', 0):>8.1f} {gaps.get('p99.9', 0):>9.1f} "
            f"{s['sim_output_tokens_per_s']:>7.0f} "
            f"{'-' if share is None else f'{share:.0%}':>7}"
        )


def plot(report: dict[str, Any], path: Path) -> None:
    """Per trace: TTFT and ITL p50/p99 of each setup, side by side (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = [b for b in report["traces"] if "setups" in b]
    if not blocks:
        return
    panels = (("ttft_sim_ms", "TTFT", ("p50", "p99")), ("itl_sim_ms", "ITL", ("p50", "p99")),
              ("token_gap_sim_ms", "token gap", ("p50", "p99")))  # fmt: skip
    fig, axes = plt.subplots(len(blocks), 3, figsize=(13, 3.6 * len(blocks)), squeeze=False)
    for row, block in zip(axes, blocks, strict=True):
        done = [e for e in block["setups"] if "summary" in e]
        names = [e["setup"] for e in done]
        x = np.arange(len(names))
        for ax, (metric, title, qs) in zip(row, panels, strict=True):
            for offset, q in zip((-0.2, 0.2), qs, strict=True):
                values = [e["summary"][metric].get(q, 0.0) for e in done]
                ax.bar(x + offset, values, width=0.4, label=q)
            ax.set_xticks(x, names)
            ax.set_yscale("log")
            ax.set_ylabel("simulated ms")
            ax.set_title(f"{block['trace']['kind']}: {title}", fontsize=10)
            ax.grid(True, axis="y", which="both", alpha=0.3)
            ax.legend()
    fig.suptitle(
        f"{report['workers']} simulated workers, aggregated vs prefill:decode "
        f"(load {report['load']:g})",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--setups", nargs="+", default=DEFAULT_SETUPS, help="agg and/or P:D")
    ap.add_argument("--traces", nargs="+", choices=DEFAULT_TRACES, default=DEFAULT_TRACES)
    ap.add_argument("--workers", type=int, default=4, help="simulated workers in every setup")
    ap.add_argument("--load", type=float, default=0.3,
                    help="offered prefill work / all workers' prefill capacity")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    ap.add_argument("--requests", type=int, help="long trace: requests (default 120)")
    ap.add_argument("--isl", type=int, default=8192, help="long trace: prompt tokens")
    ap.add_argument("--osl", type=int, default=256, help="output tokens (mooncake: at most)")
    ap.add_argument("--mooncake-file", type=Path, help=f"default: {rq.MOONCAKE_FILE}")
    ap.add_argument("--window-start", type=int, default=2000)
    ap.add_argument("--mooncake-requests", type=int, help="mooncake window (default 150)")
    ap.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("workers and replay")
    g.add_argument("--speedup-ratio", type=float, default=1.0,
                   help="mocker speedup (ITL at 1.0 is measured at the real pace)")  # fmt: skip
    g.add_argument("--kv-transfer", choices=["pull", "push"], default="pull")
    g.add_argument("--prefill-min-tokens", type=int, default=512)
    g.add_argument("--block-size", type=int, default=64)
    g.add_argument("--num-gpu-blocks", type=int, default=16384)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--concurrency", type=int, default=1024, help="most requests in flight")
    g.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, help="default: results/disagg.json")
    ap.add_argument("--plot", type=Path, help="default: results/disagg.png")
    args = ap.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    args.requests = args.requests or 120
    args.mooncake_requests = args.mooncake_requests or 150
    if args.speedup_ratio <= 0 or args.load <= 0:
        raise SystemExit("--speedup-ratio and --load must be > 0")
    suffix = "_quick" if args.quick else ""
    args.out = args.out or RESULTS / f"disagg{suffix}.json"
    args.plot = args.plot or RESULTS / f"disagg{suffix}.png"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    setups = [parse_setup(spec, args.workers) for spec in args.setups]
    report: dict[str, Any] = {
        "benchmark": "disagg",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "workers": args.workers,
        "load": args.load,
        "speedup_ratio": args.speedup_ratio,
        "kv_transfer": args.kv_transfer,
        "prefill_min_tokens": args.prefill_min_tokens,
        "traces": [],
    }
    for trace in make_traces(args):
        if isinstance(trace, str):
            print(f"skipped: {trace}", flush=True)
            report["traces"].append({"skipped": trace})
            continue
        oracle = oracle_hit_rate(trace, args.block_size)
        plan = rq.plan_cell(
            trace, oracle, args.workers, args.load,
            max_num_batched_tokens=args.max_num_batched_tokens, speedup=args.speedup_ratio,
            wall_rate=0.0,
        )  # fmt: skip
        block: dict[str, Any] = {
            "trace": {"kind": trace.kind, "params": trace.params, "summary": trace.get_summary()},
            "oracle_hit_rate": round(oracle.hit_rate, 4),
            "plan": plan.to_dict(),
            "setups": [run_setup(setup, trace, plan, args) for setup in setups],
        }
        print_trace(block)
        report["traces"].append(block)
    plot(report, args.plot)
    report["plot"] = str(args.plot)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out} and {args.plot}")
    return report


if __name__ == "__main__":
    main()
