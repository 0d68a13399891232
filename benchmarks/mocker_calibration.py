"""Calibrate turnout's mocker against Dynamo 1.6.1's: TTFT and ITL on one worker, end to end.

For each system a stack of one frontend and ONE mocker worker is started with the same
settings (block size 64, 16384 KV blocks, max 8192 batched tokens, ``--speedup-ratio S``),
and over HTTP (streamed ``/v1/completions`` with token-id prompts, ``ignore_eos``):

* **TTFT** of single requests with fresh random prompts (no prefix hit; checked through
  ``cached_tokens``) of 128, 1024, 4096 and 8192 tokens, 7 repeats each, 60 ms apart
  (back-to-back requests can meet a 40 ms TCP delayed ACK on the path, seen on Dynamo's);
* **ITL** of N concurrent requests (fresh 256-token prompts, 64 output tokens), N = 1, 8,
  32: per stream ``(last - first) / (tokens - 1)``, the median over the streams, the fastest
  of 3 trials (a busy CPU only stretches steps: client, frontend and worker share 2 cores);
* **a mixed step**: a request decoding alone when an 8192-token prompt arrives; its longest
  gap is the step that computed that prompt beside its decode;
* **ITL over a shared prefix**: 32 requests with one 4096-token prompt (already resident) on
  a 4096-block pool, where what "KV usage" means moves the decode time a lot.

Wall times become simulated GPU milliseconds (x S). TTFT also carries the serving path's
fixed overhead (HTTP, tokenisation, routing, request plane: ~4 ms here), magnified by S, so
each system is measured again at a speedup of 1000 (simulated time ~0) and that overhead is
subtracted: ``ttft_sim = (min ttft_wall - min overhead_wall) x S`` (minima: load on the
machine only adds time, and the two are measured a minute apart). S defaults to 1: at 10
the 4 ms overhead becomes 40 simulated ms and its jitter swamps a 6 ms decode, and sub-ms
sleeps stop being paced precisely (Dynamo's ITL at S=10 strays by -20..+180 %).

What Dynamo 1.6.1's mocker does (vLLM engine type, polynomial timing), from its source
(ai-dynamo/aisimulate ``crates/core/src/engine/common/perf_model.rs``, ``scheduler/vllm/
core.rs``; the constants checked in the installed ``_core.abi3.so``) and these measurements:

* ``prefill(T) = 4.209989e-7·T² + 0.01518344·T + 16.50142`` ms, T = new prompt tokens of the
  pass (its batch: count x (mean ISL - mean prefix));
* ``decode(u) = max(5.74 + 54.01·u - 25.74·u², 1)`` ms, u = the summed context length of the
  decoding requests / (num_gpu_blocks x block_size): logical tokens, a shared prefix once
  per request; the batch size does not enter;
* a pass costs ``prefill(T) + decode(u)`` when it has requests that already emitted a token,
  else ``prefill(T)``; every token of the pass comes at its end. A prompt completing in a
  pass emits its first token with no decode charge (measured: lone TTFT = prefill(P); a
  request's token after a max_tokens=1 neighbour's comes prefill(P) later, after a decoding
  neighbour's decode(u) + prefill(P) later).

Beside the measurements: those formulas on this grid ("Dynamo formula") and turnout's
``Scheduler`` with ``src/turnout/engines/mocker/timing.py``, no sockets ("turnout sched").

Usage::

    .venv/bin/python benchmarks/mocker_calibration.py                 # both systems
    .venv/bin/python benchmarks/mocker_calibration.py --systems turnout
    .venv/bin/python benchmarks/mocker_calibration.py --write-reference \\
        tests/engines/mocker/dynamo_mocker_reference.json

Writes ``benchmarks/results/mocker_calibration.json``. Takes about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks.dynamo_peer import (  # noqa: E402
    DynamoStack,
    dynamo_python,
    dynamo_unavailable,
    free_port,
    request_body,
)
from benchmarks.process_groups import stop_process_groups  # noqa: E402

from turnout.engines.mocker.config import MockerConfig  # noqa: E402
from turnout.engines.mocker.scheduler import Scheduler  # noqa: E402
from turnout.engines.mocker.timing import PolynomialTimingModel  # noqa: E402
from turnout.protocols.llm import PreprocessedRequest, StopConditions  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODEL = "calib"
_decode = msgspec.json.Decoder().decode


# --------------------------------------------------------------------------- the settings


@dataclass(frozen=True, slots=True)
class Grid:
    speedup: float = 1.0
    overhead_speedup: float = 1000.0
    block_size: int = 64
    num_gpu_blocks: int = 16384
    max_num_batched_tokens: int = 8192
    prompt_lengths: tuple[int, ...] = (128, 1024, 4096, 8192)
    ttft_repeats: int = 7
    batches: tuple[int, ...] = (1, 8, 32)
    itl_prompt_len: int = 256
    itl_output_tokens: int = 64
    #: Each ITL measurement is repeated; the fastest trial counts (see ``_best``).
    itl_trials: int = 3
    #: A mixed step: a request decoding (short prompt, long output) when a long prompt arrives.
    mixed_prompt_len: int = 8192
    #: Shared-prefix decode: N requests with one prompt, on a small pool (KV usage matters).
    shared_batch: int = 32
    shared_prompt_len: int = 4096
    shared_num_gpu_blocks: int = 4096
    seed: int = 0


# ------------------------------------------------------------------------------ a turnout stack


@dataclass
class TurnoutStack:
    """One ``turnout frontend`` and one ``turnout worker --engine mocker`` on a file store."""

    tmp: Path
    port: int = field(default_factory=free_port)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, name: str, args: list[str]) -> None:
        common = ["--store", "file", "--store-path", str(self.tmp / "store.sqlite"),
                  "--lease-ttl", "2", "--log-level", "warning"]  # fmt: skip
        with open(self.tmp / f"{name}.log", "wb") as log:
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "turnout", args[0], *common, *args[1:]],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def log_tail(self, name: str, lines: int = 8) -> str:
        path = self.tmp / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def start(self, grid: Grid, speedup: float, blocks: int, timeout: float = 120) -> str | None:
        self._spawn("frontend", ["frontend", "--port", str(self.port), "--router-mode", "kv"])
        self._spawn(
            "worker",
            ["worker", "--engine", "mocker", "--model-name", MODEL, "--num-workers", "1",
             "--speedup-ratio", repr(speedup), "--block-size", str(grid.block_size),
             "--num-gpu-blocks", str(blocks),
             "--max-num-batched-tokens", str(grid.max_num_batched_tokens),
             "--context-length", "131072"],
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in zip(("frontend", "worker"), self.procs, strict=True):
                if proc.poll() is not None:
                    return f"{name} exited ({proc.returncode}): {self.log_tail(name)}"
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                models = httpx.get(self.url + "/health", timeout=2).json().get("models", [])
                if any(m["name"] == MODEL and len(m["instances"]) >= 1 for m in models):
                    return None
            time.sleep(0.2)
        return f"turnout stack not ready in {timeout:.0f} s: {self.log_tail('worker')}"

    def stop(self) -> None:
        stop_process_groups(self.procs)
        self.procs.clear()


# ----------------------------------------------------------------------------- the client


@dataclass(slots=True)
class Stream:
    """Token arrival times (wall seconds from the send) and the final usage of one request."""

    times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def _stream(client: httpx.AsyncClient, body: bytes) -> Stream:
    out = Stream()
    start = time.perf_counter()
    async with client.stream(
        "POST", "/v1/completions", content=body, headers={"content-type": "application/json"}
    ) as resp:
        if resp.status_code != 200:
            out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return out
        buffer = b""
        async for chunk in resp.aiter_bytes():
            now = time.perf_counter() - start
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                event = event.strip()
                if not event.startswith(b"data:") or event.endswith(b"[DONE]"):
                    continue
                obj = _decode(event[5:])
                if "error" in obj:
                    out.error = str(obj["error"])
                    continue
                choices = obj.get("choices") or []
                # A token: a chunk with text (Dynamo's last choice chunk has only the finish).
                if choices and choices[0].get("text"):
                    out.times.append(now)
                if usage := obj.get("usage"):
                    out.prompt_tokens = usage.get("prompt_tokens", 0)
                    out.completion_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens") or 0
    return out


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(1000, 40000) for _ in range(n)]


async def _measure(url: str, grid: Grid, phase: str) -> dict[str, Any]:
    """Wall milliseconds, raw. ``phase``: "main" (TTFT, ITL, the mixed step), "shared" (the
    shared-prefix decode) or "overhead" (TTFT of short prompts only)."""
    rng = random.Random(f"{grid.seed}-{phase}")
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    out: dict[str, Any] = {"problems": []}

    def check(what: str, s: Stream, tokens: int | None = None) -> None:
        if s.error or not s.times:
            out["problems"].append(f"{what}: {s.error or 'no token'}")
        elif tokens is not None and s.completion_tokens != tokens:
            out["problems"].append(f"{what}: {s.completion_tokens} tokens, not {tokens}")

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        # Warm up the path (connections, tokenizer, router) with throwaway requests.
        for _ in range(3):
            await _stream(client, request_body(MODEL, _prompt(rng, 64), 2))
            await asyncio.sleep(0.06)
        if phase in ("main", "overhead"):
            # Sequential, 60 ms apart: back-to-back requests can meet a TCP delayed ACK (40 ms)
            # somewhere on the path, which is not the engine's time.
            lengths = grid.prompt_lengths[:1] * 3 if phase == "overhead" else grid.prompt_lengths
            ttft: dict[str, list[float]] = {}
            for length in lengths:
                for _ in range(grid.ttft_repeats):
                    s = await _stream(client, request_body(MODEL, _prompt(rng, length), 2))
                    check(f"ttft {length}", s, 2)
                    if s.cached_tokens:
                        out["problems"].append(f"ttft {length}: {s.cached_tokens} cached tokens")
                    if s.times:
                        ttft.setdefault(str(length), []).append(round(s.times[0] * 1000, 3))
                    await asyncio.sleep(0.06)
            out["ttft_wall_ms"] = ttft
        if phase == "main":
            out["itl_wall_ms"] = {}
            for n in grid.batches:
                trials = []
                for _ in range(grid.itl_trials):
                    bodies = [
                        request_body(
                            MODEL, _prompt(rng, grid.itl_prompt_len), grid.itl_output_tokens
                        )
                        for _ in range(n)
                    ]
                    streams = await asyncio.gather(*(_stream(client, b) for b in bodies))
                    for s in streams:
                        check(f"itl batch {n}", s, grid.itl_output_tokens)
                    trials.append(_itl(streams))
                    await asyncio.sleep(0.2)
                out["itl_wall_ms"][str(n)] = trials
            # The mixed step: A decodes alone, then a long prompt B joins; A's longest gap is
            # the step that computed B's prompt beside A's decode.
            gaps = []
            for _ in range(3):
                a = asyncio.create_task(
                    _stream(client, request_body(MODEL, _prompt(rng, 128), 120))
                )
                await asyncio.sleep(0.15 / grid.speedup)  # A has decoded ~26 tokens
                b = await _stream(
                    client, request_body(MODEL, _prompt(rng, grid.mixed_prompt_len), 2)
                )
                ra = await a
                check("mixed A", ra, 120)
                check("mixed B", b, 2)
                if len(ra.times) > 1:
                    gaps.append(max(y - x for x, y in pairwise(ra.times)))
                await asyncio.sleep(0.2)
            out["mixed_step_wall_ms"] = [round(g * 1000, 3) for g in gaps]
        if phase == "shared":
            prompt = _prompt(rng, grid.shared_prompt_len)
            s = await _stream(client, request_body(MODEL, prompt, 2))  # makes the prefix resident
            check("shared warm-up", s, 2)
            out["shared_itl_wall_ms"] = []
            for _ in range(grid.itl_trials):
                await asyncio.sleep(0.2)
                streams = await asyncio.gather(
                    *(_stream(client, request_body(MODEL, prompt, grid.itl_output_tokens))
                      for _ in range(grid.shared_batch))
                )  # fmt: skip
                for s in streams:
                    check("shared", s, grid.itl_output_tokens)
                out["shared_itl_wall_ms"].append(_itl(streams))
                out["shared_cached_tokens"] = statistics.median(s.cached_tokens for s in streams)
    return out


def _itl(streams: Sequence[Stream]) -> dict[str, Any]:
    """The steady step period of each stream ((last - first) / gaps: robust to tokens that
    arrive in bursts when the client or the frontend falls behind for a moment), median."""
    periods = [
        (s.times[-1] - s.times[0]) * 1000 / (len(s.times) - 1) for s in streams if len(s.times) > 1
    ]
    gaps = [(b - a) * 1000 for s in streams for a, b in pairwise(s.times)]
    return {
        "period_median": round(statistics.median(periods), 4) if periods else None,
        "gap_median": round(statistics.median(gaps), 4) if gaps else None,
        "num_gaps": len(gaps),
        "ttft_median": round(statistics.median(s.times[0] * 1000 for s in streams if s.times), 3),
    }


def _best(trials: Sequence[dict[str, Any]]) -> float | None:
    """The fastest trial's median period: a busy CPU (this client, the frontend and the
    worker share it) only ever stretches a step, the engines never run ahead of their model."""
    periods = [t["period_median"] for t in trials if t["period_median"]]
    return min(periods) if periods else None


def run_system(system: str, grid: Grid) -> dict[str, Any]:
    """Measure one system: a stack per phase (settings differ), one worker each."""
    entry: dict[str, Any] = {"system": system}
    phases = (
        ("main", grid.speedup, grid.num_gpu_blocks),
        ("shared", grid.speedup, grid.shared_num_gpu_blocks),
        ("overhead", grid.overhead_speedup, grid.num_gpu_blocks),
    )
    for phase, speedup, blocks in phases:
        with tempfile.TemporaryDirectory(prefix=f"calib-{system}-") as tmp:
            stack: DynamoStack | TurnoutStack
            if system == "dynamo":
                stack = DynamoStack(Path(tmp))
                problem = stack.start(
                    model_name=MODEL, num_workers=1, block_size=grid.block_size,
                    num_gpu_blocks=blocks, speedup_ratio=speedup,
                    mocker_args=["--max-num-batched-tokens", str(grid.max_num_batched_tokens)],
                )  # fmt: skip
            else:
                stack = TurnoutStack(Path(tmp))
                problem = stack.start(grid, speedup, blocks)
            try:
                if problem is not None:
                    entry["skipped"] = problem
                    return entry
                print(f"[{system}] {phase}: speedup {speedup:g}, {blocks} blocks", flush=True)
                entry[phase] = asyncio.run(_measure(stack.url, grid, phase))
            finally:
                stack.stop()
    s = grid.speedup
    # Minima on both sides: load on the machine only ever adds to a request's time, and the
    # overhead is measured minutes apart from the TTFTs (under other load, maybe).
    overhead = min(x for xs in entry["overhead"]["ttft_wall_ms"].values() for x in xs)
    main = entry["main"]
    entry["overhead_wall_ms"] = round(overhead, 3)
    entry["ttft_sim_ms"] = {
        p: round((min(xs) - overhead) * s, 2) for p, xs in main["ttft_wall_ms"].items()
    }
    entry["ttft_sim_ms_raw"] = {
        p: round(statistics.median(xs) * s, 2) for p, xs in main["ttft_wall_ms"].items()
    }
    entry["itl_sim_ms"] = {
        n: round(best * s, 3)
        for n, trials in main["itl_wall_ms"].items()
        if (best := _best(trials))
    }
    if main["mixed_step_wall_ms"]:
        entry["mixed_step_sim_ms"] = round(statistics.median(main["mixed_step_wall_ms"]) * s, 2)
    shared = _best(entry["shared"]["shared_itl_wall_ms"])
    if shared:
        entry["shared_itl_sim_ms"] = round(shared * s, 3)
    return entry


# ------------------------------------------------------------------------------ predictions


def dynamo_prefill_ms(tokens: int) -> float:
    """Dynamo 1.6.1 (aisimulate ``polynomial_prefill_time``): total new prompt tokens."""
    if tokens <= 0:
        return 0.0
    t = float(tokens)
    return 4.209989e-07 * t * t + 1.518344e-02 * t + 1.650142e01


def dynamo_decode_ms(active_kv_tokens: int, total_kv_tokens: int) -> float:
    """Dynamo 1.6.1 (``polynomial_decode_time``): KV utilisation only, floored at 1 ms."""
    u = min(active_kv_tokens / total_kv_tokens, 1.0)
    return max(-25.74 * u * u + 54.01 * u + 5.74, 1.0)


def dynamo_predictions(grid: Grid) -> dict[str, Any]:
    """Dynamo 1.6.1's live vLLM mocker, as measured (see the module notes): a pass costs
    ``prefill(new prompt tokens)`` plus ``decode(u)`` when it has requests that already emitted
    a token; a prompt's first token comes at the end of the pass that completes it, with no
    decode charge; ``u`` = summed context of the decoding requests / the pool's tokens."""
    total = grid.num_gpu_blocks * grid.block_size
    ttft = {}
    for p in grid.prompt_lengths:
        ms, done = 0.0, 0
        while done < p:
            chunk = min(grid.max_num_batched_tokens, p - done)
            ms += dynamo_prefill_ms(chunk)
            done += chunk
        ttft[str(p)] = round(ms, 2)
    ctx = grid.itl_prompt_len + grid.itl_output_tokens // 2  # mid-stream context
    itl = {str(n): round(dynamo_decode_ms(n * ctx, total), 3) for n in grid.batches}
    # A's step beside B's prompt: A has decoded for ~150 ms (about 26 tokens).
    mixed = dynamo_prefill_ms(grid.mixed_prompt_len) + dynamo_decode_ms(128 + 26, total)
    shared_total = grid.shared_num_gpu_blocks * grid.block_size
    shared_ctx = grid.shared_prompt_len + grid.itl_output_tokens // 2
    shared = dynamo_decode_ms(grid.shared_batch * shared_ctx, shared_total)
    return {
        "ttft_sim_ms": ttft,
        "itl_sim_ms": itl,
        "mixed_step_sim_ms": round(mixed, 2),
        "shared_itl_sim_ms": round(shared, 3),
    }


