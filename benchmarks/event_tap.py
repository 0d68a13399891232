"""Count the KV events and load reports workers publish, as one more subscriber of the planes.

Used by ``benchmarks/scale.py`` to report the event rates from the workers' side: a frontend
exports the KV events it applied, not the load reports it folded. The tap subscribes to the
``kv_events`` and ``load`` topics of one component and writes its counts as JSON to a file,
rewritten every ``--every`` seconds, until SIGINT or SIGTERM. It decodes no more than it
counts: a KV batch is read as a list of raw events, a load report not at all.

    python benchmarks/event_tap.py OUT.json --component turnout/backend <planes flags>

The planes flags are those of ``turnout worker`` (``--store etcd --store-endpoints ...``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from turnout.cli.flags import add_runtime_flags, planes_config  # noqa: E402
from turnout.protocols.kv import KV_EVENTS_TOPIC, LOAD_TOPIC  # noqa: E402
from turnout.runtime.event_plane import EventSubscription  # noqa: E402
from turnout.runtime.planes import open_runtime  # noqa: E402


class _RawBatch(msgspec.Struct):
    """A ``KvEventBatch`` whose events stay undecoded: only their number is wanted."""

    events: list[msgspec.Raw]


_decode_batch = msgspec.msgpack.Decoder(_RawBatch).decode


async def tap(args: argparse.Namespace) -> None:
    namespace, component = args.component.split("/")
    counts = {"kv_batches": 0, "kv_events": 0, "load_reports": 0, "dropped": 0}
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runtime = await open_runtime(planes_config(args))
    plane = runtime.event_plane
    kv_sub = await plane.subscribe(namespace, component, KV_EVENTS_TOPIC, max_pending=1 << 16)
    load_sub = await plane.subscribe(namespace, component, LOAD_TOPIC, max_pending=1 << 16)

    async def count_kv(sub: EventSubscription[Any]) -> None:
        async for event in sub:
            counts["kv_batches"] += 1
            with contextlib.suppress(msgspec.DecodeError):
                counts["kv_events"] += len(_decode_batch(event.payload).events)

    async def count_load(sub: EventSubscription[Any]) -> None:
        async for _ in sub:
            counts["load_reports"] += 1

    def write() -> None:
        counts["dropped"] = kv_sub.num_dropped + load_sub.num_dropped
        doc = {**counts, "at": time.monotonic()}
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(args.out)

    tasks = [asyncio.create_task(count_kv(kv_sub)), asyncio.create_task(count_load(load_sub))]
    try:
        while not stop.is_set():
            write()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.every)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        write()
        await kv_sub.close()
        await load_sub.close()
        await runtime.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--component", default="turnout/backend", help="namespace/component")
    p.add_argument("--every", type=float, default=0.5, help="seconds between writes")
    add_runtime_flags(p)
    asyncio.run(tap(p.parse_args()))


if __name__ == "__main__":
    main()
