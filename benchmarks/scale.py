"""What one frontend costs as the worker count grows: CPU per request, decisions, events, memory.

For each plane set (``etcd+tcp+zmq``, ``etcd+nats+nats``) and each worker count N (default 8,
64, 256, 1024): a private etcd (and nats-server), ``--frontends`` frontends (default 2) in
``--router-mode kv`` with replica sync, and N mocker instances in ``ceil(N / --per-process)``
``turnout worker --engine mocker`` processes, each process on a network namespace of its own
when the machine allows (``--hosts netns``; see ``scale_stack``), else on loopback. Then a
closed loop of requests through every frontend at once (``--concurrency`` connections each,
``--seconds`` long, after a warm-up), prompts sharing a few long prefixes, so KV events flow.

Reported per row:

* ``registration_s``: from starting the worker processes until every frontend's ``/health``
  lists all N instances;
* ``idle_cpu_pct``: the frontends' CPU (percent of one core, summed) over ``--idle-seconds``
  with no request: the background cost of N workers (load reports, leases, watches);
* ``completed``, ``errors`` (non-200 answers and broken connections), requests/s;
* ``cpu_ms_per_request``: CPU seconds of the frontend processes only (psutil, all threads)
  over the measured window / requests completed;
* ``decision_p50_ms``/``decision_p99_ms``: the frontends' own KV router decision histogram
  (the first ``/metrics`` histogram whose name holds ``decision`` and ``seconds``), over the
  window; "n/a" when the frontend exports none;
* ``kv_events_applied_per_s``: ``turnout_kv_events_applied_total`` over the window, summed
  over the frontends; ``published_kv_events_per_s``/``published_load_reports_per_s``: what
  the workers published, counted by one more subscriber (``event_tap.py``; ``--no-tap``);
* ``rss_mib``: the largest frontend's resident memory after the window.

Table to stdout, JSON to ``benchmarks/results/scale.json``, a plot of CPU/request and decision
p50/p99 against N to ``scale.png``. ``--profile N ...`` samples the first frontend with py-spy
during the window at those worker counts, and adds where its CPU went to the JSON.

    .venv/bin/python benchmarks/scale.py             # 8 64 256 1024, both plane sets (~12 min)
    .venv/bin/python benchmarks/scale.py --quick     # 8 and 64
    .venv/bin/python benchmarks/scale.py --planes etcd+tcp+zmq --workers 8 1024 --profile 8 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_http import _Conn, percentile, render_post
from frontend_overhead import summarize_pyspy
from scale_stack import (
    MODEL,
    PLANE_SETS,
    Stack,
    StackConfig,
    bucket_quantile,
    counter_sum,
    find_family,
    get_metrics,
    histogram_buckets,
    minus,
)
from turnout.runtime.progress import track

RESULTS = Path(__file__).parent / "results"
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi"]  # fmt: skip
#: A histogram family name that holds the KV router's decision time.
DECISION_FAMILY = r"decision.*seconds"


def make_bodies(
    count: int, prefixes: int, prefix_words: int, tail_words: int, seed: int = 0
) -> list[dict[str, Any]]:
    """Completion requests whose prompts share one of ``prefixes`` long prefixes."""
    rng = random.Random(seed)
    heads = [" ".join(rng.choice(WORDS) for _ in range(prefix_words)) for _ in range(prefixes)]
    tails = [" ".join(rng.choice(WORDS) for _ in range(tail_words)) for _ in range(count)]
    return [{"model": MODEL, "prompt": f"{heads[i % prefixes]} {tails[i]}"} for i in range(count)]


async def closed_loop(
    port: int, raws: list[bytes], concurrency: int, seconds: float
) -> tuple[int, int, list[float]]:
    """``concurrency`` keep-alive connections, each sending the next request as soon as the
    last one ends, for ``seconds``; returns (completed, errors, latencies)."""
    loop = asyncio.get_running_loop()
    stop_at = time.perf_counter() + seconds
    latencies: list[float] = []
    errors = 0

    async def connect() -> _Conn:
        _, conn = await loop.create_connection(_Conn, "127.0.0.1", port)
        return conn

    async def worker(k: int) -> None:
        nonlocal errors
        conn = await connect()
        i = k
        while time.perf_counter() < stop_at:
            raw = raws[i % len(raws)]
            i += 7
            t0 = time.perf_counter()
            try:
                status, _, _ = await asyncio.wait_for(conn.request(raw, False), 120)
            except (OSError, TimeoutError, RuntimeError):
                errors += 1
                if conn.transport is not None:
                    conn.transport.close()
                conn = await connect()
                continue
            if status == 200:
                latencies.append(time.perf_counter() - t0)
            else:
                errors += 1
        if conn.transport is not None:
            conn.transport.close()

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return len(latencies), errors, latencies


async def load_all(
    ports: list[int], raws: list[bytes], concurrency: int, seconds: float
) -> tuple[int, int, list[float], float]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(closed_loop(p, raws, concurrency, seconds) for p in ports))
    elapsed = time.perf_counter() - t0
    lat = [x for r in results for x in r[2]]
    return sum(r[0] for r in results), sum(r[1] for r in results), lat, elapsed


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            c = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += c.user + c.system + c.children_user + c.children_system
    return total


def run_one(planes: str, n: int, args: argparse.Namespace, raws: list[bytes]) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"scale-{planes}-{n}-"))
    config = StackConfig(
        planes=planes, workers=n, frontends=args.frontends, per_process=args.per_process,
        speedup=args.speedup, num_gpu_blocks=args.num_gpu_blocks, hosts=args.hosts,
        tap=args.tap, frontend_flags=["--max-inflight", "0"],
    )  # fmt: skip
    stack = Stack(config, tmp)
    row: dict[str, Any] = {"planes": planes, "workers": n}
    try:
        stack.start_services()
        row["hosts"] = stack.host_mode
        row["worker_processes"] = -(-n // args.per_process)
        stack.start_frontends()
        if args.tap:
            stack.start_tap()
        stack.start_workers()
        row["registration_s"] = round(stack.wait_registered(args.register_timeout), 2)
        fronts = stack.frontend_procs()
        workers = stack.worker_procs()
        # Warm-up: tokenizer and template caches, connections to the workers.
        asyncio.run(load_all(stack.ports, raws, args.concurrency, args.warmup_seconds))
        cpu0 = cpu_seconds(fronts)
        time.sleep(args.idle_seconds)
        row["idle_cpu_pct"] = round(100 * (cpu_seconds(fronts) - cpu0) / args.idle_seconds, 1)
        spy = maybe_profile(stack, n, args, tmp)
        texts0 = [get_metrics(p) for p in stack.ports]
        tap0 = stack.tap_counts()
        cpu0, wcpu0 = cpu_seconds(fronts), cpu_seconds(workers)
        done, errors, lat, elapsed = asyncio.run(
            load_all(stack.ports, raws, args.concurrency, args.seconds)
        )
        cpu1, wcpu1 = cpu_seconds(fronts), cpu_seconds(workers)
        tap1 = stack.tap_counts()
        texts1 = [get_metrics(p) for p in stack.ports]
        if spy is not None:
            row["profile"] = finish_profile(spy, fronts[0].pid, tmp, args)
        row.update({
            "completed": done,
            "errors": errors,
            "requests_per_s": round(done / elapsed, 1),
            "cpu_ms_per_request": round(1000 * (cpu1 - cpu0) / max(done, 1), 3),
            "workers_cpu_ms_per_request": round(1000 * (wcpu1 - wcpu0) / max(done, 1), 3),
            "latency_p50_ms": round(1000 * percentile(lat, 0.5), 2),
            "latency_p99_ms": round(1000 * percentile(lat, 0.99), 2),
        })  # fmt: skip
        row.update(decision_stats(texts0, texts1))
        applied = sum(
            counter_sum(b, "turnout_kv_events_applied_total")
            - counter_sum(a, "turnout_kv_events_applied_total")
            for a, b in zip(texts0, texts1, strict=True)
        )
        row["kv_events_applied_per_s"] = round(applied / elapsed, 1)
        if tap0 and tap1:
            span = max(tap1["at"] - tap0["at"], 1e-9)
            row["published_kv_events_per_s"] = round(
                (tap1["kv_events"] - tap0["kv_events"]) / span, 1
            )
            row["published_load_reports_per_s"] = round(
                (tap1["load_reports"] - tap0["load_reports"]) / span, 1
            )
            row["tap_dropped"] = tap1["dropped"]
        row["rss_mib"] = round(max(p.memory_info().rss for p in fronts) / 2**20, 1)
        row["worker_rss_mib_per_process"] = round(
            max((p.memory_info().rss for p in workers), default=0) / 2**20, 1
        )
    except Exception as exc:  # a failed row is a result too: say what broke
        row["failure"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        stack.close()
        if not args.keep_logs and "failure" not in row:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            row["logs"] = str(tmp)
    return row


def decision_stats(before: list[str], after: list[str]) -> dict[str, Any]:
    """Quantiles of the frontends' decision histogram over the window, in ms ("n/a" without
    one; ">X" past its last finite bucket X), and the window's bucket counts."""
    family = next((f for t in after if (f := find_family(t, DECISION_FAMILY))), None)
    if family is None:
        return {"decision_p50_ms": "n/a", "decision_p99_ms": "n/a", "decision_metric": None}
    total: dict[float, float] = {}
    for a, b in zip(before, after, strict=True):
        for k, v in minus(histogram_buckets(b, family), histogram_buckets(a, family)).items():
            total[k] = total.get(k, 0.0) + v
    top = max((k for k in total if not math.isinf(k)), default=0.0)

    def ms(q: float) -> float | str:
        value = bucket_quantile(total, q)
        if value is None:
            return "n/a"
        return f">{1000 * top:g}" if math.isinf(value) else round(1000 * value, 3)

    return {
        "decision_p50_ms": ms(0.5),
        "decision_p99_ms": ms(0.99),
        "decision_metric": family,
        "decision_buckets": {
            ("+Inf" if math.isinf(k) else f"{k:g}"): v for k, v in sorted(total.items())
        },
    }


