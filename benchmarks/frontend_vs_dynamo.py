"""Frontend CPU per request, turnout against Dynamo 1.6.1's frontend, side by side in one run.

For each router mode (``round-robin``, ``kv``) both stacks run at once, on one machine,
each with the same shape:

* turnout: ``turnout frontend --router-mode M`` and one ``turnout worker --engine mocker
  --num-workers 2`` process, on a file store, the TCP request plane and the ZMQ event plane;
* Dynamo: ``python -m dynamo.frontend --router-mode M`` and one ``python -m dynamo.mocker
  --num-workers 2`` process, on file discovery, TCP and ZMQ (``dynamo_peer.DynamoStack``).

Both sides serve the same tokenizer-only model (``dynamo_peer.write_model_dir``: a
word-level tokenizer whose word ``w{i}`` is token ``i``, no BOS), so both frontends tokenize
the same text into the same tokens (checked once per stack through ``usage.prompt_tokens``)
and detokenize the same kind of output. Both mockers run with ``--speedup-ratio 1e5``
(simulated time ~0: the engines answer as fast as they can), block size 64 and 16384 KV
blocks per worker, prefix caching on: in kv mode both mockers publish KV events (stored and
removed blocks) over ZMQ and both routers index them. Dynamo's mocker cannot go faster than
~0.7 ms a step at any ratio (``dynamo_peer``'s docstring) where turnout's steps in tens of
microseconds, so at concurrency 16 Dynamo's streams are paced by its engine; with both paced
alike (``--speedup-ratio 8``: ~1 ms steps on both) turnout's CPU per streamed request rose
~15-20 % in one measurement and the long_stream ratio went from x0.60 to x0.71 at
concurrency 16 (x0.77 at 64 either way).

Defaults differ in one respect that costs CPU: turnout's kv router shares its in-flight
requests with other router replicas (one ZMQ publish per loop iteration) unless
``--no-router-replica-sync``; Dynamo 1.6.1's ``--router-replica-sync`` is off by default.
The default run compares the defaults; ``--turnout-frontend-args=--no-router-replica-sync``
aligns them.

Scenarios (bodies identical for both systems, ``ignore_eos`` so every request runs to
``max_tokens``):

* ``short``: a 6-token prompt, ``max_tokens=1``, not streamed;
* ``long_stream``: a 512-token prompt, ``max_tokens=64``, streamed.

Method: the load generator is ``bench_http`` (raw asyncio HTTP/1.1 keep-alive) in this
process. Every (mode, scenario, concurrency, system) gets a warm-up run, then ``--repeat``
measured runs, interleaved: turnout, Dynamo, Dynamo, turnout, ... (the order flips every
repeat so that neither system always runs first). Per run: requests completed and failed,
the frontend process's CPU seconds (user + sys of every thread, read from /proc through
psutil; children too, though neither frontend has any), p50/p99 latency, requests/s, and
the CPU of the idle stack during the run (to show it does not steal from the measured one).
Each row keeps the median of each figure over the repeats; the ratio is turnout/Dynamo of
the median CPU per request.

Dynamo's frontend is one process: ``python -m dynamo.frontend`` loads the Rust runtime
(``dynamo._core``) into the interpreter, and its tokio worker threads, HTTP server, router
and request plane all run as threads of that process (the JSON records its thread count).

Usage::

    .venv/bin/python benchmarks/frontend_vs_dynamo.py --label after    # about 5 minutes
    PYTHONPATH=/tmp/wt/src .venv/bin/python benchmarks/frontend_vs_dynamo.py \\
        --label before --out /tmp/before.json    # turnout from a worktree of another commit
    .venv/bin/python benchmarks/frontend_vs_dynamo.py --systems turnout --modes kv \\
        --scenarios short --profile py-spy                           # turnout's hot spots

Writes ``benchmarks/results/frontend_vs_dynamo.json`` (``--out``) and prints a table. Needs
Dynamo in its own venv: see ``dynamo_peer``'s docstring.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from benchmarks.dynamo_peer import (  # noqa: E402
    DynamoStack,
    dynamo_unavailable,
    free_port,
    write_model_dir,
)
from benchmarks.process_groups import stop_process_groups  # noqa: E402

from bench_http import percentile, render_post, run_load  # noqa: E402
from frontend_overhead import summarize_pyspy  # noqa: E402
from turnout.runtime.progress import track  # noqa: E402

MODEL = "tiny"
MODES = ("round-robin", "kv")
SYSTEMS = ("turnout", "dynamo")
BLOCK_SIZE = 64
NUM_GPU_BLOCKS = 16384
SHORT_PROMPT_TOKENS = 6
LONG_PROMPT_TOKENS = 512
LONG_MAX_TOKENS = 64
DEFAULT_SPEEDUP = 1e5


def prompt_text(first: int, count: int) -> str:
    """``count`` words of the word-level vocabulary: exactly ``count`` tokens."""
    return " ".join(f"w{first + i}" for i in range(count))


def scenario_bodies() -> dict[str, tuple[dict[str, Any], bool]]:
    """Scenario name -> (request body, streamed)."""
    return {
        "short": (
            {"model": MODEL, "prompt": prompt_text(101, SHORT_PROMPT_TOKENS), "max_tokens": 1,
             "ignore_eos": True},
            False,
        ),
        "long_stream": (
            {"model": MODEL, "prompt": prompt_text(1000, LONG_PROMPT_TOKENS),
             "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, "stream": True},
            True,
        ),
    }  # fmt: skip


class Stack(Protocol):
    """What the runner needs of either system's stack."""

    port: int

    def frontend_pid(self) -> int: ...
    def worker_pids(self) -> list[int]: ...
    def stop(self) -> None: ...


