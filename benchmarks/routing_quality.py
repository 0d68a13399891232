"""Routing quality: replay a trace against simulated workers under each router mode.

For every cell of a matrix (worker count x load) and every router mode a fresh stack is
started (one ``turnout frontend --router-mode MODE`` and one ``turnout worker --engine mocker
--num-workers N`` process on a file store in a temp dir, so every run starts with cold
caches), the trace is replayed open-loop over HTTP (streamed ``/v1/completions`` with token-id
prompts, ``ignore_eos``; requests of a multi-turn session carry ``x-session-id``), and the
stack is stopped. ``--peer dynamo`` adds the same cell against Dynamo 1.6.1's frontend and
mocker (``benchmarks/dynamo_peer.py``, its default KV router, mode ``dynamo kv``) when it is
installed; otherwise the reason is recorded and the run goes on.

Per run: the cache hit share (``usage.prompt_tokens_details.cached_tokens`` over prompt
tokens) and its ratio to the oracle's (one unlimited cache seeing every request: the ceiling
of any router), TTFT and ITL percentiles (ITL per request = (e2e - TTFT) / (output tokens -
1)), throughput, and the spread of work = max / mean over the N workers of the prompt tokens
each served (by ``nvext.worker_id``; 1.0 is perfectly even).

**Load.** ``--load 0.7 0.95`` is offered prefill work relative to the cluster's prefill
capacity, both in tokens per *simulated* second:

* capacity = N workers x the mocker's prefill throughput at a full chunk, ``T / prefill_ms(T)``
  with ``T = --max-num-batched-tokens`` (8192: 48.4k tokens/s per worker with
  ``turnout.engines.mocker.timing.PolynomialTimingModel``);
* offered work = the prompt tokens the oracle could *not* serve from cache (the least prefill
  any router must do) / the trace's span (first to last arrival), after scaling.

So the trace's arrivals are multiplied by ``sim_scale = uncached / (span x load x capacity)``
(simulated seconds per trace second). A router that caches worse than the oracle does more
prefill than that (round-robin may run past capacity at load 0.95, which is the point), and
decode steps come on top: load is a lower bound of how busy the workers are.

**Time.** The mocker runs ``--speedup-ratio`` times faster than simulated time, and the
replay follows: wall seconds per trace second = ``sim_scale / speedup``. By default the
speedup is chosen per cell so that requests arrive at ``--wall-rate`` per wall second (what
two CPU cores serve without the client falling behind), clamped to [0.02, 10]; every latency
is reported in simulated milliseconds (wall x speedup), from each request's *scheduled*
arrival (a client that falls behind shows up as latency, not as a lighter load; frontend
overhead is scaled alike, so compare modes, not absolute figures), or, for a turn that had
to wait for its session's previous turn, from when that turn finished. The ``load`` column
is the load actually offered (planned load x planned span / span of the sends): the
Mooncake window meets the plan; on the synthetic trace sessions' turns wait for their
previous turns (a turn's decode outlasts the scaled think time), so it reaches ~0.25-0.4.

**Traces.** ``--trace synthetic`` (default): 300 seeded multi-turn sessions (~900 requests,
prompts of 2K-18K tokens) on 16 shared system prompts, with long user turns so that prefill
dominates; a turn is sent at its (scaled) arrival time but never before the previous turn of
its session has finished. ``--trace mooncake``: a window of the Mooncake FAST'25 conversation
trace (``../shared/traces/mooncake_conversation.jsonl`` beside the repo), by default records
2000..2499 (500 requests, no sessions), prompts cut to 16,384 tokens, outputs to 64; its
512-token hash blocks become token blocks, the router and mocker use blocks of
``--block-size`` (64). ``--num-gpu-blocks`` (8192 per worker) holds the largest request and
what is in flight at these loads, not every prefix of the window at 8 workers.

A mode the frontend rejects (a flag it does not have yet) is skipped with a note.

Usage::

    .venv/bin/python benchmarks/routing_quality.py                    # synthetic, full matrix
    .venv/bin/python benchmarks/routing_quality.py --trace mooncake   # Mooncake window
    .venv/bin/python benchmarks/routing_quality.py --peer dynamo      # + Dynamo's kv router
    .venv/bin/python benchmarks/routing_quality.py --quick            # ~1 minute smoke
    .venv/bin/python benchmarks/routing_quality.py --workers 8 --load 0.7 \\
        --modes round-robin "kv --router-cost blocks"

The full default matrix (workers 8 and 32 x loads 0.7 and 0.95 x 4 modes) takes about 10
minutes (synthetic) and 15 minutes (mooncake) on a 2-core machine; ``--peer dynamo`` adds a
quarter (the expected duration is printed at the start).
Writes ``benchmarks/results/routing_quality_<trace>.json`` (one entry per cell) and one TTFT
CDF per cell, ``routing_quality_<trace>_w<N>_load<L>_ttft_cdf.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks.dynamo_peer import worker_label  # noqa: E402
from benchmarks.process_groups import stop_process_groups  # noqa: E402
from benchmarks.traces import (  # noqa: E402
    OracleResult,
    SyntheticTraceConfig,
    Trace,
    generate_sessions,
    load_mooncake,
    oracle_hit_rate,
)

from turnout.engines.mocker.timing import PolynomialTimingModel, TimingModel  # noqa: E402
from turnout.frontend.service import free_port  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MOONCAKE_FILE = ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
DEFAULT_MODES = ["round-robin", "random", "kv --router-cost blocks", "kv --router-cost ttft"]
DEFAULT_WORKERS = [8, 32]
DEFAULT_LOADS = [0.7, 0.95]
#: Mode label of the Dynamo peer's runs.
DYNAMO_MODE = "dynamo kv"
MODEL_NAME = "routing-bench"
#: The speedup chosen per cell stays within these.
SPEEDUP_BOUNDS = (0.02, 10.0)
#: Defaults that depend on the trace (``None`` on the command line means "from here").
TRACE_DEFAULTS: dict[str, dict[str, Any]] = {
    "synthetic": {
        "sessions": 300,
        "max_requests": None,
        "num_gpu_blocks": 8192,
        "wall_rate": 80.0,
        "max_input_length": None,
        "max_output_length": None,
    },
    "mooncake": {
        "window_start": 2000,
        "max_requests": 500,
        "num_gpu_blocks": 8192,
        "wall_rate": 15.0,
        "max_input_length": 16384,
        "max_output_length": 64,
    },
}
#: ``--quick``: one small cell, two modes (each still overridable on the command line).
QUICK = {
    "workers": [4],
    "load": [0.7],
    "modes": ["round-robin", "kv --router-cost ttft"],
    "sessions": 24,
    "max_requests": 60,
}
#: Guesses for the printed duration (measured on 2 cores): seconds to start and stop one
#: stack (base + per worker), to drain, and how much longer than planned a replay runs
#: (turns wait for their sessions' previous turns; round-robin falls behind).
STARTUP_S = {"turnout": (3.0, 0.05), "dynamo": (3.0, 0.1)}
DRAIN_S = 4.0
STRETCH = {True: 2.8, False: 1.35}  # by Trace.has_sessions
_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode
BodyFn = Callable[[str, np.ndarray, int], bytes]


# ------------------------------------------------------------------------------ the client


@dataclass(slots=True)
class RequestResult:
    """One replayed request, as the client saw it (times in wall seconds)."""

    index: int
    #: How late the client sent it after its scheduled arrival (client lag + concurrency cap).
    send_delay_s: float = 0.0
    #: How long it waited past its arrival for the previous turn of its session to finish
    #: (latencies then count from when that turn finished).
    session_wait_s: float = 0.0
    #: When it was sent, wall seconds after the replay's start.
    sent_at_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    worker_id: str | None = None
    error: str | None = None
    #: Wall seconds (from ``scheduled``) at which each chunk carrying text arrived: the gaps
    #: between them are the inter-token latencies a user sees, stalls included.
    chunk_times: list[float] = field(default_factory=list)


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
    client: httpx.AsyncClient,
    body: bytes,
    scheduled: float,
    result: RequestResult,
    session_id: str | None = None,
) -> None:
    """POST one streamed completion; fill ``result`` (latencies from ``scheduled``)."""
    result.send_delay_s = time.perf_counter() - scheduled
    headers = {"content-type": "application/json"}
    if session_id is not None:
        headers["x-session-id"] = session_id
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
    if choices and choices[0].get("text"):
        result.chunk_times.append(time.perf_counter() - scheduled)
    if (
        choices
        and result.ttft_s is None
        and (choices[0].get("text") or choices[0].get("finish_reason"))
    ):
        result.ttft_s = time.perf_counter() - scheduled
    if choices and (nvext := obj.get("nvext")):
        result.worker_id = worker_label(nvext.get("worker_id"))
    if usage := obj.get("usage"):
        result.prompt_tokens = usage["prompt_tokens"]
        result.output_tokens = usage["completion_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens") or 0


async def replay(
    url: str,
    model: str,
    trace: Trace,
    *,
    time_scale: float,
    concurrency: int,
    timeout_s: float,
    body_fn: BodyFn | None = None,
    keepalive: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time (open loop, at most ``concurrency`` at once).

    Requests of a trace with sessions carry ``x-session-id``, and a turn is not sent before
    the previous turn of its session has finished (its prompt holds that turn's answer): it
    goes at its arrival time or then, whichever is later. Returns the results in trace order
    and the wall seconds from the first send to the last completion. ``keepalive=False``
    opens a connection per request (Dynamo's frontend stalls ~25 ms on a connection reused
    right after a response; see ``benchmarks/dynamo_peer.py``).
    """
    make_body = body_fn or _request_body
    previous: list[int | None] = [None] * len(trace.requests)
    if trace.has_sessions:
        last: dict[str, int] = {}
        for i, request in enumerate(trace.requests):
            previous[i] = last.get(request.session_id)
            last[request.session_id] = i
    done = [asyncio.Event() for _ in trace.requests]
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency if keepalive else 0
    )
    cap = asyncio.Semaphore(concurrency)
    results = [RequestResult(i) for i in range(len(trace.requests))]
    async with httpx.AsyncClient(
        base_url=url, limits=limits, timeout=httpx.Timeout(timeout_s)
    ) as client:
        start = time.perf_counter() + 0.5  # time to build the first bodies

        async def one(i: int) -> None:
            request = trace.requests[i]
            scheduled = start + request.arrival_s * time_scale
            body = make_body(model, trace.prompt_tokens(request), request.output_length)
            session = request.session_id if trace.has_sessions else None
            try:
                await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
                results[i].sent_at_s = time.perf_counter() - start
                if (prev := previous[i]) is not None and not done[prev].is_set():
                    await done[prev].wait()
                    now = time.perf_counter()
                    results[i].session_wait_s = max(0.0, now - scheduled)
                    scheduled = max(scheduled, now)
                    results[i].sent_at_s = now - start
                async with cap:
                    await _send_one(client, body, scheduled, results[i], session)
            except httpx.HTTPError as exc:
                results[i].error = f"{type(exc).__name__}: {exc}"
            finally:
                done[i].set()

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
        stop_process_groups(self.procs)


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


