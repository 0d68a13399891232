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

``--plane-tls`` adds ``tcp+tls``: the tcp plane under mutual TLS (``--plane-ca/--plane-cert/
--plane-key``; certificates from a throwaway CA made here), measured beside plain ``tcp`` in
the same rounds, and reports what TLS adds per streamed token (both ends' CPU: the server's
encryption and the client's decryption) and the ratio. ``--repeat`` runs that many rounds,
each kind once per round, interleaved, and reports each figure's median. ``--loop uvloop``
runs on uvloop, as turnout's processes do (its TLS is compiled; asyncio's is Python).

Usage: ``python benchmarks/request_plane.py [--kinds tcp,nats,local] [--handler worker]
[--plane-tls] [--repeat 5] [--loop uvloop]``; writes ``benchmarks/results/request_plane.json``
(``request_plane_worker.json``; ``request_plane_tls[_worker].json`` with ``--plane-tls``) and
prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import msgspec
from tests.certs import TestCa
from tests.servers.nats import NatsServerProcess

from turnout.engines.worker import Worker
from turnout.protocols.llm import FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import EndpointId, TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.nats import NatsConnection, NatsOptions, connect_nats
from turnout.runtime.plane_tls import PlaneTls
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


def plane_credentials(directory: Path) -> tuple[PlaneTls, PlaneTls]:
    """A worker's and a frontend's plane credentials from one throwaway CA."""
    ca = TestCa(directory)
    worker, frontend = ca.issue("worker"), ca.issue("frontend")
    return (
        PlaneTls(worker.ca, worker.cert, worker.key),
        PlaneTls(frontend.ca, frontend.cert, frontend.key),
    )


async def measure(
    kind: str,
    args: argparse.Namespace,
    nats_url: str | None,
    nats_proc: psutil.Process | None,
    tls: tuple[PlaneTls, PlaneTls] | None,
) -> dict[str, Any]:
    """One round of ``kind`` (``tcp+tls``: tcp with ``tls``, the server's and client's)."""
    plane, _, suffix = kind.partition("+")
    server_tls, client_tls = tls if suffix == "tls" and tls is not None else (None, None)
    conn: NatsConnection | None = None
    if plane == "nats":
        assert nats_url is not None
        conn = await connect_nats(NatsOptions(servers=[nats_url]))
    server = make_server(plane, nats=conn, plane_tls=server_tls)
    handler = make_handler(args.size) if args.handler == "bytes" else make_worker_handler()
    server.register("bench/w/gen", handler)
    address = await server.start()
    client = make_client(plane, nats=conn, plane_tls=client_tls)
    broker = nats_proc if plane == "nats" else None
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


