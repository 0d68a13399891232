"""Embeddings: requests/s and sentences/s through turnout, against the model run directly.

For each batch size (inputs per request: 1, 8, 32 by default) it measures

* **direct**: ``SentenceEmbeddingModel.embed`` called in a loop in this process, one batch at
  a time (ONNX Runtime, the same graph and threads the worker uses): the model's own speed;
* **served**: ``turnout serve --engine embeddings`` (a frontend and a worker process, the
  real deployment) answering ``POST /v1/embeddings`` requests of that many sentences, sent
  by ``--concurrency`` clients at once (httpx, keep-alive); the worker batches concurrent
  requests together (at most ``--max-batch-size`` inputs per batch).

The serving overhead is the ratio of the two (served / direct sentences/s, 1.0 = none).
On a 2-core machine the client, the frontend and the worker share the cores with the
model, so the ratio includes their CPU. Prints a table, writes JSON (and a PNG).

Usage::

    python benchmarks/embeddings.py [--batches 1 8 32] [--seconds 5] [--concurrency 4]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from turnout.engines.embeddings.model import DEFAULT_MODEL_NAME, SentenceEmbeddingModel
from turnout.frontend.service import free_port

ROOT = Path(__file__).resolve().parent.parent
#: Sentences of everyday length (8 to 30 tokens), cycled through.
SENTENCES = json.loads((ROOT / "tests" / "data" / "minilm_reference.json").read_text())["sentences"]


def batch_of(size: int, start: int) -> list[str]:
    return [SENTENCES[(start + i) % len(SENTENCES)] for i in range(size)]


def measure_direct(model: SentenceEmbeddingModel, size: int, seconds: float) -> dict[str, float]:
    tokenizer = __import__("tokenizers").Tokenizer.from_str(model.tokenizer_json.decode())
    batches = [[e.ids for e in tokenizer.encode_batch(batch_of(size, i))] for i in range(16)]
    model.embed(batches[0])  # warm-up
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        model.embed(batches[done % len(batches)])
        done += 1
    elapsed = time.perf_counter() - start
    return {"requests_per_s": done / elapsed, "sentences_per_s": done * size / elapsed}


async def measure_served(url: str, size: int, seconds: float, concurrency: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        body = {"model": DEFAULT_MODEL_NAME, "input": batch_of(size, 0)}
        (await http.post("/v1/embeddings", json=body)).raise_for_status()  # warm-up
        done = 0
        latencies: list[float] = []
        deadline = time.perf_counter() + seconds

        async def client(k: int) -> None:
            nonlocal done
            i = k
            while time.perf_counter() < deadline:
                body = {"model": DEFAULT_MODEL_NAME, "input": batch_of(size, i)}
                sent = time.perf_counter()
                r = await http.post("/v1/embeddings", json=body)
                r.raise_for_status()
                latencies.append(time.perf_counter() - sent)
                done += 1
                i += concurrency

        start = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "requests_per_s": done / elapsed,
        "sentences_per_s": done * size / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def start_serve(port: int, store: Path, threads: int, max_batch: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "turnout", "serve", "--engine", "embeddings",
         "--port", str(port), "--store-path", str(store), "--threads", str(threads),
         "--max-batch-size", str(max_batch), "--log-level", "warning"],
        start_new_session=True,
    )  # fmt: skip


def wait_ready(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("turnout serve did not become healthy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/embeddings.json"))
    p.add_argument("--plot", default=None, help="PNG path (default: beside --out)")
    args = p.parse_args()

    model = SentenceEmbeddingModel(threads=args.threads)
    direct = {size: measure_direct(model, size, args.seconds) for size in args.batches}
    del model
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_serve(port, Path(tmp) / "store.sqlite", args.threads, args.max_batch_size)
        try:
            wait_ready(url)
            served = {
                (size, c): asyncio.run(measure_served(url, size, args.seconds, c))
                for size in args.batches
                for c in sorted({1, args.concurrency})
            }
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    rows = []
    print(f"{'inputs/req':>10} {'clients':>7} {'direct sent/s':>14} {'served req/s':>13} "
          f"{'served sent/s':>14} {'ratio':>6} {'p50 ms':>7} {'p99 ms':>7}")  # fmt: skip
    for (size, c), s in served.items():
        d = direct[size]
        ratio = s["sentences_per_s"] / d["sentences_per_s"]
        rows.append({"batch": size, "concurrency": c, "direct": d, "served": s, "ratio": ratio})
        print(f"{size:>10} {c:>7} {d['sentences_per_s']:>14.1f} {s['requests_per_s']:>13.1f} "
              f"{s['sentences_per_s']:>14.1f} {ratio:>6.2f} {s['p50_ms']:>7.1f} "
              f"{s['p99_ms']:>7.1f}")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "plot")}
    out.write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = args.batches
    ax.plot(sizes, [direct[s]["sentences_per_s"] for s in sizes], "o-", label="model directly")
    for c in sorted({1, args.concurrency}):
        ys = [served[(s, c)]["sentences_per_s"] for s in sizes]
        ax.plot(sizes, ys, "s--", label=f"turnout, {c} client(s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("inputs per request")
    ax.set_ylabel("sentences / s")
    ax.set_title("all-MiniLM-L6-v2 on this machine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot, dpi=100)
    print(f"wrote {plot}")


if __name__ == "__main__":
    main()