# ------------------------------------------------------------------------------------ load


def prefill_capacity(
    num_workers: int, max_num_batched_tokens: int = 8192, model: TimingModel | None = None
) -> float:
    """Prompt tokens per simulated second the cluster prefills when every step is a full chunk."""
    model = model or PolynomialTimingModel()
    per_worker = max_num_batched_tokens / (model.prefill_ms(max_num_batched_tokens) / 1000.0)
    return num_workers * per_worker


def load_sim_scale(uncached_tokens: int, span_s: float, capacity: float, load: float) -> float:
    """Simulated seconds per trace second that make the offered work ``load`` x capacity.

    Offered work = ``uncached_tokens / (span_s x scale)`` tokens per simulated second.
    """
    if load <= 0 or capacity <= 0:
        raise ValueError(f"load and capacity must be > 0, got {load} and {capacity}")
    if span_s <= 0 or uncached_tokens <= 0:
        raise ValueError("the trace needs two arrival times apart and some uncached tokens")
    return uncached_tokens / (span_s * load * capacity)


def auto_speedup(
    num_requests: int, sim_span_s: float, wall_rate: float, bounds: tuple[float, float]
) -> float:
    """The speedup at which ``num_requests`` over ``sim_span_s`` arrive at ``wall_rate``/s."""
    if sim_span_s <= 0 or num_requests < 2:
        return bounds[1]
    speedup = wall_rate * sim_span_s / num_requests
    return float(min(max(speedup, bounds[0]), bounds[1]))


