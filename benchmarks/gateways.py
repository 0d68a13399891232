"""Gateways side by side: turnout (frontend + ``turnout attach``) against SGLang's gateway
(``smg``) and vLLM's router (``vllm-router``), in front of the same engines.

**Part 1, a simulated fleet.** For each trace and each gateway, 8 fresh ``turnout
mocker-server`` processes (the calibrated mocker behind vLLM's or SGLang's own HTTP face, KV
events on ZMQ; fresh, so every gateway meets cold caches), the gateway in front of them, one
replay, then everything is stopped. The engines wear the face each gateway speaks for
token-exact traffic (``benchmarks/gateway_peers.py`` says why):

============================  ======  ================================================
gateway                       face    request / routing input
============================  ======  ================================================
turnout kv / round-robin      vllm    ``/v1/completions`` token ids; ``attach --api vllm``
                                      with the servers' native KV events (exact index)
smg cache_aware / round_robin sglang  ``/generate`` with ``input_ids`` (smg's completions
                                      take no token ids); its tree guesses from requests
vllm-router cache_aware /     vllm    ``/v1/completions`` token ids; ``kv_aware`` reads the
round_robin / kv_aware                servers' KV events (run only if it can decode them)
============================  ======  ================================================

No session header is sent: every gateway routes on the prompt alone.

**Traces.** A window of the Mooncake conversation trace (``../shared/traces``, records from
2000, prompts cut to 16K tokens, outputs to 64) and the synthetic multi-turn trace of
``benchmarks/traces.py`` (a turn waits for its session's previous one). Time is scaled as in
``routing_quality.py``: arrivals so that the work the oracle cannot cache is ``--load`` of
the 8 engines' prefill capacity, and the mocker's ``--speedup-ratio`` so that requests arrive
at ``--wall-rate`` a wall second; latencies are reported in simulated ms (wall x speedup).

**Figures per run.** Cached share: the engines' own counters (vLLM
``prefix_cache_hits/queries``, SGLang ``cached_tokens/prompt_tokens``; llama.cpp
``prompt_tokens_cached/(processed + cached)``), read before and after the replay; its ratio to
the oracle's (one unlimited cache seeing every request). TTFT and ITL p50/p99 as the client
sees the stream. The gateway's CPU per request (psutil, user + system, over the replay; for
turnout the frontend + attach processes). Errors. Spread = max/mean of the prompt tokens each
engine was asked for.

**Part 2, real llama.cpp** (``--parts llamacpp``): 2 llama.cpp servers (xllamacpp, SmolLM2,
one thread each), a few dozen streamed chat requests of multi-turn sessions on shared system
prompts; every gateway gets the same text. turnout: ``attach --api llamacpp`` (tokens mode)
and ``--router-mode kv --no-kv-events`` (llama.cpp publishes no KV events: the router's own
decisions). See ``benchmarks/gateway_llamacpp.py``.

Usage::

    python benchmarks/gateways.py [--quick] [--out FILE]
    python benchmarks/gateways.py --parts mocker --traces mooncake --gateways "turnout kv" \\
        "smg cache_aware"

The full run takes ~35 minutes on 2 cores (``--quick``: ~6). Peers are installed on first use
(``benchmarks/gateway_peers.py``); one that cannot be installed or run is recorded with the
reason and the others go on. Writes ``benchmarks/results/gateways.json`` and
``gateways.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks.gateway_fleet import MockerFlags  # noqa: E402
from benchmarks.gateway_report import plot, print_table  # noqa: E402
from benchmarks.gateway_runs import (  # noqa: E402
    GATEWAYS,
    MODEL_NAME,
    RunSetup,
    run_gateway,
)
from benchmarks.routing_quality import MOONCAKE_FILE, plan_cell  # noqa: E402
from benchmarks.traces import (  # noqa: E402
    SyntheticTraceConfig,
    Trace,
    generate_sessions,
    load_mooncake,
    oracle_hit_rate,
)

from benchmarks import gateway_peers as peers  # noqa: E402
from turnout.runtime.progress import track  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_GATEWAYS = [
    "turnout kv",
    "turnout round-robin",
    "turnout kv (sglang face)",
    "smg cache_aware",
    "smg round_robin",
    "vllm-router cache_aware",
    "vllm-router round_robin",
    "vllm-router kv_aware",
]
QUICK_GATEWAYS = ["turnout kv", "smg cache_aware", "vllm-router cache_aware"]
#: Requests per wall second the automatic speedup aims at, per trace: 8 engine processes, the
#: gateway and the client share two cores.
WALL_RATE = {"mooncake": 5.0, "synthetic": 10.0}


def make_trace(kind: str, args: argparse.Namespace) -> Trace:
    if kind == "mooncake":
        return load_mooncake(
            args.mooncake_file,
            window_start=2000,
            max_requests=args.mooncake_requests,
            max_input_length=16384,
            max_output_length=64,
            token_seed=args.seed,
        )
    config = SyntheticTraceConfig(
        num_sessions=args.sessions,
        num_system_prompts=16,
        system_prompt_tokens=(1024, 4096),
        turns_per_session=(2, 4),
        user_tokens=(1024, 4096),
        output_tokens=(4, 32),
        session_rate=3.0,
        think_time_s=60.0,
        seed=args.seed,
    )
    return generate_sessions(config)


def peer_status(names: set[str], install: bool) -> dict[str, dict[str, Any]]:
    """Each needed peer's version and venv, or why it is unavailable."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(names):
        peer = peers.PEERS[name]
        why = peers.ensure_installed(peer, install=install)
        version = None if why else peers.installed_version(peer)
        out[name] = {
            "package": peer.package,
            "version": version,
            "venv": str(peer.venv),
            "unavailable": why,
        }
        print(
            f"[{name}] " + (f"unavailable: {why}" if why else f"{peer.package} {version}"),
            flush=True,
        )
    return out