def turnout_predictions(grid: Grid) -> dict[str, Any]:
    """turnout's ``Scheduler`` with its timing model, no sockets: simulated step durations."""
    return simulate_turnout(grid)


def _scheduler(grid: Grid, blocks: int, timing: Any = None) -> Scheduler:
    config = MockerConfig(
        block_size=grid.block_size, num_gpu_blocks=blocks,
        max_num_batched_tokens=grid.max_num_batched_tokens,
    )  # fmt: skip
    return Scheduler(config, timing=timing or PolynomialTimingModel())


def _add(sched: Scheduler, rid: str, tokens: list[int], max_tokens: int) -> None:
    request = PreprocessedRequest(
        model=MODEL,
        token_ids=tokens,
        stop_conditions=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )
    assert sched.add_request(rid, request) is None


def _run(sched: Scheduler, now: float = 0.0, times: dict[str, list[float]] | None = None,
         max_steps: int | None = None) -> tuple[float, dict[str, list[float]]]:  # fmt: skip
    """Step until idle (or ``max_steps``); token times in simulated ms per request."""
    times = {} if times is None else times
    steps = 0
    while sched.has_work() and (max_steps is None or steps < max_steps):
        result = sched.step(now / 1000)
        now += result.duration_s * 1000
        steps += 1
        for rid, out in result.outputs:
            times.setdefault(rid, []).extend([now] * len(out.token_ids))
    return now, times