@dataclass(frozen=True, slots=True)
class CellPlan:
    """The time arithmetic of one (workers, load) cell."""

    workers: int
    load: float
    capacity_tokens_per_s: float
    offered_tokens_per_s: float
    sim_scale: float
    speedup: float
    #: Wall seconds per trace second (``sim_scale / speedup``).
    time_scale: float
    sim_span_s: float
    wall_span_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "load": self.load,
            "capacity_tokens_per_s": round(self.capacity_tokens_per_s, 1),
            "offered_tokens_per_s": round(self.offered_tokens_per_s, 1),
            "sim_scale": self.sim_scale,
            "speedup_ratio": self.speedup,
            "time_scale": self.time_scale,
            "sim_span_s": round(self.sim_span_s, 3),
            "wall_span_s": round(self.wall_span_s, 2),
        }


def plan_cell(
    trace: Trace,
    oracle: OracleResult,
    workers: int,
    load: float,
    *,
    max_num_batched_tokens: int,
    speedup: float | None,
    wall_rate: float,
) -> CellPlan:
    capacity = prefill_capacity(workers, max_num_batched_tokens)
    sim_scale = load_sim_scale(oracle.uncached_tokens, trace.span_s, capacity, load)
    sim_span = trace.span_s * sim_scale
    if speedup is None:
        speedup = auto_speedup(len(trace.requests), sim_span, wall_rate, SPEEDUP_BOUNDS)
    return CellPlan(
        workers=workers,
        load=load,
        capacity_tokens_per_s=capacity,
        offered_tokens_per_s=oracle.uncached_tokens / sim_span,
        sim_scale=sim_scale,
        speedup=speedup,
        time_scale=sim_scale / speedup,
        sim_span_s=sim_span,
        wall_span_s=sim_span / speedup,
    )