@dataclass
class TurnoutStack:
    """``turnout frontend`` and one ``turnout worker --engine mocker`` process (``workers``
    workers) on a file store, TCP and ZMQ."""

    tmp: Path
    model_dir: Path
    frontend_args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def _spawn(self, name: str, args: list[str]) -> None:
        common = ["--store", "file", "--store-path", str(self.tmp / "store.sqlite"),
                  "--request-plane", "tcp", "--event-plane", "zmq",
                  "--log-level", "warning"]  # fmt: skip
        with open(self.tmp / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "turnout", args[0], *common, *args[1:]],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp, start_new_session=True,
            )  # fmt: skip

    def log_tail(self, name: str, lines: int = 6) -> str:
        path = self.tmp / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def start(
        self, router_mode: str, workers: int, speedup: float, timeout: float = 120
    ) -> str | None:
        """None once ``/health`` lists ``workers`` instances of the model, else why not."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._spawn("frontend", ["frontend", "--port", str(self.port),
                                 "--router-mode", router_mode, *self.frontend_args])  # fmt: skip
        self._spawn(
            "worker",
            ["worker", "--engine", "mocker", "--model-path", str(self.model_dir),
             "--model-name", MODEL, "--num-workers", str(workers), "--speedup-ratio", repr(speedup),
             "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks", str(NUM_GPU_BLOCKS)],
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    return f"turnout {name} exited ({proc.returncode}): {self.log_tail(name)}"
            with contextlib.suppress(OSError, ValueError, KeyError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    models = json.loads(r.read())["models"]
                if any(m["name"] == MODEL and len(m["instances"]) >= workers for m in models):
                    return None
            time.sleep(0.2)
        return f"turnout stack not ready in {timeout:.0f} s: {self.log_tail('worker')}"

    def frontend_pid(self) -> int:
        return self.procs["frontend"].pid

    def worker_pids(self) -> list[int]:
        return [self.procs["worker"].pid]

    def stop(self) -> None:
        stop_process_groups(self.procs.values())
        self.procs.clear()


class DynamoSide:
    """``dynamo_peer.DynamoStack`` behind the runner's ``Stack`` interface."""

    def __init__(self, tmp: Path) -> None:
        self.stack = DynamoStack(tmp)
        self.port = self.stack.port

    def start(self, router_mode: str, workers: int, speedup: float) -> str | None:
        return self.stack.start(
            model_name=MODEL, num_workers=workers, block_size=BLOCK_SIZE,
            num_gpu_blocks=NUM_GPU_BLOCKS, speedup_ratio=speedup, router_mode=router_mode,
        )  # fmt: skip

    def frontend_pid(self) -> int:
        return self.stack.procs["frontend"].pid

    def worker_pids(self) -> list[int]:
        return [self.stack.procs["mocker"].pid]

    def stop(self) -> None:
        self.stack.stop()


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + sys, all threads) of ``pid`` and its live children."""
    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            c = p.cpu_times()
            total += c.user + c.system
    return total


def check_prompt_tokens(port: int) -> dict[str, int]:
    """Each scenario's prompt as this stack counts it (``usage.prompt_tokens``)."""
    counts = {}
    for name, (body, _) in scenario_bodies().items():
        one = {**body, "stream": False, "max_tokens": 1}
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(one).encode(),
            headers={"content-type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as resp:
            counts[name] = int(json.loads(resp.read())["usage"]["prompt_tokens"])
    return counts


def sample_check(body: bytes, streamed: bool, max_tokens: int) -> str | None:
    """None when the kept response is whole: ``max_tokens`` tokens, a streamed one ending
    in ``[DONE]``; else what is wrong with it."""
    if not streamed:
        try:
            got = int(json.loads(body)["usage"]["completion_tokens"])
        except (ValueError, KeyError, TypeError):
            return f"unreadable response: {body[:200]!r}"
        return None if got == max_tokens else f"{got} tokens, not {max_tokens}"
    if not body.rstrip().endswith(b"data: [DONE]"):
        return f"stream without [DONE]: {body[-200:]!r}"
    texts = 0
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            choices = json.loads(line[6:]).get("choices") or []
            texts += bool(choices and choices[0].get("text"))
    return None if texts == max_tokens else f"{texts} text events, not {max_tokens}"


def measure(
    stack: Stack, idle: Stack | None, raw: bytes, total: int, conc: int, streamed: bool,
    max_tokens: int,
) -> dict[str, Any]:  # fmt: skip
    """One measured run of ``total`` requests at ``conc`` connections."""
    front = stack.frontend_pid()
    idle_pids = [idle.frontend_pid(), *idle.worker_pids()] if idle is not None else []
    cpu0 = tree_cpu(front)
    idle0 = sum(tree_cpu(p) for p in idle_pids)
    error = None
    try:
        res = asyncio.run(run_load("127.0.0.1", stack.port, raw, total, conc, streamed=streamed))
    except (OSError, RuntimeError) as exc:  # a connection lost: the run is void
        return {"requests": total, "completed": 0, "errors": total, "error": repr(exc)}
    cpu = tree_cpu(front) - cpu0
    idle_cpu = sum(tree_cpu(p) for p in idle_pids) - idle0
    completed = total - res.errors
    if res.errors:
        error = f"{res.errors} non-200 responses"
    elif problem := sample_check(res.sample_body, streamed, max_tokens):
        error = problem
    return {
        "requests": total,
        "completed": completed,
        "errors": res.errors,
        "error": error,
        "frontend_cpu_ms_per_request": round(1000 * cpu / max(completed, 1), 3),
        "requests_per_s": round(completed / res.elapsed_s, 1),
        "latency_p50_ms": round(1000 * percentile(res.latencies_s, 0.5), 2),
        "latency_p99_ms": round(1000 * percentile(res.latencies_s, 0.99), 2),
        "idle_stack_cpu_ms_per_request": round(1000 * idle_cpu / max(completed, 1), 3),
    }


MEDIAN_KEYS = ("frontend_cpu_ms_per_request", "requests_per_s", "latency_p50_ms",
               "latency_p99_ms", "idle_stack_cpu_ms_per_request")  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each figure over the runs that completed, with the runs' CPU figures."""
    good = [r for r in runs if r.get("error") is None]
    row: dict[str, Any] = {
        "runs": len(runs),
        "failed_runs": len(runs) - len(good),
        "completed": sum(r["completed"] for r in runs),
        "errors": sum(r["errors"] for r in runs),
    }
    if failures := [r["error"] for r in runs if r.get("error")]:
        row["run_errors"] = failures[:3]
    for key in MEDIAN_KEYS:
        if good:
            row[key] = round(statistics.median(r[key] for r in good), 3)
    row["cpu_ms_per_request_runs"] = [r.get("frontend_cpu_ms_per_request") for r in runs]
    return row


def start_stacks(
    args: argparse.Namespace, mode: str, tmp: Path, model_dir: Path
) -> dict[str, Stack]:
    stacks: dict[str, Stack] = {}
    for system in args.systems:
        stack: TurnoutStack | DynamoSide
        if system == "turnout":
            stack = TurnoutStack(tmp / f"turnout-{mode}", model_dir, args.turnout_frontend_args)
        else:
            stack = DynamoSide(tmp / f"dynamo-{mode}")
        stacks[system] = stack
        why = stack.start(mode, args.workers, args.speedup_ratio)
        if why is not None:
            for s in stacks.values():
                s.stop()
            raise SystemExit(f"{system} ({mode}) did not start: {why}")
    return stacks


def describe(stack: Stack) -> dict[str, Any]:
    proc = psutil.Process(stack.frontend_pid())
    return {
        "frontend_threads": proc.num_threads(),
        "frontend_children": len(proc.children(recursive=True)),
        "frontend_cmdline": " ".join(proc.cmdline()[1:4]),
        "prompt_tokens": check_prompt_tokens(stack.port),
    }


def run_mode(
    args: argparse.Namespace, mode: str, tmp: Path, model_dir: Path, results: dict[str, Any]
) -> list[dict[str, Any]]:
    stacks = start_stacks(args, mode, tmp, model_dir)
    spy: subprocess.Popen[bytes] | None = None
    try:
        for system, stack in stacks.items():
            info = describe(stack)
            results["stacks"][f"{system}/{mode}"] = info
            expected = {"short": SHORT_PROMPT_TOKENS, "long_stream": LONG_PROMPT_TOKENS}
            if info["prompt_tokens"] != expected:
                raise SystemExit(f"{system}: prompts tokenized as {info['prompt_tokens']}")
        if args.profile == "py-spy" and "turnout" in stacks:
            pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            out = tmp / f"turnout-{mode}.pyspy.txt"
            spy = subprocess.Popen([pyspy, "record", "--pid", str(stacks["turnout"].frontend_pid()),
                                    "--nonblocking", "--threads", "-r", "250", "-f", "raw",
                                    "-o", str(out)], start_new_session=True)  # fmt: skip
            time.sleep(1.0)
        bodies = scenario_bodies()
        rows = []
        for name in track(args.scenarios, "scenarios", label=str):
            body, streamed = bodies[name]
            total = args.stream_requests if streamed else args.short_requests
            max_tokens = int(body["max_tokens"])
            for conc in args.concurrency:
                runs: dict[str, list[dict[str, Any]]] = {s: [] for s in stacks}
                raws = {s: render_post(f"127.0.0.1:{st.port}", "/v1/completions",
                                       json.dumps(body).encode())
                        for s, st in stacks.items()}  # fmt: skip
                warmup = max(total // 5, 2 * conc)
                for system, stack in stacks.items():
                    asyncio.run(run_load("127.0.0.1", stack.port, raws[system], warmup, conc,
                                         streamed=streamed))  # fmt: skip
                order = list(stacks)
                for _ in range(args.repeat):
                    for system in order:
                        idle = next((st for s, st in stacks.items() if s != system), None)
                        runs[system].append(measure(stacks[system], idle, raws[system], total,
                                                    conc, streamed, max_tokens))  # fmt: skip
                    order.reverse()
                for system in stacks:
                    row = {"system": system, "mode": mode, "scenario": name,
                           "concurrency": conc, **summarize(runs[system])}  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
            out = tmp / f"turnout-{mode}.pyspy.txt"
            if out.exists():
                summary = summarize_pyspy(out, stacks["turnout"].frontend_pid(), top=25)
                results["profiles"][mode] = {"file": str(out), **summary}
        return rows
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        for stack in stacks.values():
            stack.stop()


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """turnout/Dynamo per (mode, scenario, concurrency), from the median CPU per request."""
    by_key = {(r["system"], r["mode"], r["scenario"], r["concurrency"]): r for r in rows}
    out = []
    for (system, mode, scenario, conc), t in by_key.items():
        d = by_key.get(("dynamo", mode, scenario, conc))
        if system != "turnout" or d is None:
            continue
        key = "frontend_cpu_ms_per_request"
        if key not in t or key not in d:
            continue
        out.append({
            "mode": mode, "scenario": scenario, "concurrency": conc,
            "turnout_cpu_ms": t[key], "dynamo_cpu_ms": d[key],
            "ratio": round(t[key] / d[key], 2) if d[key] else None,
            "turnout_p50_ms": t.get("latency_p50_ms"), "dynamo_p50_ms": d.get("latency_p50_ms"),
            "turnout_p99_ms": t.get("latency_p99_ms"), "dynamo_p99_ms": d.get("latency_p99_ms"),
            "turnout_rps": t.get("requests_per_s"), "dynamo_rps": d.get("requests_per_s"),
            "errors": t["errors"] + d["errors"],
        })  # fmt: skip
    return out


def print_table(table: list[dict[str, Any]]) -> None:
    head = (
        f"{'mode':<12}{'scenario':<12}{'conc':>5}  {'CPU ms/req t / D':>17}  {'ratio':>6}  "
        f"{'p50 ms t / D':>15}  {'p99 ms t / D':>15}  {'req/s t / D':>15}  {'err':>4}"
    )
    print(head)
    print("-" * len(head))
    for r in table:
        print(f"{r['mode']:<12}{r['scenario']:<12}{r['concurrency']:>5}  "
              f"{r['turnout_cpu_ms']:>7.3f} / {r['dynamo_cpu_ms']:<7.3f}  "
              f"{'x' + format(r['ratio'], '.2f') if r['ratio'] else '-':>6}  "
              f"{r['turnout_p50_ms']:>6.1f} / {r['dynamo_p50_ms']:<6.1f}  "
              f"{r['turnout_p99_ms']:>6.1f} / {r['dynamo_p99_ms']:<6.1f}  "
              f"{r['turnout_rps']:>6.0f} / {r['dynamo_rps']:<6.0f}  {r['errors']:>4}")  # fmt: skip


def turnout_source() -> dict[str, Any]:
    """Where the stacks' ``turnout`` comes from (``PYTHONPATH`` may point at a worktree):
    its package path, that tree's commit and whether it has uncommitted changes."""
    code = "import turnout, os; print(os.path.dirname(turnout.__file__))"
    out: dict[str, Any] = {"package": "?", "commit": "?", "dirty": None}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out["package"] = subprocess.check_output([sys.executable, "-c", code], text=True).strip()
        tree = str(Path(out["package"]).parent)
        out["commit"] = subprocess.check_output(
            ["git", "-C", tree, "rev-parse", "--short", "HEAD"], text=True
        ).strip()
        status = subprocess.check_output(
            ["git", "-C", tree, "status", "--porcelain", "--untracked-files=no", "."], text=True
        )
        out["dirty"] = bool(status.strip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--scenarios", nargs="+", default=["short", "long_stream"],
                    choices=["short", "long_stream"])  # fmt: skip
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--speedup-ratio", type=float, default=DEFAULT_SPEEDUP,
                    help="both mockers' --speedup-ratio")  # fmt: skip
    ap.add_argument("--turnout-frontend-args", type=shlex.split, default=[],
                    help="extra flags for turnout's frontend, one string "
                         "(e.g. '--no-router-replica-sync')")  # fmt: skip
    ap.add_argument("--short-requests", type=int, default=2000)
    ap.add_argument("--stream-requests", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=5, help="measured runs per row (medians kept)")
    ap.add_argument("--profile", choices=["py-spy"],
                    help="sample turnout's frontend with py-spy over its runs (its CPU "
                         "figures stay valid: py-spy runs in its own process)")  # fmt: skip
    ap.add_argument("--label", default="", help="free text stored in the JSON (e.g. 'baseline')")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/frontend_vs_dynamo.json"))
    args = ap.parse_args()
    if "dynamo" in args.systems and (why := dynamo_unavailable()) is not None:
        raise SystemExit(why)

    results: dict[str, Any] = {
        "label": args.label,
        "turnout": turnout_source(),
        "machine": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "label")},
        "workers": (
            f"{args.workers} mocker workers in one process, speedup {args.speedup_ratio:g}, "
            f"block size {BLOCK_SIZE}, {NUM_GPU_BLOCKS} blocks each"
        ),
        "client": "bench_http (raw asyncio HTTP/1.1 keep-alive), in this process",
        "stacks": {},
        "profiles": {},
        "rows": [],
    }
    tmp = Path(tempfile.mkdtemp(prefix="frontend-vs-dynamo-"))
    model_dir = write_model_dir(tmp / "model")
    try:
        for mode in args.modes:
            results["rows"] += run_mode(args, mode, tmp, model_dir, results)
    finally:
        if args.profile is None:  # a profile's raw samples stay there, named in the JSON
            shutil.rmtree(tmp, ignore_errors=True)
    results["ratios"] = ratios(results["rows"])
    results["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print()
    if results["ratios"]:
        print_table(results["ratios"])
    for mode, prof in results["profiles"].items():
        print(f"\nturnout frontend, {mode}: top self time (% of event-loop thread samples)")
        for func, pct in prof["self_pct"][:20]:
            print(f"  {pct:5.1f}  {func}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