def _period(ts: list[float]) -> float:
    return (ts[-1] - ts[0]) / (len(ts) - 1)


def simulate_turnout(grid: Grid, timing: Any = None) -> dict[str, Any]:
    """The calibration grid on turnout's ``Scheduler`` (the same quantities as measured)."""
    rng = random.Random(grid.seed)
    ttft = {}
    for p in grid.prompt_lengths:
        sched = _scheduler(grid, grid.num_gpu_blocks, timing)
        _add(sched, "r", _prompt(rng, p), 2)
        ttft[str(p)] = round(_run(sched)[1]["r"][0], 2)
    itl = {}
    for n in grid.batches:
        sched = _scheduler(grid, grid.num_gpu_blocks, timing)
        for i in range(n):
            _add(sched, f"r{i}", _prompt(rng, grid.itl_prompt_len), grid.itl_output_tokens)
        itl[str(n)] = round(statistics.median(_period(ts) for ts in _run(sched)[1].values()), 3)
    # The mixed step: A decodes ~26 tokens alone, then B's long prompt joins.
    sched = _scheduler(grid, grid.num_gpu_blocks, timing)
    _add(sched, "a", _prompt(rng, 128), 120)
    now, times = _run(sched, max_steps=27)
    _add(sched, "b", _prompt(rng, grid.mixed_prompt_len), 2)
    _, times = _run(sched, now, times)
    a = times["a"]
    mixed = max(y - x for x, y in pairwise(a))
    # Shared prefix: the prompt made resident first, then N requests share it.
    sched = _scheduler(grid, grid.shared_num_gpu_blocks, timing)
    prompt = _prompt(rng, grid.shared_prompt_len)
    _add(sched, "warm", prompt, 2)
    _run(sched)
    for i in range(grid.shared_batch):
        _add(sched, f"s{i}", prompt, grid.itl_output_tokens)
    shared = statistics.median(_period(ts) for ts in _run(sched)[1].values())
    return {
        "ttft_sim_ms": ttft,
        "itl_sim_ms": itl,
        "mixed_step_sim_ms": round(mixed, 2),
        "shared_itl_sim_ms": round(shared, 3),
    }