def turnout_version() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.stdout.strip() or "unknown"


def run_mocker_part(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Every trace x gateway on fresh mocker-server fleets, into ``report["mocker"]``."""
    part: dict[str, Any] = {"num_engines": args.engines, "traces": []}
    report["mocker"] = part
    peer_info = report["peers"]
    for kind in track(args.traces, "traces", label=str):
        trace = make_trace(kind, args)
        flags = MockerFlags(block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks)
        oracle = oracle_hit_rate(trace, flags.block_size)
        plan = plan_cell(
            trace,
            oracle,
            args.engines,
            args.load,
            max_num_batched_tokens=flags.max_num_batched_tokens,
            speedup=None,
            wall_rate=args.wall_rate or WALL_RATE[kind],
        )
        flags = MockerFlags(
            block_size=flags.block_size,
            num_gpu_blocks=flags.num_gpu_blocks,
            speedup_ratio=plan.speedup,
        )
        summary = trace.get_summary()
        print(
            f"\n== {kind}: {json.dumps(summary)}\noracle {oracle.hit_rate:.1%}; speedup "
            f"{plan.speedup:.3g}, wall span {plan.wall_span_s:.0f} s",
            flush=True,
        )
        entry: dict[str, Any] = {
            "trace": {"kind": kind, "params": trace.params, "summary": summary},
            "oracle_hit_rate": round(oracle.hit_rate, 4),
            "plan": plan.to_dict(),
            "mocker_flags": dataclasses.asdict(flags),
            "runs": [],
        }
        setup = RunSetup(
            trace=trace,
            plan=plan,
            flags=flags,
            num_engines=args.engines,
            concurrency=args.concurrency,
            timeout_s=args.request_timeout,
        )
        part["traces"].append(entry)  # saved after every run: partial results survive
        for label in args.gateways:
            spec = GATEWAYS[label]
            why = peer_info.get(spec.kind, {}).get("unavailable")
            if why:
                run = {"gateway": label, "skipped": why}
            else:
                with tempfile.TemporaryDirectory(prefix="turnout-gateways-") as tmp:
                    run = run_gateway(spec, setup, Path(tmp))
            if "skipped" in run:
                print(f"[{label}] skipped: {run['skipped']}", flush=True)
            entry["runs"].append(run)
            save(args.out, report)
        print_table(entry)


def save(path: Path, report: dict[str, Any]) -> None:
    """Write the report so far (partial results survive an interrupted run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="a few minutes: 4 engines, short traces, 3 gateways"
    )
    ap.add_argument("--out", type=Path, help="default: results/gateways[_quick].json")
    ap.add_argument(
        "--parts", nargs="+", choices=["mocker", "llamacpp"], default=["mocker", "llamacpp"]
    )
    ap.add_argument(
        "--traces", nargs="+", choices=["mooncake", "synthetic"], default=["mooncake", "synthetic"]
    )
    ap.add_argument(
        "--gateways",
        nargs="+",
        choices=sorted(GATEWAYS),
        help=f"mocker part (default: {DEFAULT_GATEWAYS})",
    )
    ap.add_argument(
        "--no-install",
        action="store_true",
        help="do not pip-install a missing peer (record it as unavailable)",
    )
    ap.add_argument("--engines", type=int, help="mocker-servers (default 8; --quick 4)")
    ap.add_argument("--mooncake-file", type=Path, default=MOONCAKE_FILE)
    ap.add_argument("--mooncake-requests", type=int, help="window length (default 360; quick 60)")
    ap.add_argument("--sessions", type=int, help="synthetic sessions (default 90; quick 16)")
    ap.add_argument(
        "--load",
        type=float,
        default=0.7,
        help="offered uncached prefill / the engines' prefill capacity",
    )
    ap.add_argument("--wall-rate", type=float, help=f"requests per wall second ({WALL_RATE})")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--num-gpu-blocks", type=int, default=8192)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--llamacpp-requests", type=int, help="llama.cpp part (default 36; quick 12)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    quick = args.quick
    args.gateways = args.gateways or (QUICK_GATEWAYS if quick else DEFAULT_GATEWAYS)
    args.engines = args.engines or (4 if quick else 8)
    args.mooncake_requests = args.mooncake_requests or (60 if quick else 360)
    args.sessions = args.sessions or (16 if quick else 90)
    args.llamacpp_requests = args.llamacpp_requests or (12 if quick else 36)
    args.out = args.out or RESULTS / ("gateways_quick.json" if quick else "gateways.json")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    began = time.perf_counter()
    needed = {GATEWAYS[g].kind for g in args.gateways} - {"turnout"}
    if "llamacpp" in args.parts:
        needed |= {"smg", "vllm-router"}
    report: dict[str, Any] = {
        "benchmark": "gateways",
        "command": " ".join(["python", "benchmarks/gateways.py", *(argv or sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "turnout": {"commit": turnout_version()},
        "peers": peer_status(needed, install=not args.no_install),
        "model_name": MODEL_NAME,
        "gateways": args.gateways,
        "notes": peers.NOTES,
    }
    if "mocker" in args.parts:
        run_mocker_part(args, report)
    if "llamacpp" in args.parts:
        from benchmarks.gateway_llamacpp import run_llamacpp_part

        run_llamacpp_part(args, report)
    report["elapsed_s"] = round(time.perf_counter() - began, 1)
    save(args.out, report)
    png = args.out.with_suffix(".png")
    plot(report, png)
    print(f"\nwrote {args.out} and {png} in {report['elapsed_s'] / 60:.1f} min")
    return report


if __name__ == "__main__":
    main()
