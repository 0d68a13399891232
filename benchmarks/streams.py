"""10,000 concurrent streams through one frontend: does every one finish, and at what memory.

One KV-routing frontend (``--planes``: etcd + tcp + zmq, or etcd + NATS) in front of
``--workers`` mocker instances slowed down (``--speedup-ratio`` below 1: seconds per token),
so that streams stay open while the rest arrive. The client opens ``--streams`` connections,
``--connect-rate`` a second (0: all at once, at most ``--connect-burst`` connecting at a
time), each sending one streamed completion of ``--max-tokens`` tokens, and reads every SSE
stream to its end on raw asyncio sockets: a stream counts as complete when it answered 200,
sent ``data: [DONE]`` and its terminating chunk, with no ``"error"`` event.

Reported: streams complete / failed (by reason), the peak of streams open at once (client
side) and of the frontend's own ``turnout_inflight_requests``, the time until every stream
was open and until the last one ended, the frontend's peak RSS, its CPU (total and per
stream), the peak of its listening socket's accept queue (``ss``: a queue at its bound drops
handshakes, which clients see as resets and connect timeouts), the connections it closed by
reason, and the client's file-descriptor limit (raised to the hard limit; the frontend
inherits it).

The frontend runs with ``--max-inflight 0`` (no admission limit) unless ``--default-limits``:
its default (1024 in flight, 1024 queued) answers the rest 503 at once, which is what
``--default-limits`` shows.

    .venv/bin/python benchmarks/streams.py                      # 10,000 streams (~4 min)
    .venv/bin/python benchmarks/streams.py --streams 2000       # smaller
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_http import percentile, render_post
from scale_stack import MODEL, PLANE_SETS, Stack, StackConfig, counter_sum, get_metrics

RESULTS = Path(__file__).parent / "results" / "scale_streams.json"


class _Stream(asyncio.Protocol):
    """One streamed request on its own connection; reads the chunked SSE body to its end,
    keeping only the few bytes needed to find its markers across reads."""

    def __init__(self, raw: bytes, done: asyncio.Future[str], counters: dict[str, int]) -> None:
        self.raw = raw
        self.done = done
        self.counters = counters
        self.head = bytearray()
        self.status = 0
        self.tail = b""
        self.saw_done = False
        self.saw_error = False
        self.first_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.counters["open"] += 1
        self.counters["peak_open"] = max(self.counters["peak_open"], self.counters["open"])
        transport.write(self.raw)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if not self.status:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            self.status = int(self.head[9:12])
            data = bytes(self.head[end + 4 :])
            self.head = bytearray()
            self.first_at = time.perf_counter()
        window = self.tail + data
        if b"[DONE]" in window:
            self.saw_done = True
        if b'"error"' in window:
            self.saw_error = True
        self.tail = window[-16:]
        if window.endswith(b"\r\n0\r\n\r\n") or (self.status != 200 and window.endswith(b"}")):
            self._finish()

    def _finish(self) -> None:
        if self.done.done():
            return
        if self.status != 200:
            self.done.set_result(f"status {self.status}")
        elif self.saw_error:
            self.done.set_result("error event")
        elif not self.saw_done:
            self.done.set_result("no [DONE]")
        else:
            self.done.set_result("ok")

    def connection_lost(self, exc: Exception | None) -> None:
        self.counters["open"] -= 1
        if not self.done.done():
            if self.status and self.status != 200:
                self._finish()
            else:
                self.done.set_result(f"connection lost ({type(exc).__name__ if exc else 'EOF'})")


async def run_streams(port: int, raw: bytes, args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    counters = {"open": 0, "peak_open": 0}
    outcomes: collections.Counter[str] = collections.Counter()
    durations: list[float] = []
    first: list[float] = []
    gate = asyncio.Semaphore(args.connect_burst)
    t0 = time.perf_counter()
    interval = 1.0 / args.connect_rate if args.connect_rate > 0 else 0.0
    all_open_at = [0.0]
    opened = [0]

    async def one(k: int) -> None:
        done: asyncio.Future[str] = loop.create_future()
        transport = None
        if interval:
            await asyncio.sleep(max(0.0, t0 + k * interval - time.perf_counter()))
        start = time.perf_counter()
        try:
            async with gate:
                transport, proto = await loop.create_connection(
                    lambda: _Stream(raw, done, counters), "127.0.0.1", port
                )
            opened[0] += 1
            if opened[0] == args.streams:
                all_open_at[0] = time.perf_counter() - t0
            outcome = await asyncio.wait_for(done, args.stream_timeout)
            if proto.first_at:
                first.append(proto.first_at - start)
        except (OSError, TimeoutError) as exc:
            outcome = type(exc).__name__
        finally:
            if transport is not None:
                transport.close()
        outcomes[outcome] += 1
        if outcome == "ok":
            durations.append(time.perf_counter() - start)

    await asyncio.gather(*(one(k) for k in range(args.streams)))
    return {
        "wall_s": round(time.perf_counter() - t0, 1),
        "all_open_s": round(all_open_at[0], 1) if all_open_at[0] else None,
        "outcomes": dict(outcomes),
        "complete": outcomes["ok"],
        "peak_open_client": counters["peak_open"],
        "first_chunk_p50_s": round(percentile(first, 0.5), 2),
        "first_chunk_p99_s": round(percentile(first, 0.99), 2),
        "duration_p50_s": round(percentile(durations, 0.5), 1),
        "duration_max_s": round(max(durations, default=0.0), 1),
    }


def accept_queue(port: int) -> tuple[int, int]:
    """(connections waiting in the listening socket's accept queue, its bound), from ``ss``."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True,
                         timeout=5).stdout.split()  # fmt: skip
    return (int(out[1]), int(out[2])) if len(out) >= 3 else (0, 0)


