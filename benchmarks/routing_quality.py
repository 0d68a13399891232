"""Routing quality: replay one trace against 8 simulated workers under each router mode.

For every mode a fresh stack is started (one ``turnout frontend --router-mode MODE`` and one
``turnout worker --engine mocker --num-workers 8`` process on a file store in a temp dir, so
every mode starts with cold caches), the trace is replayed open-loop over HTTP, and the stack
is stopped. Per mode: TTFT p50/p90/p99, end-to-end latency, throughput, the KV cache hit rate
the workers report (``usage.prompt_tokens_details.cached_tokens`` summed over the prompt
tokens), and how evenly requests spread over the workers. Beside them: the hit rate an
oracle with one unlimited cache would reach on the same trace (the ceiling for any router).

Prompts go as token ids to ``POST /v1/completions`` (streamed, ``ignore_eos``), so the workers
see exactly the trace's prefixes. Arrivals follow the trace's timestamps times
``--time-scale``, which defaults to ``1 / --speedup-ratio``: the trace then loads the
simulated GPUs as it would load real ones, only faster. Latencies are measured in wall time
from each request's *scheduled* arrival (a client that falls behind shows up as latency, not
as a lighter load); ``x speedup`` turns them into simulated GPU time (frontend overhead is
magnified alike, so compare modes, not absolute figures).

A mode the frontend rejects (``kv`` before it is built, a flag it does not have) is skipped
with a note in the output rather than failing the whole run.

Usage::

    .venv/bin/python benchmarks/routing_quality.py                       # all modes, synthetic
    .venv/bin/python benchmarks/routing_quality.py --modes round-robin random
    .venv/bin/python benchmarks/routing_quality.py --trace mooncake --mooncake-file t.jsonl

Writes ``benchmarks/results/routing_quality.json`` and ``routing_quality_ttft_cdf.png``.
Defaults take about five minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks.traces import (  # noqa: E402
    SyntheticTraceConfig,
    Trace,
    generate_sessions,
    load_mooncake,
    oracle_hit_rate,
)

from turnout.frontend.service import free_port  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_MODES = ["round-robin", "random", "kv", "kv --no-kv-events"]
MODEL_NAME = "routing-bench"
_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode


# ------------------------------------------------------------------------------ the client


@dataclass(slots=True)
class RequestResult:
    """One replayed request, as the client saw it (times in wall seconds)."""

    index: int
    #: How late the client sent it after its scheduled arrival (client lag + concurrency cap).
    send_delay_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    worker_id: str | None = None
    error: str | None = None


def _request_body(model: str, tokens: np.ndarray, max_tokens: int) -> bytes:
    return _json_encode(
        {
            "model": model,
            "prompt": tokens.tolist(),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "nvext": {"extra_fields": ["worker_id"]},
        }
    )


async def _send_one(
    client: httpx.AsyncClient, body: bytes, scheduled: float, result: RequestResult
) -> None:
    """POST one streamed completion; fill ``result`` (latencies from ``scheduled``)."""
    result.send_delay_s = time.perf_counter() - scheduled
    headers = {"content-type": "application/json"}
    async with client.stream("POST", "/v1/completions", content=body, headers=headers) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            result.error = f"HTTP {resp.status_code}: {text[:300]}"
            return
        buffer = b""
        async for chunk in resp.aiter_bytes():
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                _on_event(event, scheduled, result)
    result.e2e_s = time.perf_counter() - scheduled
    if result.error is None and result.ttft_s is None:
        result.error = "stream ended without a token"


def _on_event(event: bytes, scheduled: float, result: RequestResult) -> None:
    event = event.strip()
    if not event.startswith(b"data:"):
        return
    data = event[5:].strip()
    if data == b"[DONE]":
        return
    obj = _json_decode(data)
    if "error" in obj:
        result.error = f"in-stream error: {obj['error'].get('message')}"
        return
    choices = obj.get("choices") or []
    # The first token is the first non-empty text; a stream whose only token decoded to
    # nothing (a partial UTF-8 sequence) gets its TTFT at the finish chunk.
    if (
        choices
        and result.ttft_s is None
        and (choices[0].get("text") or choices[0].get("finish_reason"))
    ):
        result.ttft_s = time.perf_counter() - scheduled
    if choices and (nvext := obj.get("nvext")):
        result.worker_id = nvext.get("worker_id")
    if usage := obj.get("usage"):
        result.prompt_tokens = usage["prompt_tokens"]
        result.output_tokens = usage["completion_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens") or 0


async def replay(
    url: str, model: str, trace: Trace, *, time_scale: float, concurrency: int, timeout_s: float
) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time (open loop, at most ``concurrency`` at once).

    Returns the results in trace order and the wall seconds from the first send to the
    last completion.
    """
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    cap = asyncio.Semaphore(concurrency)
    results = [RequestResult(i) for i in range(len(trace.requests))]
    async with httpx.AsyncClient(
        base_url=url, limits=limits, timeout=httpx.Timeout(timeout_s)
    ) as client:
        start = time.perf_counter() + 0.5  # time to build the first bodies

        async def one(i: int) -> None:
            request = trace.requests[i]
            scheduled = start + request.arrival_s * time_scale
            body = _request_body(model, trace.prompt_tokens(request), request.output_length)
            await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
            async with cap:
                try:
                    await _send_one(client, body, scheduled, results[i])
                except httpx.HTTPError as exc:
                    results[i].error = f"{type(exc).__name__}: {exc}"

        # Tasks are created just ahead of their arrival, so bodies are not all built at once.
        tasks: list[asyncio.Task[None]] = []
        for i, request in enumerate(trace.requests):
            ahead = start + request.arrival_s * time_scale - 0.25 - time.perf_counter()
            if ahead > 0:
                await asyncio.sleep(ahead)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return results, elapsed


