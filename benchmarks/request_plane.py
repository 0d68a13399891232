"""Request plane overhead: cost per streamed token and short requests per second, per kind.

Server and client run in this process on one event loop (as the in-process numbers of the
event-plane benchmark), so the CPU figures are both ends together; for ``nats`` the
nats-server's own CPU (a separate process this script starts) is reported beside them.
``local`` is the floor: the same handler and consumer with no transport at all.

* ``stream``: ``--streams`` concurrent streams of ``--tokens`` items of ``--size`` bytes; the
  handler yields one item per event-loop iteration (``sleep(0)`` between items, as an engine
  yields one token per step). Reports wall and CPU microseconds per token.
* ``short``: ``--requests`` requests of ``--short-tokens`` items each, ``--concurrency`` in
  flight: requests per second.

``--handler worker`` serves the worker's own generate handler (``Worker._handle``: request
decoding, the engine run behind its output buffer, bursts merged, each output encoded) over an
engine that yields one ``LLMEngineOutput`` per event-loop iteration, and the consumer decodes
each item as the frontend does: the per-token path of a worker and its request plane, not the
transport alone. Per-token figures then count tokens (a merged item counts all it holds).

Usage: ``python benchmarks/request_plane.py [--kinds tcp,nats,local] [--handler worker]``;
writes ``benchmarks/results/request_plane.json`` (``request_plane_worker.json``) and prints a
table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import msgspec
from tests.servers.nats import NatsServerProcess

from turnout.engines.worker import Worker
from turnout.protocols.llm import FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import EndpointId, TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.nats import NatsConnection, NatsOptions, connect_nats
from turnout.runtime.request_plane import RequestPlaneClient, make_client, make_server

RESULTS = Path(__file__).parent / "results"

_encode = msgspec.msgpack.Encoder().encode
_decode_output = msgspec.msgpack.Decoder(LLMEngineOutput).decode


def make_handler(size: int) -> Any:
    token = b"t" * size

    async def tokens(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        for _ in range(int(payload)):
            yield token
            await asyncio.sleep(0)

    return tokens


class _StepEngine:
    """An engine that yields one token per event-loop iteration (an engine step)."""

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        n = request.stop_conditions.max_tokens or 1
        for i in range(n - 1):
            await asyncio.sleep(0)
            yield LLMEngineOutput(token_ids=[1000 + i % 1000])
        await asyncio.sleep(0)
        yield LLMEngineOutput(token_ids=[7], finish_reason=FinishReason.LENGTH)


def make_worker_handler() -> Any:
    """The worker's generate handler over ``_StepEngine`` (nothing else of a worker runs)."""
    endpoint = EndpointId(namespace="bench", component="w", name="gen")
    worker = Worker(None, _StepEngine(), endpoint)  # type: ignore[arg-type]
    return worker._handle


def request_payload(handler: str, tokens: int) -> bytes:
    if handler == "bytes":
        return str(tokens).encode()
    request = {"model": "m", "token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": tokens}}
    return _encode(msgspec.convert(request, PreprocessedRequest))


def count_tokens(handler: str, item: bytes) -> int:
    return 1 if handler == "bytes" else len(_decode_output(item).token_ids)


async def run_streams(
    client: RequestPlaneClient,
    address: TransportAddress,
    streams: int,
    tokens: int,
    handler: str = "bytes",
) -> int:
    payload = request_payload(handler, tokens)

    async def one() -> int:
        n = 0
        async for item in client.stream(address, "bench/w/gen", payload, RequestContext()):
            n += count_tokens(handler, item)
        return n

    counts = await asyncio.gather(*(one() for _ in range(streams)))
    assert all(c == tokens for c in counts), counts
    return sum(counts)


async def run_short(
    client: RequestPlaneClient,
    address: TransportAddress,
    requests: int,
    tokens: int,
    conc: int,
    handler: str = "bytes",
) -> None:
    left = requests
    payload = request_payload(handler, tokens)

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            n = 0
            async for item in client.stream(address, "bench/w/gen", payload, RequestContext()):
                n += count_tokens(handler, item)
            assert n == tokens

    await asyncio.gather(*(worker() for _ in range(conc)))