def expected_run_s(plan: CellPlan, sessions: bool, peer: str = "turnout") -> float:
    base, per_worker = STARTUP_S[peer]
    return base + per_worker * plan.workers + plan.wall_span_s * STRETCH[sessions] + DRAIN_S


# ------------------------------------------------------------------------------- reporting


def percentiles(values: list[float], qs: tuple[float, ...] = (50, 90, 99)) -> dict[str, float]:
    """Percentiles and mean of ``values`` (seconds) in milliseconds."""
    if not values:
        return {}
    arr = np.asarray(values) * 1000.0
    out = {f"p{q}": round(float(np.percentile(arr, q)), 2) for q in qs}
    out["mean"] = round(float(arr.mean()), 2)
    return out


def itl_values(results: list[RequestResult]) -> list[float]:
    """Per request, wall seconds between output tokens: (e2e - TTFT) / (output tokens - 1)."""
    return [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in results
        if r.error is None and r.ttft_s is not None and r.e2e_s is not None and r.output_tokens > 1
    ]


def chunk_gaps(results: list[RequestResult]) -> list[float]:
    """Wall seconds between consecutive text chunks of each successful request, pooled: the
    distribution whose tail shows a decode stalled behind another request's prefill."""
    gaps: list[float] = []
    for r in results:
        if r.error is None and len(r.chunk_times) > 1:
            gaps.extend(np.diff(r.chunk_times).tolist())
    return gaps


def work_spread(results: list[RequestResult], num_workers: int) -> tuple[dict[str, int], float]:
    """Prompt tokens served per worker, and max / mean of them over ``num_workers`` workers
    (a worker that served nothing counts as 0; 1.0 is perfectly even)."""
    per_worker: Counter[str] = Counter()
    for r in results:
        if r.error is None:
            per_worker[r.worker_id or "?"] += r.prompt_tokens
    total = sum(per_worker.values())
    n = max(num_workers, len(per_worker))
    if not total:
        return dict(per_worker), 0.0
    return dict(per_worker), max(per_worker.values()) / (total / n)


def effective_load(results: list[RequestResult], plan: CellPlan) -> float | None:
    """The load actually offered: the planned one x planned span / the span of the sends.

    Lower than planned where turns waited for their sessions' previous turns (or the client
    fell behind).
    """
    sent = [r.sent_at_s for r in results if r.sent_at_s is not None]
    if len(sent) < 2 or max(sent) <= min(sent):
        return None
    return plan.load * plan.wall_span_s / (max(sent) - min(sent))


def _sim(ms: dict[str, float], speedup: float) -> dict[str, float]:
    return {k: round(v * speedup, 2) for k, v in ms.items()}