def median_run(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one kind folded into one: each figure's median."""
    first = rounds[0]
    out: dict[str, Any] = {"kind": first["kind"], "rounds": len(rounds)}
    for key, value in first.items():
        if isinstance(value, dict):
            out[key] = {name: statistics.median(r[key][name] for r in rounds) for name in value}
    return out


def tls_cost(plain: dict[str, Any], tls: dict[str, Any], streams: list[int]) -> dict[str, Any]:
    """What mutual TLS adds to the tcp plane: CPU per streamed token and per short request,
    plain against TLS, and their ratio."""
    cost: dict[str, Any] = {}
    for n in streams:
        a = plain[f"stream_x{n}"]["cpu_us_per_token"]
        b = tls[f"stream_x{n}"]["cpu_us_per_token"]
        cost[f"stream_x{n}"] = {
            "plain_cpu_us_per_token": a,
            "tls_cpu_us_per_token": b,
            "added_cpu_us_per_token": b - a,
            "ratio": b / a,
        }
    a, b = plain["short"]["cpu_us_per_request"], tls["short"]["cpu_us_per_request"]
    cost["short"] = {
        "plain_cpu_us_per_request": a,
        "tls_cpu_us_per_request": b,
        "ratio": b / a,
    }
    return cost


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="tcp,nats,local")
    parser.add_argument(
        "--plane-tls",
        action="store_true",
        help="also measure tcp+tls (mutual TLS) right after tcp in every round",
    )
    parser.add_argument("--repeat", type=int, default=1, help="rounds, kinds interleaved")
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
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
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    kinds = args.kinds.split(",")
    if args.plane_tls and "tcp+tls" not in kinds:
        if "tcp" not in kinds:
            kinds.insert(0, "tcp")
        kinds.insert(kinds.index("tcp") + 1, "tcp+tls")
    if args.output is None:
        suffix = ("_tls" if "tcp+tls" in kinds else "") + (
            "" if args.handler == "bytes" else "_worker"
        )
        args.output = RESULTS / f"request_plane{suffix}.json"
    args.streams = [int(s) for s in args.streams.split(",")]

    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        nats_url: str | None = None
        nats_proc: psutil.Process | None = None
        if "nats" in kinds:
            nats = stack.enter_context(NatsServerProcess())
            assert nats.process is not None
            nats_url, nats_proc = nats.url, psutil.Process(nats.process.pid)
        certs = stack.enter_context(tempfile.TemporaryDirectory(prefix="turnout-bench-certs-"))
        tls = plane_credentials(Path(certs)) if "tcp+tls" in kinds else None
        rounds: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
        for _ in range(args.repeat):
            for kind in kinds:
                rounds[kind].append(await measure(kind, args, nats_url, nats_proc, tls))
    runs = [median_run(rounds[kind]) for kind in kinds]
    by_kind = {run["kind"]: run for run in runs}
    report: dict[str, Any] = {
        "benchmark": "request_plane",
        "loop": args.loop,
        "rounds": args.repeat,
        "handler": args.handler,
        "tokens_per_stream": args.tokens,
        "item_bytes": args.size,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
        "runs": runs,
    }
    if "tcp+tls" in by_kind and "tcp" in by_kind:
        report["plane_tls"] = tls_cost(by_kind["tcp"], by_kind["tcp+tls"], args.streams)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")

    head = (
        f"{'kind':>6} {'streams':>7} {'wall µs/tok':>12} {'cpu µs/tok':>11} {'broker µs/tok':>14}"
    )
    head = head.replace(f"{'kind':>6}", f"{'kind':>7}")
    print(head + f" {'tok/s':>10}")
    for run in runs:
        for streams in args.streams:
            r = run[f"stream_x{streams}"]
            print(
                f"{run['kind']:>7} {streams:>7} {r['wall_us_per_token']:>12.2f} "
                f"{r['cpu_us_per_token']:>11.2f} {r['nats_server_cpu_us_per_token']:>14.2f} "
                f"{r['tokens_per_s']:>10,.0f}"
            )
    print(f"\n{'kind':>7} {'short req/s':>12} {'cpu µs/req':>11}  ({args.short_tokens} items each)")
    for run in runs:
        s = run["short"]
        print(f"{run['kind']:>7} {s['requests_per_s']:>12,.0f} {s['cpu_us_per_request']:>11.1f}")
    if "plane_tls" in report:
        print(f"\nplane TLS ({args.loop}, median of {args.repeat}): cpu µs per streamed token")
        for n in args.streams:
            c = report["plane_tls"][f"stream_x{n}"]
            print(
                f"  {n:>3} streams: plain {c['plain_cpu_us_per_token']:.2f}, "
                f"tls {c['tls_cpu_us_per_token']:.2f}, +{c['added_cpu_us_per_token']:.2f} "
                f"(x{c['ratio']:.2f})"
            )
        c = report["plane_tls"]["short"]
        print(
            f"  short: plain {c['plain_cpu_us_per_request']:.1f}, "
            f"tls {c['tls_cpu_us_per_request']:.1f} µs/request (x{c['ratio']:.2f})"
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    arguments = parse_args()
    (uvloop.run if arguments.loop == "uvloop" else asyncio.run)(main(arguments))