def maybe_profile(
    stack: Stack, n: int, args: argparse.Namespace, tmp: Path
) -> subprocess.Popen[bytes] | None:
    if n not in args.profile:
        return None
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = tmp / "profile.txt"
    return subprocess.Popen(
        [pyspy, "record", "--pid", str(stack.frontends[0].pid), "--nonblocking", "--threads",
         "-r", "100", "-f", "raw", "-o", str(out), "-d", str(int(args.seconds) + 2)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def finish_profile(
    spy: subprocess.Popen[bytes], pid: int, tmp: Path, args: argparse.Namespace
) -> dict[str, Any]:
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(timeout=30)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()
    out = tmp / "profile.txt"
    if not out.exists():
        return {"error": "py-spy wrote nothing"}
    summary = summarize_pyspy(out, pid, top=args.profile_top)
    if args.profile_dir is not None:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(out, args.profile_dir / f"{tmp.name.rsplit('-', 1)[0]}.txt")
    return summary


#: Table columns: (heading, row key, width).
COLUMNS = [
    ("N", "workers", 5), ("reg s", "registration_s", 6), ("idle%", "idle_cpu_pct", 6),
    ("done", "completed", 6), ("err", "errors", 4), ("req/s", "requests_per_s", 6),
    ("ms/req", "cpu_ms_per_request", 7), ("dec p50", "decision_p50_ms", 7),
    ("dec p99", "decision_p99_ms", 7), ("kv ev/s", "kv_events_applied_per_s", 8),
    ("load/s", "published_load_reports_per_s", 7), ("RSS MiB", "rss_mib", 7),
]  # fmt: skip
HEADER = f"{'planes':<15}" + "".join(f" {h:>{w}}" for h, _, w in COLUMNS)


def print_row(r: dict[str, Any]) -> None:
    head = f"{r['planes']:<15} {r['workers']:>5}"
    if "failure" in r:
        print(f"{head}  FAILED: {r['failure'][:300]} (logs: {r.get('logs')})", flush=True)
        return
    print(f"{r['planes']:<15}" + "".join(f" {r.get(k, '-')!s:>{w}}" for _, k, w in COLUMNS))


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for planes in sorted({r["planes"] for r in runs}):
        rows = [r for r in runs if r["planes"] == planes and "failure" not in r]
        xs = [r["workers"] for r in rows]
        ax1.plot(xs, [r["cpu_ms_per_request"] for r in rows], "o-", label=planes)
        for key, style in (("decision_p50_ms", "o-"), ("decision_p99_ms", "s--")):
            dec = [(r["workers"], r[key]) for r in rows if isinstance(r[key], float)]
            if dec:
                label = f"{planes} {key.split('_')[1]}"
                ax2.plot([d[0] for d in dec], [d[1] for d in dec], style, label=label)
    ax2.set_yscale("log")
    for ax, title in (
        (ax1, "frontend CPU ms / request"),
        (ax2, "KV router decision p50 / p99 (ms)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("mocker instances (N)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--quick", action="store_true", help="worker counts 8 and 64")
    p.add_argument("--planes", nargs="+", default=list(PLANE_SETS), choices=PLANE_SETS)
    p.add_argument("--frontends", type=int, default=2)
    p.add_argument("--per-process", type=int, default=128, help="mocker instances per process")
    p.add_argument("--speedup", type=float, default=100.0, help="mocker --speedup-ratio")
    p.add_argument("--num-gpu-blocks", type=int, default=2048, help="KV blocks per instance")
    p.add_argument("--hosts", choices=["netns", "loopback"], default="netns")
    p.add_argument("--concurrency", type=int, default=32, help="connections per frontend")
    p.add_argument("--seconds", type=float, default=15.0, help="measured window")
    p.add_argument("--warmup-seconds", type=float, default=3.0)
    p.add_argument("--idle-seconds", type=float, default=3.0)
    p.add_argument("--register-timeout", type=float, default=180.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--stream", action="store_true", help="streamed requests (SSE)")
    p.add_argument("--prefixes", type=int, default=16, help="shared prompt prefixes")
    p.add_argument("--prefix-words", type=int, default=300)
    p.add_argument("--tail-words", type=int, default=160, help="unique words: new blocks")
    p.add_argument("--no-tap", dest="tap", action="store_false", help="no event tap")
    p.add_argument("--profile", type=int, nargs="*", default=[], help="N to profile (py-spy)")
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--profile-dir", type=Path, help="keep py-spy's raw profiles here")
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--output", type=Path, default=RESULTS / "scale.json")
    args = p.parse_args()
    if args.quick:
        args.workers = [8, 64]
    # SIGTERM (and SIGINT, ignored in background jobs) stop the run through the same cleanup.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    bodies = make_bodies(256, args.prefixes, args.prefix_words, args.tail_words)
    extra = {"max_tokens": args.max_tokens, "stream": args.stream}
    raws = [render_post("127.0.0.1", "/v1/completions", json.dumps({**b, **extra}).encode())
            for b in bodies]  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    print(f"commit {commit}\n{HEADER}", flush=True)
    runs = []
    for planes in track(args.planes, "planes", label=str):
        for n in args.workers:
            row = run_one(planes, n, args, raws)
            runs.append(row)
            print_row(row)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps({"commit": commit, "settings": settings, "runs": runs}, indent=2)
    )
    print(f"wrote {args.output}")
    plot(runs, args.output.with_suffix(".png"))


if __name__ == "__main__":
    main()
