"""Event plane throughput: messages per second for small payloads (default 200 bytes).

One publisher and one subscriber in this process (two planes, as two processes would have),
on one event loop, so the numbers are the cost of both ends together. Three measurements per
plane kind:

* ``publish``: ``publish`` calls per second alone (nobody reads; the transport drops), for
  ``nats`` until the last message is handed to the NATS client.
* ``windowed``: end to end with flow control: publish a window, wait until it has all
  arrived, repeat. Nothing is dropped; this is the sustainable delivered rate.
* ``flood``: publish everything as fast as possible, yielding to the loop every ``burst``
  messages, then count what arrived: delivered rate and drops when the publisher outruns
  the subscriber.

``nats`` runs through a nats-server this script starts on a free port (two connections, as two
processes would have); ``local`` is the floor. ``zmq-curve`` is ``zmq`` with plane credentials
(CurveZMQ: every message encrypted and authenticated), the two planes' certificates from a
throwaway CA; against ``zmq`` it is what CURVE costs per event. ``--repeat`` runs the kinds in
turn that many times (interleaved, so a shared machine's load falls on each alike).

Usage: ``python benchmarks/event_plane.py [--messages N] [--size BYTES]
[--kinds zmq,zmq-curve,nats,local] [--repeat N]``; writes ``benchmarks/results/event_plane.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.certs import TestCa
from tests.servers.nats import NatsServerProcess

from turnout.runtime.discovery.memory import MemoryStore
from turnout.runtime.event_plane import (
    EventPlane,
    EventPublisher,
    EventSubscription,
    make_event_plane,
)
from turnout.runtime.nats import NatsConnection, NatsOptions, connect_nats
from turnout.runtime.plane_tls import PlaneTls

TOPIC = "kv_events"
RESULTS = Path(__file__).parent / "results" / "event_plane.json"


async def join(pub: EventPublisher, sub: EventSubscription) -> None:
    """Probe until the subscriber receives (ZeroMQ's slow joiner), then drain to a fence."""
    while True:
        await pub.publish(TOPIC, b"probe")
        try:
            async with asyncio.timeout(0.05):
                await anext(sub)
                break
        except TimeoutError:
            pass
    await pub.publish(TOPIC, b"fence")
    async with asyncio.timeout(10):
        async for event in sub:
            if event.payload == b"fence":
                return


class Counter:
    """Counts what a subscription delivers, in its own task; wakes waiters at a target."""

    def __init__(self, sub: EventSubscription) -> None:
        self.count = 0
        self.target = 0
        self.reached = asyncio.Event()
        self.task = asyncio.create_task(self._run(sub))

    async def _run(self, sub: EventSubscription) -> None:
        async for _ in sub:
            self.count += 1
            if self.count >= self.target:
                self.reached.set()

    async def wait_for(self, target: int) -> None:
        self.target = target
        if self.count < target:
            self.reached.clear()
            await asyncio.wait_for(self.reached.wait(), 10)

    async def wait_idle(self, idle_s: float = 0.3) -> float:
        """Wait until nothing arrived for ``idle_s``; returns when the last one arrived."""
        last, last_t = self.count, time.perf_counter()
        while time.perf_counter() - last_t < idle_s:
            await asyncio.sleep(0.01)
            if self.count != last:
                last, last_t = self.count, time.perf_counter()
        return last_t


async def measure(
    kind: str, messages: int, size: int, window: int, burst: int, nats_url: str | None = None
) -> dict[str, Any]:
    store = MemoryStore()
    conns: list[NatsConnection] = []
    if kind == "local":
        pub_plane = sub_plane = make_event_plane("local", store)
    elif kind == "nats":
        assert nats_url is not None
        for _ in range(2):
            conns.append(await connect_nats(NatsOptions(servers=[nats_url])))
        pub_plane, sub_plane = (make_event_plane("nats", None, nats=conn) for conn in conns)
    elif kind == "zmq-curve":
        with tempfile.TemporaryDirectory() as tmp:
            ca = TestCa(Path(tmp))
            leaves = [ca.issue("publisher"), ca.issue("subscriber")]
            pub_plane, sub_plane = (
                make_event_plane("zmq", store, plane_tls=PlaneTls(leaf.ca, leaf.cert, leaf.key))
                for leaf in leaves
            )
    else:
        pub_plane, sub_plane = make_event_plane(kind, store), make_event_plane(kind, store)
    planes: list[EventPlane] = list({id(p): p for p in (pub_plane, sub_plane)}.values())
    payload = os.urandom(size)
    result: dict[str, Any] = {"kind": kind}
    try:
        pub = await pub_plane.publisher("bench", "worker")
        sub = await sub_plane.subscribe("bench", "worker", TOPIC, max_pending=max(window, burst))
        await join(pub, sub)

        # publish only: a second component nobody subscribes to
        lone = await pub_plane.publisher("bench", "nobody")
        # (yielding every ``burst`` like the flood run: the nats plane hands messages to its
        # client in a writer task; the time includes handing over the last one)
        t0 = time.perf_counter()
        for i in range(messages):
            await lone.publish(TOPIC, payload)
            if i % burst == burst - 1:
                await asyncio.sleep(0)
        flush = getattr(pub_plane, "flush", None)
        if flush is not None:
            await flush(timeout=30.0)
        result["publish_msgs_per_s"] = messages / (time.perf_counter() - t0)
        result["publish_dropped"] = getattr(pub_plane, "num_dropped", 0)
        await lone.close()

        counter = Counter(sub)

        # windowed: lossless end to end; CPU time counts every thread (libzmq's I/O threads,
        # which encrypt and decrypt with CURVE, included)
        t0, cpu0 = time.perf_counter(), time.process_time()
        sent = 0
        while sent < messages:
            n = min(window, messages - sent)
            for _ in range(n):
                await pub.publish(TOPIC, payload)
            sent += n
            await counter.wait_for(sent)
        elapsed = time.perf_counter() - t0
        result["windowed_cpu_us_per_msg"] = (time.process_time() - cpu0) / messages * 1e6
        assert sub.num_dropped == 0, "windowed run dropped messages"
        result["windowed_msgs_per_s"] = messages / elapsed
        result["windowed_mb_per_s"] = messages * size / elapsed / 1e6

        # flood: no flow control
        base = counter.count
        t0 = time.perf_counter()
        for i in range(messages):
            await pub.publish(TOPIC, payload)
            if i % burst == burst - 1:
                await asyncio.sleep(0)
        last_t = await counter.wait_idle()
        got = counter.count - base
        result["flood_delivered"] = got
        result["flood_delivered_msgs_per_s"] = got / (last_t - t0)
        result["flood_dropped_counted"] = sub.num_dropped
        result["flood_lost_in_transport"] = messages - got - sub.num_dropped
        await sub.close()
        await counter.task
    finally:
        for plane in planes:
            await plane.close()
        for conn in conns:
            await conn.close()
        await store.close()
    return result


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=200, help="payload bytes")
    parser.add_argument("--window", type=int, default=1000, help="windowed run: in flight")
    parser.add_argument("--burst", type=int, default=100, help="flood run: yield every N")
    parser.add_argument("--kinds", default="zmq,nats,local")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every kind, in turn")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()

    kinds = args.kinds.split(",")
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        nats_url = stack.enter_context(NatsServerProcess()).url if "nats" in kinds else None
        runs = [
            await measure(kind, args.messages, args.size, args.window, args.burst, nats_url)
            for _ in range(args.repeat)
            for kind in kinds
        ]
    report = {
        "benchmark": "event_plane",
        "messages": args.messages,
        "payload_bytes": args.size,
        "window": args.window,
        "burst": args.burst,
        "python": platform.python_version(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "cpus": os.cpu_count(),
        # the machine is shared: a high load average means the rates above are pessimistic
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    for run in runs:
        print(
            f"{run['kind']:>9}: publish {run['publish_msgs_per_s']:>10,.0f}/s  "
            f"windowed {run['windowed_msgs_per_s']:>10,.0f}/s "
            f"({run['windowed_cpu_us_per_msg']:.2f} us CPU/msg)  "
            f"flood {run['flood_delivered_msgs_per_s']:>10,.0f}/s "
            f"(dropped {run['flood_dropped_counted']}, lost in transport "
            f"{run['flood_lost_in_transport']})"
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    asyncio.run(main())
