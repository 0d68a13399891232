"""Chaos benchmark: what each kind of fault costs a real stack under a steady streaming load.

Every fault gets a fresh stack: etcd (``tests/servers/etcd.py``; the file store when etcd is not
installed, and then no store fault), a frontend and three mocker workers (separate processes,
tcp request plane, zmq event plane). ``--concurrency`` clients each send one streamed
completion after another (token-id prompts, ``ignore_eos``, ``--max-tokens`` tokens, about a
second each) for ``--duration`` seconds; ``--fault-at`` seconds in, the fault strikes:

* ``none``: nothing (the baseline);
* ``kill9``: SIGKILL one worker, then start a new one (as a supervisor would);
* ``sigstop``: freeze one worker for ``--outage`` seconds, then let it go on (SIGCONT);
* ``sigterm``: stop one worker cleanly (it drains), then start a new one;
* ``store_restart``: stop etcd for ``--outage`` seconds, then start it again on its data;
* ``overload``: ``--burst`` extra clients at once (short, not streamed) against the
  frontend's admission limits (``--max-inflight`` 64, ``--queue-size`` 32, 429).

Reported per fault, for the steady clients: requests sent, completed (200 and the stream
whole: ``finish_reason`` length, no error event), failed (anything else), migrated (the
frontend's ``turnout_migrations_total`` after minus before), rejected (429 from admission),
and p50/p99 latency of the completed ones next to the baseline's; for ``overload`` also the
burst's own outcomes. Printed as a table, written to ``benchmarks/results/chaos.json`` and
plotted in ``benchmarks/results/chaos.png``.

Why one connection per request: a fault may break connections, and a client that reconnects
for every request measures each request on its own (the cost of a loopback connect is far
below the latencies measured here).

Usage::

    python benchmarks/chaos.py                          # every fault, ~2.5 minutes
    python benchmarks/chaos.py --faults none kill9      # some of them
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from tests.integration.procs import ProcessSet, health, wait_until  # noqa: E402
from tests.servers.etcd import EtcdServer, etcd_binary  # noqa: E402

from bench_http import one_request, percentile, render_post  # noqa: E402

FAULTS = ("none", "kill9", "sigstop", "sigterm", "store_restart", "overload")
MODEL = "mock"
WORKERS = 3
REJECT_STATUS = 429
#: The frontend's settings in every run: migration with stall detection, a request deadline,
#: and admission limits the steady load stays well inside (the overload fault does not).
FRONTEND_FLAGS = (
    "--migration-limit", "3", "--stall-timeout", "1", "--ttft-timeout", "2",
    "--request-timeout", "30", "--max-inflight", "64", "--queue-size", "32",
    "--queue-timeout", "2", "--reject-status", str(REJECT_STATUS),
)  # fmt: skip
#: Seconds one request may take on the client side before it counts as failed (hung).
CLIENT_TIMEOUT_S = 60.0


# -- client ------------------------------------------------------------------------------------


async def send(port: int, raw: bytes) -> tuple[int, bytes] | str:
    """One request; (status, body), or a string naming what went wrong instead."""
    answer = await one_request("127.0.0.1", port, raw, CLIENT_TIMEOUT_S)
    return answer if isinstance(answer, str) else (answer[0], answer[2])


def classify(answer: tuple[int, bytes] | str, streamed: bool) -> str:
    """``completed``, ``rejected`` (admission) or ``failed``."""
    if isinstance(answer, str):
        return "failed"
    status, body = answer
    if status == REJECT_STATUS:
        return "rejected"
    if status != 200:
        return "failed"
    if streamed and (b'"finish_reason":"length"' not in body or b'{"error":' in body):
        return "failed"
    return "completed"


def request_bytes(port: int, i: int, max_tokens: int, streamed: bool) -> bytes:
    body = {"model": MODEL, "prompt": [100 + i % 97, 200 + i % 89, 7, 8, 9, 10],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": streamed}  # fmt: skip
    return render_post(f"127.0.0.1:{port}", "/v1/completions", json.dumps(body).encode())


@dataclass
class Outcomes:
    """What one group of clients got."""

    sent: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0
    latencies_s: list[float] = field(default_factory=list)
    #: (start, end) of each completed request, on the monotonic clock, as ``latencies_s``.
    spans: list[tuple[float, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def add(
        self, answer: tuple[int, bytes] | str, streamed: bool, latency: float, start: float = 0.0
    ) -> None:
        self.sent += 1
        kind = classify(answer, streamed)
        if kind == "completed":
            self.completed += 1
            self.latencies_s.append(latency)
            self.spans.append((start, start + latency))
        elif kind == "rejected":
            self.rejected += 1
        else:
            self.failed += 1
            if len(self.failures) < 5:
                what = answer if isinstance(answer, str) else f"{answer[0]} {answer[1][-300:]!r}"
                self.failures.append(what)


async def steady_load(port: int, concurrency: int, duration: float, max_tokens: int) -> Outcomes:
    """``concurrency`` clients, each sending one streamed request after another."""
    out = Outcomes()
    stop_at = time.monotonic() + duration
    counter = iter(range(10**9))

    async def client() -> None:
        while time.monotonic() < stop_at:
            raw = request_bytes(port, next(counter), max_tokens, streamed=True)
            t0 = time.monotonic()
            answer = await send(port, raw)
            out.add(answer, True, time.monotonic() - t0, t0)
            if isinstance(answer, str) or answer[0] != 200:
                await asyncio.sleep(0.1)  # a failing stack is not spun on

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out


async def burst(port: int, clients: int) -> Outcomes:
    """``clients`` short unstreamed requests at once."""
    out = Outcomes()

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        answer = await send(port, request_bytes(port, i, 16, streamed=False))
        out.add(answer, False, time.perf_counter() - t0)

    await asyncio.gather(*(one(i) for i in range(clients)))
    return out


# -- stack and faults ----------------------------------------------------------------------------


@dataclass
class Stack:
    """A frontend and ``WORKERS`` mocker workers on one store; etcd when ``etcd`` is set."""

    procs: ProcessSet
    etcd: EtcdServer | None
    worker_flags: tuple[str, ...]

    def add_worker(self) -> None:
        self.procs.worker(*self.worker_flags)

    def worker(self, n: int) -> Any:
        return [p for p in self.procs.procs[1:] if p.poll() is None][n]

    def close(self) -> None:
        for proc in self.procs.procs:  # a stopped process dies of SIGKILL only once resumed
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
        self.procs.close()
        if self.etcd is not None:
            self.etcd.kill()


def start_stack(tmp: Path, speedup: float, use_etcd: bool) -> Stack:
    etcd = None
    procs = ProcessSet(tmp, lease_ttl=3.0)
    if use_etcd:
        etcd = EtcdServer(tmp / "etcd").start()
        procs.store_flags = ["--store", "etcd", "--store-endpoints", etcd.url]
    flags = ("--engine", "mocker", "--model-name", MODEL, "--seed", "7",
             "--speedup-ratio", str(speedup))  # fmt: skip
    stack = Stack(procs, etcd, flags)
    try:
        procs.frontend(*FRONTEND_FLAGS)
        for _ in range(WORKERS):
            stack.add_worker()
        wait_until(lambda: len(health(procs.url).get(MODEL, [])) == WORKERS, 60, "the workers",
                   procs.logs)  # fmt: skip
    except BaseException:
        stack.close()
        raise
    return stack


def fault_action(fault: str, stack: Stack, outage: float) -> Callable[[], None]:
    """The blocking action that injects ``fault`` (run in a thread while the load runs)."""

    def kill9() -> None:
        os.killpg(stack.worker(0).pid, signal.SIGKILL)
        stack.add_worker()

    def sigstop() -> None:
        victim = stack.worker(0)
        os.killpg(victim.pid, signal.SIGSTOP)
        time.sleep(outage)
        os.killpg(victim.pid, signal.SIGCONT)

    def sigterm() -> None:
        victim = stack.worker(0)
        os.killpg(victim.pid, signal.SIGTERM)
        victim.wait(timeout=30)
        stack.add_worker()

    def store_restart() -> None:
        assert stack.etcd is not None
        stack.etcd.stop()
        time.sleep(outage)
        stack.etcd.start()

    actions = {"none": lambda: None, "kill9": kill9, "sigstop": sigstop, "sigterm": sigterm,
               "store_restart": store_restart, "overload": lambda: None}  # fmt: skip
    return actions[fault]


def migrations(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        float(v) for v in re.findall(r"^turnout_migrations_total\{[^}]*\} (\S+)$", text, re.M)
    )


@dataclass
class FaultResult:
    fault: str
    sent: int
    completed: int
    failed: int
    migrated: int
    rejected: int
    p50_ms: float
    p99_ms: float
    #: p99 of the completed requests in flight at some moment of the fault window (from the
    #: fault to ``--window`` seconds after it): the whole run's p99 dilutes a short fault.
    window_p99_ms: float
    window_requests: int
    failures: list[str]
    burst: dict[str, int] | None = None


async def run_fault(fault: str, args: argparse.Namespace, use_etcd: bool) -> FaultResult:
    with tempfile.TemporaryDirectory(prefix=f"turnout-chaos-{fault}-") as tmp:
        stack = start_stack(Path(tmp), args.speedup, use_etcd)
        try:
            before = migrations(stack.procs.url)
            load = asyncio.create_task(
                steady_load(stack.procs.port, args.concurrency, args.duration, args.max_tokens)
            )
            await asyncio.sleep(args.fault_at)
            fault_start = time.monotonic()
            burst_out = None
            if fault == "overload":
                burst_out = await burst(stack.procs.port, args.burst)
            else:
                action = fault_action(fault, stack, args.outage)
                thread = threading.Thread(target=action, daemon=True)
                thread.start()
                await asyncio.to_thread(thread.join, 60)
            out = await load
            migrated = int(migrations(stack.procs.url) - before)
        finally:
            stack.close()
    lat = out.latencies_s
    window = (fault_start, fault_start + args.window)
    in_window = [e - s for s, e in out.spans if s < window[1] and e > window[0]]
    return FaultResult(
        fault=fault, sent=out.sent, completed=out.completed, failed=out.failed,
        migrated=migrated, rejected=out.rejected,
        p50_ms=percentile(lat, 0.50) * 1e3, p99_ms=percentile(lat, 0.99) * 1e3,
        window_p99_ms=percentile(in_window, 0.99) * 1e3, window_requests=len(in_window),
        failures=out.failures,
        burst=None if burst_out is None else {
            "sent": burst_out.sent, "completed": burst_out.completed,
            "rejected": burst_out.rejected, "failed": burst_out.failed,
        },
    )  # fmt: skip


# -- report --------------------------------------------------------------------------------------


def table(results: list[FaultResult]) -> str:
    base = next((r for r in results if r.fault == "none"), None)
    head = (
        f"{'fault':<14}{'sent':>6}{'ok':>6}{'failed':>8}{'migrated':>10}{'rejected':>10}"
        f"{'p50 ms':>9}{'p99 ms':>9}{'win p99':>9}{'base p50':>10}{'base p99':>10}  note"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        note = ""
        if r.burst:
            b = r.burst
            note = (f"burst {b['sent']}: {b['completed']} ok, {b['rejected']} rejected, "
                    f"{b['failed']} failed")  # fmt: skip
        bp50 = f"{base.p50_ms:10.0f}" if base else f"{'-':>10}"
        bp99 = f"{base.p99_ms:10.0f}" if base else f"{'-':>10}"
        lines.append(
            f"{r.fault:<14}{r.sent:>6}{r.completed:>6}{r.failed:>8}{r.migrated:>10}"
            f"{r.rejected:>10}{r.p50_ms:9.0f}{r.p99_ms:9.0f}{r.window_p99_ms:9.0f}{bp50}{bp99}"
            f"  {note}"
        )
    return "\n".join(lines)


def plot(results: list[FaultResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.fault for r in results]
    xs = range(len(results))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    bottom = [0] * len(results)
    for key, color in (("completed", "tab:green"), ("rejected", "tab:orange"),
                       ("failed", "tab:red")):  # fmt: skip
        values = [getattr(r, key) for r in results]
        ax1.bar(xs, values, bottom=bottom, color=color, label=key)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, r in zip(xs, results, strict=True):
        ax1.annotate(f"mig {r.migrated}\nrej {r.rejected}\nfail {r.failed}", (x, max(bottom)),
                     ha="center", va="bottom", fontsize=7)  # fmt: skip
    ax1.set_ylim(0, max(bottom) * 1.25)
    ax1.set_xticks(list(xs), names, rotation=20)
    ax1.set_ylabel("steady-load requests")
    ax1.set_title("Outcomes per fault")
    ax1.legend(fontsize=8, loc="lower right")

    base = next((r for r in results if r.fault == "none"), None)
    width = 0.27
    ax2.bar([x - width for x in xs], [r.p50_ms for r in results], width, label="p50")
    ax2.bar(xs, [r.p99_ms for r in results], width, label="p99 (run)")
    ax2.bar([x + width for x in xs], [r.window_p99_ms for r in results], width,
            label="p99 (fault window)")  # fmt: skip
    if base is not None:
        ax2.axhline(base.p99_ms, color="gray", linestyle="--", label="baseline p99")
    ax2.set_xticks(list(xs), names, rotation=20)
    ax2.set_ylabel("latency of completed requests (ms)")
    ax2.set_title("Latency vs baseline")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--concurrency", type=int, default=12, help="steady clients")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per fault")
    parser.add_argument("--fault-at", type=float, default=6.0, help="seconds into the load")
    parser.add_argument("--outage", type=float, default=4.0, help="sigstop / store seconds")
    parser.add_argument("--window", type=float, default=8.0, help="seconds of fault window")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--speedup", type=float, default=1.0, help="mocker --speedup-ratio")
    parser.add_argument("--burst", type=int, default=2000, help="overload: extra clients")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()

    use_etcd = etcd_binary() is not None
    faults = [f for f in args.faults if use_etcd or f != "store_restart"]
    if len(faults) < len(args.faults):
        print("etcd is not installed: the file store is used and store_restart is skipped")
    results = []
    for fault in faults:
        t0 = time.monotonic()
        result = asyncio.run(run_fault(fault, args, use_etcd))
        print(f"{fault}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
        results.append(result)
    report = table(results)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    setup = {k: v for k, v in vars(args).items() if k != "out"}
    setup |= {"store": "etcd" if use_etcd else "file", "workers": WORKERS,
              "frontend_flags": list(FRONTEND_FLAGS)}  # fmt: skip
    (args.out / "chaos.json").write_text(
        json.dumps({"setup": setup, "results": [asdict(r) for r in results]}, indent=2) + "\n"
    )
    plot(results, args.out / "chaos.png")
    print(f"wrote {args.out / 'chaos.json'} and {args.out / 'chaos.png'}")


if __name__ == "__main__":
    main()