class Sampler(threading.Thread):
    """Polls the frontend's RSS, file descriptors and accept queue (every 0.2 s) and its
    in-flight gauge (every ``metrics_every``)."""

    def __init__(self, proc: psutil.Process, port: int, metrics_every: float) -> None:
        super().__init__(daemon=True)
        self.proc, self.port, self.metrics_every = proc, port, metrics_every
        self.stop = threading.Event()
        self.peak_rss = 0
        self.peak_inflight = 0.0
        self.peak_fds = 0
        self.peak_accept_queue = 0
        self.backlog = 0

    def run(self) -> None:
        next_metrics = 0.0
        while not self.stop.wait(0.2):
            try:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
                self.peak_fds = max(self.peak_fds, self.proc.num_fds())
            except psutil.NoSuchProcess:
                return
            queued, self.backlog = accept_queue(self.port)
            self.peak_accept_queue = max(self.peak_accept_queue, queued)
            if time.monotonic() >= next_metrics:
                next_metrics = time.monotonic() + self.metrics_every
                inflight = counter_sum(get_metrics(self.port), "turnout_inflight_requests")
                self.peak_inflight = max(self.peak_inflight, inflight)


def closed_by_reason(text: str) -> dict[str, float]:
    """``turnout_http_connections_closed_total`` by its ``reason`` label."""
    found = re.findall(r'^turnout_http_connections_closed_total{[^}]*reason="([^"]+)"[^}]*} (\S+)$',
                       text, re.M)  # fmt: skip
    return {reason: float(v) for reason, v in found if float(v)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=64, help="mocker instances")
    p.add_argument(
        "--per-process",
        type=int,
        default=16,
        help="instances a process (its tcp server runs 4096 streams)",
    )
    p.add_argument("--speedup", type=float, default=0.005, help="mocker --speedup-ratio")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--connect-burst", type=int, default=512, help="connections opening at once")
    p.add_argument(
        "--connect-rate",
        type=float,
        default=150.0,
        help="new connections a second (0: all at once, bounded by --connect-burst)",
    )
    p.add_argument("--stream-timeout", type=float, default=900.0)
    p.add_argument("--hosts", choices=["netns", "loopback"], default="loopback")
    p.add_argument("--planes", choices=PLANE_SETS, default=PLANE_SETS[0])
    p.add_argument(
        "--default-limits", action="store_true", help="the frontend's default admission limits"
    )
    p.add_argument("--frontend-flag", action="append", default=[], help="extra frontend flag")
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    flags = [] if args.default_limits else ["--max-inflight", "0"]
    tmp = Path(tempfile.mkdtemp(prefix="streams-"))
    config = StackConfig(
        planes=args.planes, workers=args.workers, frontends=1, per_process=args.per_process,
        speedup=args.speedup, hosts=args.hosts, tap=False,
        frontend_flags=[*flags, *args.frontend_flag],
    )  # fmt: skip
    stack = Stack(config, tmp)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    settings = {**vars(args), "output": str(args.output)}
    result: dict[str, Any] = {"commit": commit, "settings": settings, "nofile_limit": [soft, hard]}
    try:
        stack.start_services()
        stack.start_frontends()
        stack.start_workers()
        result["registration_s"] = round(stack.wait_registered(120), 1)
        front = stack.frontend_procs()[0]
        body = {"model": MODEL, "prompt": "Tell me a long story about a lighthouse.",
                "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True}  # fmt: skip
        raw = render_post("127.0.0.1", "/v1/completions", json.dumps(body).encode())
        rss0 = front.memory_info().rss
        cpu0 = sum(front.cpu_times()[:2])
        sampler = Sampler(front, stack.ports[0], metrics_every=2.0)
        sampler.start()
        try:
            result.update(asyncio.run(run_streams(stack.ports[0], raw, args)))
        finally:
            sampler.stop.set()
            sampler.join()
        cpu = sum(front.cpu_times()[:2]) - cpu0
        result.update({
            "frontend_rss_before_mib": round(rss0 / 2**20, 1),
            "frontend_rss_peak_mib": round(sampler.peak_rss / 2**20, 1),
            "frontend_rss_after_mib": round(front.memory_info().rss / 2**20, 1),
            "frontend_fds_peak": sampler.peak_fds,
            "accept_queue_peak": sampler.peak_accept_queue,
            "accept_backlog": sampler.backlog,
            "connections_closed_by_frontend": closed_by_reason(get_metrics(stack.ports[0])),
            "frontend_inflight_peak": int(sampler.peak_inflight),
            "frontend_cpu_s": round(cpu, 1),
            "frontend_cpu_ms_per_stream": round(1000 * cpu / args.streams, 2),
        })  # fmt: skip
    except Exception as exc:  # a failed run is a result too: say what broke
        result["failure"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        stack.close()
        if args.keep_logs or "failure" in result or result.get("complete") != args.streams:
            result["logs"] = str(tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