def _cpu(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    times = proc.cpu_times()
    return float(times.user + times.system)


async def measure(
    kind: str, args: argparse.Namespace, nats_url: str | None, nats_proc: psutil.Process | None
) -> dict[str, Any]:
    conn: NatsConnection | None = None
    if kind == "nats":
        assert nats_url is not None
        conn = await connect_nats(NatsOptions(servers=[nats_url]))
    server = make_server(kind, nats=conn)
    handler = make_handler(args.size) if args.handler == "bytes" else make_worker_handler()
    server.register("bench/w/gen", handler)
    address = await server.start()
    client = make_client(kind, nats=conn)
    broker = nats_proc if kind == "nats" else None
    result: dict[str, Any] = {"kind": kind}
    try:
        # warm-up: connections, subscriptions
        await run_streams(client, address, 4, 100, args.handler)
        for streams in args.streams:
            wall0, cpu0, broker0 = time.perf_counter(), time.process_time(), _cpu(broker)
            total = await run_streams(client, address, streams, args.tokens, args.handler)
            wall = time.perf_counter() - wall0
            cpu = time.process_time() - cpu0
            result[f"stream_x{streams}"] = {
                "tokens": total,
                "wall_us_per_token": wall / total * 1e6,
                "cpu_us_per_token": cpu / total * 1e6,
                "nats_server_cpu_us_per_token": (_cpu(broker) - broker0) / total * 1e6,
                "tokens_per_s": total / wall,
            }
        wall0, cpu0 = time.perf_counter(), time.process_time()
        await run_short(
            client, address, args.requests, args.short_tokens, args.concurrency, args.handler
        )
        wall = time.perf_counter() - wall0
        result["short"] = {
            "requests": args.requests,
            "tokens_each": args.short_tokens,
            "concurrency": args.concurrency,
            "requests_per_s": args.requests / wall,
            "cpu_us_per_request": (time.process_time() - cpu0) / args.requests * 1e6,
        }
    finally:
        await client.close()
        await server.stop(drain_timeout=0)
        if conn is not None:
            await conn.close()
    return result


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="tcp,nats,local")
    parser.add_argument("--streams", default="1,32", help="concurrent streams, comma separated")
    parser.add_argument("--tokens", type=int, default=5000, help="items per stream")
    parser.add_argument("--size", type=int, default=16, help="bytes per item")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--short-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--handler",
        choices=["bytes", "worker"],
        default="bytes",
        help="bytes: a handler yielding ready items; worker: the worker's generate handler",
    )
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    if args.output is None:
        suffix = "" if args.handler == "bytes" else "_worker"
        args.output = RESULTS / f"request_plane{suffix}.json"
    args.streams = [int(s) for s in args.streams.split(",")]
    kinds = args.kinds.split(",")

    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        nats_url: str | None = None
        nats_proc: psutil.Process | None = None
        if "nats" in kinds:
            nats = stack.enter_context(NatsServerProcess())
            assert nats.process is not None
            nats_url, nats_proc = nats.url, psutil.Process(nats.process.pid)
        runs = [await measure(kind, args, nats_url, nats_proc) for kind in kinds]
    report = {
        "benchmark": "request_plane",
        "handler": args.handler,
        "tokens_per_stream": args.tokens,
        "item_bytes": args.size,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")

    head = (
        f"{'kind':>6} {'streams':>7} {'wall µs/tok':>12} {'cpu µs/tok':>11} {'broker µs/tok':>14}"
    )
    print(head + f" {'tok/s':>10}")
    for run in runs:
        for streams in args.streams:
            r = run[f"stream_x{streams}"]
            print(
                f"{run['kind']:>6} {streams:>7} {r['wall_us_per_token']:>12.2f} "
                f"{r['cpu_us_per_token']:>11.2f} {r['nats_server_cpu_us_per_token']:>14.2f} "
                f"{r['tokens_per_s']:>10,.0f}"
            )
    print(f"\n{'kind':>6} {'short req/s':>12} {'cpu µs/req':>11}  ({args.short_tokens} items each)")
    for run in runs:
        s = run["short"]
        print(f"{run['kind']:>6} {s['requests_per_s']:>12,.0f} {s['cpu_us_per_request']:>11.1f}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    asyncio.run(main())