def summarize(
    results: list[RequestResult],
    elapsed: float,
    speedup: float,
    num_workers: int,
    plan: CellPlan | None = None,
) -> dict[str, Any]:
    """One run's figures; ``*_sim_ms`` are simulated milliseconds (wall x speedup)."""
    ok = [r for r in results if r.error is None and r.ttft_s is not None and r.e2e_s is not None]
    errors = [r.error for r in results if r.error is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = itl_values(ok)
    per_worker, spread = work_spread(ok, num_workers)
    requests_per_worker = Counter(r.worker_id or "?" for r in ok)
    sim_elapsed = elapsed * speedup
    load = effective_load(results, plan) if plan is not None else None
    return {
        "num_ok": len(ok),
        "effective_load": round(load, 3) if load is not None else None,
        "num_errors": len(errors),
        "first_errors": sorted(set(errors))[:3],
        "ttft_sim_ms": _sim(percentiles(ttft), speedup),
        "itl_sim_ms": _sim(percentiles(itl), speedup),
        "token_gap_sim_ms": _sim(percentiles(chunk_gaps(ok), (50, 99, 99.9)), speedup),
        "e2e_sim_ms": _sim(percentiles(e2e), speedup),
        "ttft_ms": percentiles(ttft),
        "send_delay_ms": percentiles([r.send_delay_s for r in results]),
        "session_waits": sum(1 for r in results if r.session_wait_s > 0),
        "session_wait_sim_ms": _sim(
            percentiles([r.session_wait_s for r in results if r.session_wait_s > 0]), speedup
        ),
        "wall_s": round(elapsed, 2),
        "requests_per_s": round(len(ok) / elapsed, 2) if elapsed > 0 else 0.0,
        "output_tokens_per_s": round(output / elapsed, 1) if elapsed > 0 else 0.0,
        "sim_requests_per_s": round(len(ok) / sim_elapsed, 2) if sim_elapsed > 0 else 0.0,
        "sim_output_tokens_per_s": round(output / sim_elapsed, 1) if sim_elapsed > 0 else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens_per_worker": dict(sorted(per_worker.items())),
        "requests_per_worker": sorted(requests_per_worker.values(), reverse=True),
        "spread": round(spread, 3),
        "ttft_sim_s_sorted": sorted(round(t * speedup, 5) for t in ttft),
    }


def print_cell(cell: dict[str, Any], oracle: float) -> None:
    plan = cell["plan"]
    print(f"\n== {plan['workers']} workers, load {plan['load']:g} (speedup "
          f"{plan['speedup_ratio']:.3g}, sim scale {plan['sim_scale']:.4g}); oracle hit "
          f"{oracle:.1%}; simulated ms")  # fmt: skip
    header = (f"{'mode':<24} {'ok':>5} {'err':>4} {'hit':>6} {'/orcl':>6} {'TTFT p50':>9} "
              f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok/s':>8} {'req/s':>7} "
              f"{'spread':>6} {'load':>5}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for mode in cell["modes"]:
        if "skipped" in mode:
            print(f"{mode['mode']:<24} skipped: {mode['skipped'].splitlines()[0][:90]}")
            continue
        s = mode["summary"]
        ratio = s["cache_hit_rate"] / oracle if oracle else 0.0
        print(
            f"{mode['mode']:<24} {s['num_ok']:>5} {s['num_errors']:>4} "
            f"{s['cache_hit_rate']:>6.1%} {ratio:>6.2f} "
            f"{s['ttft_sim_ms'].get('p50', 0):>9.1f} {s['ttft_sim_ms'].get('p99', 0):>9.1f} "
            f"{s['itl_sim_ms'].get('p50', 0):>8.2f} {s['itl_sim_ms'].get('p99', 0):>8.2f} "
            f"{s['sim_output_tokens_per_s']:>8.0f} {s['sim_requests_per_s']:>7.1f} "
            f"{s['spread']:>6.2f} {s['effective_load'] or 0:>5.2f}"
        )


def plot_path(base: Path, trace_kind: str, workers: int, load: float) -> Path:
    return base / f"routing_quality_{trace_kind}_w{workers}_load{load:g}_ttft_cdf.png"


def plot_cdf(cell: dict[str, Any], report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for mode in cell["modes"]:
        ttft = mode.get("summary", {}).get("ttft_sim_s_sorted")
        if not ttft:
            continue
        x = np.asarray(ttft) * 1000.0
        y = np.arange(1, len(x) + 1) / len(x)
        hit = mode["summary"]["cache_hit_rate"]
        ax.step(x, y, where="post", label=f"{mode['mode']} (hit {hit:.0%})")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT, simulated ms")
    ax.set_ylabel("fraction of requests")
    trace = report["trace"]
    plan = cell["plan"]
    ax.set_title(
        f"TTFT CDF: {trace['kind']} trace, {trace['summary']['num_requests']} requests, "
        f"{plan['workers']} workers, load {plan['load']:g}; oracle hit "
        f"{report['oracle']['hit_rate']:.0%}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------ runs


def make_trace(args: argparse.Namespace) -> Trace:
    if args.trace == "mooncake":
        path = Path(args.mooncake_file or MOONCAKE_FILE)
        if not path.exists():
            raise SystemExit(f"no Mooncake trace at {path}; pass --mooncake-file")
        return load_mooncake(
            path,
            window_start=args.window_start,
            max_requests=args.max_requests,
            max_input_length=args.max_input_length,
            max_output_length=args.max_output_length,
            token_seed=args.seed,
        )
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


def trace_context_length(trace: Trace) -> int:
    """Prompt + output tokens of the trace's largest request."""
    return max((r.input_length + r.output_length for r in trace.requests), default=0)


def _replay(
    url: str,
    trace: Trace,
    plan: CellPlan,
    args: argparse.Namespace,
    body_fn: BodyFn | None,
    keepalive: bool = True,
) -> tuple[list[RequestResult], float]:
    return asyncio.run(
        replay(
            url, MODEL_NAME, trace, time_scale=plan.time_scale, concurrency=args.concurrency,
            timeout_s=args.request_timeout, body_fn=body_fn, keepalive=keepalive,
        )
    )  # fmt: skip


def run_mode(
    spec: str, args: argparse.Namespace, trace: Trace, help_text: str, plan: CellPlan
) -> dict[str, Any]:
    """One turnout run of ``spec`` (``"kv --router-cost ttft"``) on a fresh stack."""
    mode_args = shlex.split(spec)
    entry: dict[str, Any] = {"mode": spec}
    missing = unsupported_flags(mode_args[1:], help_text)
    if missing:
        entry["skipped"] = f"turnout frontend has no {', '.join(missing)} flag (yet)"
        return entry
    worker_args = [
        "--engine", "mocker", "--model-name", MODEL_NAME,
        "--num-workers", str(plan.workers), "--speedup-ratio", repr(plan.speedup),
        "--block-size", str(args.block_size), "--num-gpu-blocks", str(args.num_gpu_blocks),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--seed", str(args.seed),
        "--context-length", str(max(8192, trace_context_length(trace))),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="turnout-routing-") as tmp:
        stack = Stack(Path(tmp), ["--router-mode", *mode_args], worker_args)
        try:
            started = time.perf_counter()
            problem = stack.start_frontend() or stack.start_workers(plan.workers)
            if problem is not None:
                entry["skipped"] = problem
                return entry
            entry["startup_s"] = round(time.perf_counter() - started, 2)
            print(
                f"[{spec}] {plan.workers} workers up in {entry['startup_s']} s; replaying "
                f"{len(trace.requests)} requests over {plan.wall_span_s:.0f} s",
                flush=True,
            )
            results, elapsed = _replay(stack.url, trace, plan, args, None)
            entry["summary"] = summarize(results, elapsed, plan.speedup, plan.workers, plan)
            if entry["summary"]["num_ok"] == 0:
                entry["frontend_log_tail"] = stack.log_tail("frontend", 20)
                entry["worker_log_tail"] = stack.log_tail("worker", 20)
        finally:
            stack.stop()
    return entry


def run_dynamo(args: argparse.Namespace, trace: Trace, plan: CellPlan) -> dict[str, Any]:
    """The same cell against Dynamo's frontend (default kv router) and mocker."""
    entry: dict[str, Any] = {"mode": DYNAMO_MODE}
    try:
        from benchmarks import dynamo_peer
    except ImportError as exc:
        entry["skipped"] = f"benchmarks/dynamo_peer.py does not import: {exc}"
        return entry
    why = dynamo_peer.dynamo_unavailable()
    if why is not None:
        entry["skipped"] = why
        return entry
    peer_body = getattr(dynamo_peer, "request_body", None)
    body_fn: BodyFn | None = None
    if peer_body is not None:

        def body_fn(model: str, tokens: np.ndarray, max_tokens: int) -> bytes:
            return peer_body(model, tokens.tolist(), max_tokens)

    with tempfile.TemporaryDirectory(prefix="dynamo-routing-") as tmp:
        stack = dynamo_peer.DynamoStack(Path(tmp))
        try:
            started = time.perf_counter()
            problem = stack.start(
                model_name=MODEL_NAME, num_workers=plan.workers, block_size=args.block_size,
                num_gpu_blocks=args.num_gpu_blocks, speedup_ratio=plan.speedup,
                mocker_args=["--max-num-batched-tokens", str(args.max_num_batched_tokens)],
            )  # fmt: skip
            if problem is not None:
                entry["skipped"] = problem
                return entry
            entry["startup_s"] = round(time.perf_counter() - started, 2)
            print(f"[{DYNAMO_MODE}] {plan.workers} workers up in {entry['startup_s']} s; "
                  f"replaying {len(trace.requests)} requests", flush=True)  # fmt: skip
            # A fresh connection per request: Dynamo's frontend stalls a reused one.
            results, elapsed = _replay(stack.url, trace, plan, args, body_fn, keepalive=False)
            entry["summary"] = summarize(results, elapsed, plan.speedup, plan.workers, plan)
            if entry["summary"]["num_ok"] == 0:
                entry["frontend_log_tail"] = stack.log_tail("frontend", 20)
                entry["worker_log_tail"] = stack.log_tail("mocker", 20)
        finally:
            stack.stop()
    return entry


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--modes",
        nargs="+",
        help=f"router modes, each with its frontend flags (default: {DEFAULT_MODES})",
    )
    ap.add_argument(
        "--peer",
        choices=["dynamo"],
        action="append",
        default=[],
        help="also run each cell against Dynamo 1.6.1 (mode 'dynamo kv') when installed",
    )
    ap.add_argument("--workers", type=int, nargs="+", help=f"default: {DEFAULT_WORKERS}")
    ap.add_argument(
        "--load",
        type=float,
        nargs="+",
        help=f"offered prefill work / prefill capacity (default: {DEFAULT_LOADS})",
    )
    ap.add_argument("--quick", action="store_true", help="a ~1 minute smoke run: " + str(QUICK))
    ap.add_argument("--trace", choices=["synthetic", "mooncake"], default="synthetic")
    ap.add_argument("--mooncake-file", type=Path, help=f"default: {MOONCAKE_FILE}")
    ap.add_argument(
        "--window-start",
        type=int,
        help="mooncake: first record of the window (default: "
        f"{TRACE_DEFAULTS['mooncake']['window_start']})",
    )
    ap.add_argument(
        "--max-requests",
        type=int,
        help="replay only N requests (mooncake: the window's length, default "
        f"{TRACE_DEFAULTS['mooncake']['max_requests']})",
    )
    ap.add_argument(
        "--max-input-length",
        type=int,
        help="mooncake: cut longer prompts (default: 16384)",
    )
    ap.add_argument("--max-output-length", type=int, help="mooncake: cap outputs (default: 64)")
    g = ap.add_argument_group("synthetic trace (times in trace seconds, before load scaling)")
    g.add_argument("--sessions", type=int, help="default: 300 (--quick: 24)")
    g.add_argument("--system-prompts", type=int, default=16)
    g.add_argument("--system-prompt-tokens", type=int, nargs=2, default=[1024, 4096])
    g.add_argument("--turns", type=int, nargs=2, default=[2, 4], help="turns per session")
    g.add_argument("--user-tokens", type=int, nargs=2, default=[1024, 4096])
    g.add_argument("--output-tokens", type=int, nargs=2, default=[4, 32])
    g.add_argument("--session-rate", type=float, default=3.0, help="new sessions per second")
    g.add_argument("--think-time", type=float, default=60.0, help="mean gap between turns (s)")
    g.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("workers and replay")
    g.add_argument(
        "--speedup-ratio",
        type=float,
        help="mocker speedup (default: per cell, so that requests arrive at --wall-rate)",
    )
    g.add_argument(
        "--wall-rate",
        type=float,
        help="requests per wall second the automatic speedup aims at (default: 80 synthetic, "
        "15 mooncake: its prompts are longer)",
    )
    g.add_argument("--block-size", type=int, default=64)
    g.add_argument(
        "--num-gpu-blocks",
        type=int,
        help="KV blocks per worker (default: 2048 synthetic, 4096 mooncake)",
    )
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--concurrency", type=int, default=1024, help="most requests in flight")
    g.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, help="default: results/routing_quality_<trace>.json")
    ap.add_argument("--plot-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    resolve_defaults(args)
    return args


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fill what the command line left ``None``: ``--quick``'s values, then the trace's."""
    if args.quick:
        for name, value in QUICK.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    args.modes = args.modes or list(DEFAULT_MODES)
    args.workers = args.workers or list(DEFAULT_WORKERS)
    args.load = args.load or list(DEFAULT_LOADS)
    for name, value in TRACE_DEFAULTS[args.trace].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.window_start is None:
        args.window_start = 0
    if args.speedup_ratio is not None and args.speedup_ratio <= 0:
        raise SystemExit("--speedup-ratio must be > 0 (0 would not simulate time at all)")
    if any(x <= 0 for x in args.load):
        raise SystemExit("--load values must be > 0")
    if args.out is None:
        suffix = "_quick" if args.quick else ""
        args.out = RESULTS / f"routing_quality_{args.trace}{suffix}.json"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    trace = make_trace(args)
    summary = trace.get_summary()
    pool_tokens = args.num_gpu_blocks * args.block_size
    biggest = trace_context_length(trace)
    if biggest > pool_tokens:
        raise SystemExit(
            f"a request needs {biggest} tokens of KV cache, more than a worker's {pool_tokens}; "
            "raise --num-gpu-blocks or lower --max-input-length"
        )
    oracle = oracle_hit_rate(trace, args.block_size)
    print(f"trace: {json.dumps(summary)}")
    print(f"oracle hit rate {oracle.hit_rate:.1%}; uncached {oracle.uncached_tokens} of "
          f"{oracle.prompt_tokens} prompt tokens", flush=True)  # fmt: skip
    plans = [
        plan_cell(
            trace, oracle, w, load, max_num_batched_tokens=args.max_num_batched_tokens,
            speedup=args.speedup_ratio, wall_rate=args.wall_rate,
        )
        for w in args.workers
        for load in args.load
    ]  # fmt: skip
    expected = 0.0
    for plan in plans:
        runs = len(args.modes) * expected_run_s(plan, trace.has_sessions)
        if "dynamo" in args.peer:
            runs += expected_run_s(plan, trace.has_sessions, "dynamo")
        expected += runs
        print(f"cell {plan.workers} workers, load {plan.load:g}: capacity "
              f"{plan.capacity_tokens_per_s / 1000:.0f}k tok/s, sim scale {plan.sim_scale:.4g} "
              f"(trace span {trace.span_s:.0f} s -> {plan.sim_span_s:.2f} simulated s), "
              f"speedup {plan.speedup:.3g}, time scale {plan.time_scale:.4g} "
              f"(wall span {plan.wall_span_s:.0f} s)")  # fmt: skip
    print(f"expected duration: ~{expected / 60:.1f} min", flush=True)
    help_text = frontend_help()
    report: dict[str, Any] = {
        "benchmark": "routing_quality",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "trace": {"kind": trace.kind, "params": trace.params, "summary": summary},
        "block_size": args.block_size,
        "num_gpu_blocks": args.num_gpu_blocks,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "wall_rate": args.wall_rate,
        "concurrency": args.concurrency,
        "modes": args.modes,
        "peers": args.peer,
        "oracle": {
            "block_size": oracle.block_size,
            "prompt_tokens": oracle.prompt_tokens,
            "cached_tokens": oracle.cached_tokens,
            "uncached_tokens": oracle.uncached_tokens,
            "hit_rate": round(oracle.hit_rate, 4),
        },
        "cells": [],
    }
    began = time.perf_counter()
    for plan in plans:
        cell: dict[str, Any] = {"plan": plan.to_dict(), "modes": []}
        for spec in args.modes:
            entry = run_mode(spec, args, trace, help_text, plan)
            if "skipped" in entry:
                print(f"[{spec}] skipped: {entry['skipped']}", flush=True)
            cell["modes"].append(entry)
        if "dynamo" in args.peer:
            entry = run_dynamo(args, trace, plan)
            if "skipped" in entry:
                print(f"[{DYNAMO_MODE}] skipped: {entry['skipped']}", flush=True)
            cell["modes"].append(entry)
        print_cell(cell, oracle.hit_rate)
        path = plot_path(args.plot_dir, trace.kind, plan.workers, plan.load)
        if args.quick:
            path = path.with_name(path.stem + "_quick.png")
        plot_cdf(cell, report, path)
        cell["plot"] = str(path)
        report["cells"].append(cell)
        report["elapsed_s"] = round(time.perf_counter() - began, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))  # after every cell: partial results
    print(f"\nwrote {args.out} and {len(plans)} plot(s) in {report['elapsed_s'] / 60:.1f} min")
    return report


if __name__ == "__main__":
    main()
