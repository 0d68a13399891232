"""Frontend overhead: CPU per request, requests/s and RSS of the frontend process.

The frontend runs in its own process in front of ``echo`` workers (separate processes, file
store, TCP request plane), so the frontend's CPU time (read from /proc through psutil) is its
own: HTTP, JSON, preprocessing (chat template + tokenization), routing, request plane,
detokenization and SSE. Scenarios, each at several concurrencies:

* ``short``: a short prompt, ``max_tokens=1``, not streamed;
* ``long_stream``: a 512-token prompt, 64 tokens streamed back.

Usage::

    python benchmarks/frontend_overhead.py                 # defaults, JSON to results/
    python benchmarks/frontend_overhead.py --profile       # also a cProfile of the frontend

For scale (issue #2): Dynamo 1.6.1's Rust frontend spends ~0.6 ms CPU/request on ``short``
and 1.4-2.1 ms on ``long_stream`` on this kind of machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from turnout.frontend.service import free_port  # noqa: E402

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hum",
]


def long_prompt(tokens: int = 512) -> str:
    from turnout.llm.model_card import default_gguf_path
    from turnout.llm.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_gguf_path())
    words: list[str] = []
    i = 0
    while len(tok.encode(" ".join(words))) < tokens:
        words.append(WORDS[i % len(WORDS)])
        i += 1
    return " ".join(words)


async def drive(url: str, body: dict, stream: bool, total: int, concurrency: int) -> float:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(total):
            queue.put_nowait(i)
        errors = 0

        async def one() -> None:
            nonlocal errors
            while True:
                try:
                    queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                if stream:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        async for _ in r.aiter_raw():
                            pass
                        errors += r.status_code != 200
                else:
                    r = await client.post("/v1/completions", json=body)
                    errors += r.status_code != 200

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        if errors:
            raise RuntimeError(f"{errors} requests failed")
        return elapsed


def wait_ready(url: str, workers: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            body = httpx.get(url + "/health", timeout=2).json()
            if body["models"] and len(body["models"][0]["instances"]) >= workers:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise TimeoutError("stack did not come up")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--short-requests", type=int, default=2000)
    ap.add_argument("--stream-requests", type=int, default=400)
    ap.add_argument("--profile", action="store_true", help="cProfile the frontend process")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/frontend_overhead.json"))
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="turnout-bench-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    common = [
        "--store",
        "file",
        "--store-path",
        str(tmp / "store.sqlite"),
        "--log-level",
        "warning",
    ]
    py = [sys.executable]
    front_cmd = [*py, "-m", "turnout", "frontend", "--port", str(port), *common]
    if args.profile:
        front_cmd = [*py, "-m", "cProfile", "-o", str(tmp / "frontend.prof"), "-m", "turnout",
                     "frontend", "--port", str(port), *common]  # fmt: skip
    procs = [subprocess.Popen(front_cmd, start_new_session=True)]
    for _ in range(args.workers):
        procs.append(subprocess.Popen(
            [*py, "-m", "turnout", "worker", "--engine", "echo", "--model-name", "echo", *common],
            start_new_session=True,
        ))  # fmt: skip
    results: dict = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "workers": args.workers,
        "scenarios": [],
    }
    try:
        wait_ready(url, args.workers)
        front = psutil.Process(procs[0].pid)
        scenarios = [
            ("short", {"model": "echo", "prompt": "Hello, how are you?", "max_tokens": 1},
             False, args.short_requests),
            ("long_stream", {"model": "echo", "prompt": long_prompt(512), "max_tokens": 64,
                             "stream": True}, True, args.stream_requests),
        ]  # fmt: skip
        for name, body, stream, total in scenarios:
            asyncio.run(drive(url, body, stream, min(total, 100), 8))  # warm-up
            for conc in args.concurrency:
                cpu0 = front.cpu_times()
                elapsed = asyncio.run(drive(url, body, stream, total, conc))
                cpu1 = front.cpu_times()
                cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
                row = {
                    "scenario": name,
                    "concurrency": conc,
                    "requests": total,
                    "requests_per_s": round(total / elapsed, 1),
                    "frontend_cpu_ms_per_request": round(1000 * cpu / total, 3),
                    "frontend_rss_mib": round(front.memory_info().rss / 2**20, 1),
                }
                results["scenarios"].append(row)
                print(json.dumps(row))
    finally:
        procs[0].send_signal(signal.SIGINT)
        try:
            procs[0].wait(timeout=20)
        except subprocess.TimeoutExpired:
            procs[0].kill()
        for p in procs[1:]:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    if args.profile and (tmp / "frontend.prof").exists():
        stats = pstats.Stats(str(tmp / "frontend.prof"))
        stats.sort_stats("tottime").print_stats(25)
        results["profile_file"] = str(tmp / "frontend.prof")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
