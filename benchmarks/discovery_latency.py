"""Discovery latency per store: how fast a worker becomes routable, and how fast it stops being.

For each store (``file``, ``etcd``), a frontend runs in its own process (``--router-mode
direct``), and this process serves echo workers on the same store:

* ``join_new_model``: worker start (engine and card built, lease granted, instance record and
  card written) → the first request pinned to it (``nvext.backend_instance_id``) answered
  200, for a model the frontend does not know yet (it builds the model's pipeline: fetches
  and loads the tokenizer). ``..._after_registration`` counts from the end of the worker's
  registration: the store's and the frontend's share alone.
* ``join_existing_model``: the same for another instance of a model already served.
* ``leave_graceful``: ``stop()`` (lease revoked) → the instance gone from ``/health``.
* ``leave_lease_expiry``: a worker process killed with SIGKILL → gone from ``/health``; this
  is the lease TTL plus the store's expiry granularity plus the watch, and ``minus_ttl`` says
  how much is beyond the TTL.

Polling is every 2 ms, so figures below a few ms are at the polling granularity.

Usage::

    python benchmarks/discovery_latency.py                 # file and etcd, JSON to results/
    python benchmarks/discovery_latency.py --stores etcd --joins 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

try:
    from tests.servers.etcd import EtcdServer
except ImportError:
    EtcdServer = None  # type: ignore[assignment,misc]
from turnout.engines.echo import EchoEngine  # noqa: E402
from turnout.engines.worker import Worker  # noqa: E402
from turnout.frontend.service import free_port  # noqa: E402
from turnout.protocols.model import EndpointId  # noqa: E402
from turnout.runtime.planes import PlanesConfig, open_runtime  # noqa: E402
from turnout.runtime.progress import track  # noqa: E402

POLL_S = 0.002
ENDPOINT = EndpointId(namespace="bench", component="backend", name="generate")


async def instances(http: httpx.AsyncClient, model: str) -> list[str]:
    body = (await http.get("/health")).json()
    return next((m["instances"] for m in body["models"] if m["name"] == model), [])


async def until_routable(http: httpx.AsyncClient, model: str, instance_id: int) -> None:
    body = {"model": model, "prompt": "hi", "max_tokens": 1,
            "nvext": {"backend_instance_id": instance_id}}  # fmt: skip
    while (await http.post("/v1/completions", json=body)).status_code != 200:
        await asyncio.sleep(POLL_S)


async def until_gone(http: httpx.AsyncClient, model: str, instance_hex: str) -> None:
    while instance_hex in await instances(http, model):
        await asyncio.sleep(POLL_S)


async def join(runtime: Any, http: httpx.AsyncClient, model: str) -> tuple[Worker, float, float]:
    """(worker, start → routable, registered → routable) in seconds."""
    t0 = time.perf_counter()
    worker = Worker(runtime, EchoEngine(), ENDPOINT, model_name=model)
    serving = await worker.start()
    t1 = time.perf_counter()
    async with asyncio.timeout(60):
        await until_routable(http, model, serving.instance_id)
    t2 = time.perf_counter()
    return worker, t2 - t0, t2 - t1


async def measure_store(
    planes: PlanesConfig, url: str, joins: int, kills: int, cli_planes: list[str], tmp: Path
) -> dict[str, list[float]]:
    runtime = await open_runtime(planes)
    out: dict[str, list[float]] = {
        "join_new_model": [], "join_new_model_after_registration": [],
        "join_existing_model": [], "join_existing_model_after_registration": [],
        "leave_graceful": [], "leave_lease_expiry": [],
    }  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for i in range(joins):
                model = f"m{i}"
                anchor, took, routed = await join(runtime, http, model)
                out["join_new_model"].append(took)
                out["join_new_model_after_registration"].append(routed)
                other, took, routed = await join(runtime, http, model)
                out["join_existing_model"].append(took)
                out["join_existing_model_after_registration"].append(routed)
                for worker in (other, anchor):
                    assert worker.serving is not None
                    instance_hex = f"{worker.serving.instance_id:x}"
                    t0 = time.perf_counter()
                    await worker.stop()
                    async with asyncio.timeout(60):
                        await until_gone(http, model, instance_hex)
                    out["leave_graceful"].append(time.perf_counter() - t0)
            for i in range(kills):
                model = f"k{i}"
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "turnout", "worker", "--engine", "echo",
                    "--model-name", model, "--endpoint", ENDPOINT.path(), *cli_planes,
                    "--log-level", "warning", start_new_session=True,
                )  # fmt: skip
                async with asyncio.timeout(120):
                    while not (ids := await instances(http, model)):
                        await asyncio.sleep(0.05)
                t0 = time.perf_counter()
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                async with asyncio.timeout(60):
                    await until_gone(http, model, ids[0])
                out["leave_lease_expiry"].append(time.perf_counter() - t0)
    finally:
        await runtime.shutdown()
    return out


def summarize(samples: list[float], ttl: float | None = None) -> dict[str, float]:
    ms = sorted(1000 * s for s in samples)
    row = {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 2),
        "max_ms": round(ms[-1], 2),
        "mean_ms": round(statistics.fmean(ms), 2),
    }
    if ttl is not None:
        row["p50_minus_ttl_ms"] = round(row["p50_ms"] - 1000 * ttl, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--stores", nargs="+", default=["file", "etcd"])
    ap.add_argument("--joins", type=int, default=10, help="models joined and left per store")
    ap.add_argument("--kills", type=int, default=3, help="workers killed per store")
    ap.add_argument("--lease-ttl", type=float, default=2.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/discovery_latency.json"))
    args = ap.parse_args()
    results: dict[str, Any] = {"lease_ttl_s": args.lease_ttl, "poll_ms": POLL_S * 1000,
                               "stores": {}}  # fmt: skip
    for store in track(args.stores, "stores", label=str):
        tmp = Path(tempfile.mkdtemp(prefix="turnout-disc-"))
        etcd = EtcdServer(tmp / "etcd") if store == "etcd" else None
        if etcd is not None:
            etcd.start()
        try:
            cli = ["--store", store, "--lease-ttl", str(args.lease_ttl)]
            planes = PlanesConfig(store=store, lease_ttl=args.lease_ttl)
            if etcd is not None:
                cli += ["--store-endpoints", etcd.url]
                planes.store_options = {"endpoints": [etcd.url]}
            else:
                cli += ["--store-path", str(tmp / "store.sqlite")]
                planes.store_path = str(tmp / "store.sqlite")
            port = free_port()
            front = subprocess.Popen(
                [sys.executable, "-m", "turnout", "frontend", "--port", str(port),
                 "--router-mode", "direct", *cli, "--log-level", "warning"],
                start_new_session=True,
            )  # fmt: skip
            try:
                url = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + 60
                while True:
                    try:
                        httpx.get(url + "/live", timeout=1)
                        break
                    except httpx.HTTPError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.1)
                raw = asyncio.run(measure_store(planes, url, args.joins, args.kills, cli, tmp))
            finally:
                os.killpg(front.pid, signal.SIGKILL)
                front.wait()
        finally:
            if etcd is not None:
                etcd.stop()
        rows = {
            name: summarize(samples, args.lease_ttl if name == "leave_lease_expiry" else None)
            for name, samples in raw.items()
            if samples
        }
        results["stores"][store] = rows
        for name, row in rows.items():
            print(json.dumps({"store": store, "what": name, **row}), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