# ------------------------------------------------------------------------------ reporting


def table_rows(grid: dict[str, Any]) -> list[tuple[str, Any, str]]:
    rows: list[tuple[str, Any, str]] = [
        ("ttft_sim_ms", str(p), f"TTFT prompt {p}") for p in grid["prompt_lengths"]
    ]
    rows += [("itl_sim_ms", str(n), f"ITL batch {n}") for n in grid["batches"]]
    rows.append(("mixed_step_sim_ms", None, f"step {grid['mixed_prompt_len']} + 1 decode"))
    rows.append(
        (
            "shared_itl_sim_ms",
            None,
            f"ITL {grid['shared_batch']} x shared {grid['shared_prompt_len']}",
        )
    )
    return rows


def _value(source: dict[str, Any], key: str, sub: Any) -> float | None:
    v = source.get(key)
    if sub is not None:
        v = v.get(sub) if isinstance(v, dict) else None
    return v


def print_table(report: dict[str, Any]) -> None:
    grid = report["settings"]
    measured = {e["system"]: e for e in report["measured"] if "skipped" not in e}
    cols = [
        ("Dynamo meas", measured.get("dynamo", {})),
        ("Dynamo formula", report["predicted"]["dynamo"]),
        ("turnout meas", measured.get("turnout", {})),
        ("turnout sched", report["predicted"]["turnout"]),
    ]
    print(f"\nsimulated ms (wall x {grid['speedup']:g}; TTFT net of the serving overhead), "
          f"block {grid['block_size']}, {grid['num_gpu_blocks']} blocks "
          f"({grid['shared_num_gpu_blocks']} for the shared prefix)")  # fmt: skip
    header = f"{'metric':<24}" + "".join(f"{title:>15}" for title, _ in cols)
    print(header)
    print("-" * len(header))
    for key, sub, label in table_rows(grid):
        cells = []
        for _, source in cols:
            v = _value(source, key, sub)
            cells.append(f"{v:>15.2f}" if v is not None else f"{'-':>15}")
        print(f"{label:<24}" + "".join(cells))
    for e in report["measured"]:
        if "skipped" in e:
            print(f"{e['system']}: skipped: {e['skipped']}")
        else:
            problems = [p for phase in ("main", "shared", "overhead") for p in e[phase]["problems"]]
            print(f"{e['system']}: serving overhead {e['overhead_wall_ms']:.2f} wall ms per "
                  f"request; problems: {problems or 'none'}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", nargs="+", default=["dynamo", "turnout"])
    p.add_argument("--speedup-ratio", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--output", type=Path, default=RESULTS / "mocker_calibration.json")
    p.add_argument(
        "--write-reference",
        type=Path,
        default=None,
        help="also write Dynamo's measured figures as the test reference here",
    )
    args = p.parse_args(argv)
    grid = Grid(speedup=args.speedup_ratio, ttft_repeats=args.repeats)
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(grid).items()}
    report: dict[str, Any] = {
        "settings": settings,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "dynamo_python": str(dynamo_python()),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "predicted": {"dynamo": dynamo_predictions(grid), "turnout": turnout_predictions(grid)},
        "measured": [],
    }
    for system in args.systems:
        if system == "dynamo" and (why := dynamo_unavailable()) is not None:
            report["measured"].append({"system": system, "skipped": why})
            continue
        report["measured"].append(run_system(system, grid))
    print_table(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.output}")
    if args.write_reference is not None:
        _REF_KEYS = table_rows(settings)
        dyn = next((e for e in report["measured"] if e["system"] == "dynamo"), None)
        if dyn is None or "skipped" in dyn:
            print("no Dynamo measurement: reference not written")
            return 1
        ref = {
            "source": "benchmarks/mocker_calibration.py against Dynamo 1.6.1 "
            "(python -m dynamo.mocker, vLLM engine type, polynomial timing)",
            "settings": report["settings"],
            "machine": report["machine"],
            "overhead_wall_ms": dyn["overhead_wall_ms"],
            **{key: dyn[key] for key, _, _ in _REF_KEYS if key in dyn},
            "dynamo_formula": report["predicted"]["dynamo"],
        }
        args.write_reference.write_text(json.dumps(ref, indent=1) + "\n")
        print(f"wrote {args.write_reference}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