# ------------------------------------------------------------------------------- the stack


@dataclass
class Stack:
    """One frontend and one mocker worker process on a private file store."""

    tmp: Path
    frontend_args: list[str]
    worker_args: list[str]
    port: int = field(default_factory=free_port)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _common(self) -> list[str]:
        return ["--store", "file", "--store-path", str(self.tmp / "store.sqlite"),
                "--lease-ttl", "2", "--log-level", "warning"]  # fmt: skip

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "turnout", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def log_tail(self, name: str, lines: int = 8) -> str:
        path = self.tmp / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def start_frontend(self, timeout: float = 60) -> str | None:
        """Start the frontend; None once it serves, else why it did not start."""
        proc = self._spawn(
            "frontend", ["frontend", "--port", str(self.port), *self._common(), *self.frontend_args]
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"frontend exited with status {proc.returncode}: {self.log_tail('frontend')}"
            try:
                if httpx.get(self.url + "/live", timeout=2).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return f"frontend did not come up in {timeout:.0f} s: {self.log_tail('frontend')}"

    def start_workers(self, expected: int, timeout: float = 120) -> str | None:
        """Start the worker process; None once the frontend lists ``expected`` instances."""
        proc = self._spawn("worker", ["worker", *self._common(), *self.worker_args])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"worker exited with status {proc.returncode}: {self.log_tail('worker')}"
            if self.procs[0].poll() is not None:
                return f"frontend exited: {self.log_tail('frontend')}"
            try:
                models = httpx.get(self.url + "/health", timeout=2).json().get("models", [])
                if any(m["name"] == MODEL_NAME and len(m["instances"]) >= expected for m in models):
                    return None
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        return f"{expected} workers did not register in {timeout:.0f} s: {self.log_tail('worker')}"

    def stop(self) -> None:
        """SIGINT everyone, wait a little, then SIGKILL what is left (process groups)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def frontend_help() -> str:
    out = subprocess.run(
        [sys.executable, "-m", "turnout", "frontend", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout + out.stderr


def unsupported_flags(mode_args: list[str], help_text: str) -> list[str]:
    """The ``--flags`` of a mode that ``turnout frontend --help`` does not list."""
    return [a for a in mode_args if a.startswith("--") and a.split("=")[0] not in help_text]


# ------------------------------------------------------------------------------- reporting


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values) * 1000.0
    out = {f"p{q}": round(float(np.percentile(arr, q)), 2) for q in qs}
    out["mean"] = round(float(arr.mean()), 2)
    return out


def summarize(results: list[RequestResult], elapsed: float, speedup: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None and r.ttft_s is not None and r.e2e_s is not None]
    errors = [r.error for r in results if r.error is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_worker = Counter(r.worker_id or "?" for r in ok)
    counts = sorted(per_worker.values(), reverse=True)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    return {
        "num_ok": len(ok),
        "num_errors": len(errors),
        "first_errors": sorted(set(errors))[:3],
        "ttft_ms": percentiles(ttft),
        "e2e_ms": percentiles(e2e),
        "ttft_sim_ms": {k: round(v * speedup, 1) for k, v in percentiles(ttft).items()},
        "e2e_sim_ms": {k: round(v * speedup, 1) for k, v in percentiles(e2e).items()},
        "send_delay_ms": percentiles([r.send_delay_s for r in results]),
        "wall_s": round(elapsed, 2),
        "requests_per_s": round(len(ok) / elapsed, 2),
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / elapsed, 1),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "requests_per_worker": counts,
        "worker_imbalance": round(counts[0] / (len(ok) / len(counts)), 3) if counts else None,
        "ttft_s_sorted": sorted(round(t, 5) for t in ttft),
    }


def print_table(report: dict[str, Any]) -> None:
    oracle = report["oracle"]["hit_rate"]
    print(f"\noracle hit rate (unlimited cache, block {report['oracle']['block_size']}): "
          f"{oracle:.1%}; wall ms (x{report['speedup_ratio']:g} = simulated GPU ms)")  # fmt: skip
    header = (f"{'mode':<20} {'ok':>5} {'err':>4} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'E2E p50':>8} {'E2E p99':>8} {'req/s':>6} {'tok/s':>7} {'hit':>6} "
              f"{'/oracle':>7} {'imbal':>6}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for mode in report["modes"]:
        if "skipped" in mode:
            print(f"{mode['mode']:<20} skipped: {mode['skipped'].splitlines()[0][:90]}")
            continue
        s = mode["summary"]
        ratio = s["cache_hit_rate"] / oracle if oracle else 0.0
        print(
            f"{mode['mode']:<20} {s['num_ok']:>5} {s['num_errors']:>4} "
            f"{s['ttft_ms'].get('p50', 0):>9.1f} {s['ttft_ms'].get('p99', 0):>9.1f} "
            f"{s['e2e_ms'].get('p50', 0):>8.0f} {s['e2e_ms'].get('p99', 0):>8.0f} "
            f"{s['requests_per_s']:>6.1f} {s['output_tokens_per_s']:>7.0f} "
            f"{s['cache_hit_rate']:>6.1%} {ratio:>7.2f} {s['worker_imbalance'] or 0:>6.2f}"
        )


def plot_cdf(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for mode in report["modes"]:
        ttft = mode.get("summary", {}).get("ttft_s_sorted")
        if not ttft:
            continue
        x = np.asarray(ttft) * 1000.0
        y = np.arange(1, len(x) + 1) / len(x)
        hit = mode["summary"]["cache_hit_rate"]
        ax.step(x, y, where="post", label=f"{mode['mode']} (hit {hit:.0%})")
    ax.set_xscale("log")
    ax.set_xlabel(f"TTFT, wall ms (x{report['speedup_ratio']:g} = simulated ms)")
    ax.set_ylabel("fraction of requests")
    trace = report["trace"]
    ax.set_title(
        f"TTFT CDF: {trace['kind']} trace, {trace['summary']['num_requests']} requests, "
        f"{report['num_workers']} mocker workers; oracle hit {report['oracle']['hit_rate']:.0%}"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------ main


def make_trace(args: argparse.Namespace) -> Trace:
    if args.trace == "mooncake":
        if not args.mooncake_file:
            raise SystemExit("--trace mooncake needs --mooncake-file")
        trace = load_mooncake(
            args.mooncake_file,
            max_requests=args.max_requests,
            max_input_length=args.max_input_length,
            max_output_length=args.max_output_length,
            token_seed=args.seed,
        )
        return trace
    config = SyntheticTraceConfig(
        num_sessions=args.sessions,
        num_system_prompts=args.system_prompts,
        system_prompt_tokens=tuple(args.system_prompt_tokens),
        turns_per_session=tuple(args.turns),
        user_tokens=tuple(args.user_tokens),
        output_tokens=tuple(args.output_tokens),
        session_rate=args.session_rate,
        think_time_s=args.think_time,
        seed=args.seed,
    )
    trace = generate_sessions(config)
    if args.max_requests is not None:
        trace.requests = trace.requests[: args.max_requests]
    return trace


def run_mode(
    spec: str, args: argparse.Namespace, trace: Trace, help_text: str, time_scale: float
) -> dict[str, Any]:
    mode_args = shlex.split(spec)
    entry: dict[str, Any] = {"mode": spec}
    missing = unsupported_flags(mode_args[1:], help_text)
    if missing:
        entry["skipped"] = f"turnout frontend has no {', '.join(missing)} flag (yet)"
        return entry
    worker_args = [
        "--engine", "mocker", "--model-name", MODEL_NAME,
        "--num-workers", str(args.workers), "--speedup-ratio", str(args.speedup_ratio),
        "--block-size", str(args.block_size), "--num-gpu-blocks", str(args.num_gpu_blocks),
        "--seed", str(args.seed),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="turnout-routing-") as tmp:
        stack = Stack(Path(tmp), ["--router-mode", *mode_args], worker_args)
        try:
            started = time.perf_counter()
            problem = stack.start_frontend() or stack.start_workers(args.workers)
            if problem is not None:
                entry["skipped"] = problem
                return entry
            entry["startup_s"] = round(time.perf_counter() - started, 2)
            print(f"[{spec}] {args.workers} workers up in {entry['startup_s']} s; replaying "
                  f"{len(trace.requests)} requests", flush=True)  # fmt: skip
            results, elapsed = asyncio.run(
                replay(
                    stack.url, MODEL_NAME, trace, time_scale=time_scale,
                    concurrency=args.concurrency, timeout_s=args.request_timeout,
                )
            )  # fmt: skip
            entry["summary"] = summarize(results, elapsed, args.speedup_ratio)
            if entry["summary"]["num_ok"] == 0:
                entry["frontend_log_tail"] = stack.log_tail("frontend", 20)
                entry["worker_log_tail"] = stack.log_tail("worker", 20)
        finally:
            stack.stop()
    return entry


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--modes",
        nargs="+",
        default=DEFAULT_MODES,
        help="router modes; a mode may carry frontend flags: 'kv --no-kv-events'",
    )
    ap.add_argument("--trace", choices=["synthetic", "mooncake"], default="synthetic")
    ap.add_argument("--mooncake-file", help="Mooncake JSONL trace (with --trace mooncake)")
    ap.add_argument("--max-requests", type=int, help="replay only the first N requests")
    ap.add_argument(
        "--max-input-length",
        type=int,
        default=7168,
        help="mooncake: cut longer prompts (the SmolLM2 card's context is 8192)",
    )
    ap.add_argument(
        "--max-output-length",
        type=int,
        default=512,
        help="mooncake: cap output lengths (prompt + output must fit the context)",
    )
    g = ap.add_argument_group("synthetic trace (times in simulated seconds)")
    g.add_argument("--sessions", type=int, default=96)
    g.add_argument("--system-prompts", type=int, default=16)
    g.add_argument("--system-prompt-tokens", type=int, nargs=2, default=[1024, 4096])
    g.add_argument("--turns", type=int, nargs=2, default=[2, 6], help="turns per session")
    g.add_argument("--user-tokens", type=int, nargs=2, default=[32, 384])
    g.add_argument("--output-tokens", type=int, nargs=2, default=[16, 96])
    g.add_argument("--session-rate", type=float, default=0.6, help="new sessions per second")
    g.add_argument("--think-time", type=float, default=10.0, help="mean gap between turns (s)")
    g.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("workers and replay")
    g.add_argument("--workers", type=int, default=8)
    g.add_argument("--speedup-ratio", type=float, default=4.0)
    g.add_argument(
        "--time-scale",
        type=float,
        help="wall seconds per trace second (default: 1 / speedup ratio)",
    )
    g.add_argument("--block-size", type=int, default=64)
    g.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=256,
        help="KV blocks per worker: small, so caches fill and routing matters",
    )
    g.add_argument("--concurrency", type=int, default=64, help="most requests in flight")
    g.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "routing_quality.json")
    ap.add_argument("--plot", type=Path, default=RESULTS / "routing_quality_ttft_cdf.png")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.speedup_ratio <= 0:
        raise SystemExit("--speedup-ratio must be > 0 (0 would not simulate time at all)")
    time_scale = args.time_scale if args.time_scale is not None else 1.0 / args.speedup_ratio
    trace = make_trace(args)
    summary = trace.get_summary()
    pool_tokens = args.num_gpu_blocks * args.block_size
    biggest = max((r.input_length + r.output_length for r in trace.requests), default=0)
    if biggest > pool_tokens:
        raise SystemExit(
            f"a request needs {biggest} tokens of KV cache, more than a worker's {pool_tokens}; "
            "raise --num-gpu-blocks or lower --max-input-length"
        )
    oracle = oracle_hit_rate(trace, args.block_size)
    print(f"trace: {json.dumps(summary)}")
    print(f"oracle hit rate: {oracle.hit_rate:.1%}; expected wall time per mode: "
          f"{summary.get('duration_s', 0) * time_scale:.0f} s + drain", flush=True)  # fmt: skip
    help_text = frontend_help()
    report: dict[str, Any] = {
        "benchmark": "routing_quality",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "trace": {"kind": trace.kind, "params": trace.params, "summary": summary},
        "num_workers": args.workers,
        "speedup_ratio": args.speedup_ratio,
        "time_scale": time_scale,
        "block_size": args.block_size,
        "num_gpu_blocks": args.num_gpu_blocks,
        "concurrency": args.concurrency,
        "oracle": {
            "block_size": oracle.block_size,
            "prompt_tokens": oracle.prompt_tokens,
            "cached_tokens": oracle.cached_tokens,
            "hit_rate": round(oracle.hit_rate, 4),
        },
        "modes": [],
    }
    for spec in args.modes:
        entry = run_mode(spec, args, trace, help_text, time_scale)
        if "skipped" in entry:
            print(f"[{spec}] skipped: {entry['skipped']}", flush=True)
        report["modes"].append(entry)
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot_cdf(report, args.plot)
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
