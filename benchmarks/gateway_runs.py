"""One run of ``benchmarks/gateways.py``: fresh engines, one gateway, one replay, the figures.

``GATEWAYS`` names every gateway configuration the benchmark knows (the label is what the
output shows); ``start_gateway`` starts one in front of a ``Fleet`` and waits until it routes;
``run_gateway`` does a whole run on mocker-servers and returns its entry for the JSON.
"""

from __future__ import annotations

import asyncio
import functools
import re
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from benchmarks.gateway_fleet import Fleet, MockerFlags, Processes, wait_for
from benchmarks.gateway_replay import (
    COMPLETIONS,
    GENERATE,
    Dialect,
    Planned,
    completions_body,
    generate_body,
    replay,
    summarize,
)
from benchmarks.routing_quality import CellPlan, RequestResult
from benchmarks.traces import Trace

from benchmarks import gateway_peers as peers
from turnout.frontend.service import free_port

#: The served model name of every mocker-server (and of turnout's card).
MODEL_NAME = "gateway-bench"
#: What vLLM's router logs when its ``kv_aware`` index drops a KV event batch it cannot read.
VLLM_ROUTER_DECODE_ERROR = "kv_index decode batch"
#: A start that failed because a port picked free was taken before it was bound.
PORT_TAKEN = re.compile(r"address already in use|cannot bind|EADDRINUSE", re.IGNORECASE)
#: Colour codes some peers write to their logs even when not on a terminal.
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True, slots=True)
class GatewaySpec:
    """One gateway configuration."""

    label: str
    #: ``turnout``, or a peer's name (``benchmarks.gateway_peers.PEERS``).
    kind: str
    #: turnout's ``--router-mode``, or the peer's ``--policy``.
    policy: str
    #: Face of the mocker-servers in front of which it runs.
    face: str
    dialect: Dialect
    #: Whether the gateway subscribes to the engines' KV events.
    kv_events: bool = False
    #: The mocker-servers' KV-event encoding and hash type (vLLM face).
    encoding: str = "map"
    hash_type: str = "int"
    #: More ``turnout frontend`` flags.
    frontend_args: tuple[str, ...] = ()


def _specs() -> dict[str, GatewaySpec]:
    specs = [
        GatewaySpec("turnout kv", "turnout", "kv", "vllm", COMPLETIONS, kv_events=True),
        GatewaySpec(
            "turnout round-robin", "turnout", "round-robin", "vllm", COMPLETIONS, kv_events=True
        ),
        GatewaySpec(
            "turnout kv (sglang face)",
            "turnout",
            "kv",
            "sglang",
            COMPLETIONS,
            kv_events=True,
            encoding="array",
        ),
        GatewaySpec("smg cache_aware", "smg", "cache_aware", "sglang", GENERATE),
        GatewaySpec("smg round_robin", "smg", "round_robin", "sglang", GENERATE),
        GatewaySpec("vllm-router cache_aware", "vllm-router", "cache_aware", "vllm", COMPLETIONS),
        GatewaySpec("vllm-router round_robin", "vllm-router", "round_robin", "vllm", COMPLETIONS),
        # vLLM's router reads only 32-byte digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
        GatewaySpec(
            "vllm-router kv_aware",
            "vllm-router",
            "kv_aware",
            "vllm",
            COMPLETIONS,
            kv_events=True,
            hash_type="bytes",
        ),
    ]
    return {s.label: s for s in specs}


GATEWAYS = _specs()


@dataclass(frozen=True, slots=True)
class Gateway:
    """A started gateway: its URL, the processes whose CPU is its own, how it was started."""

    url: str
    process_names: tuple[str, ...]
    commands: tuple[tuple[str, ...], ...]


def _turnout_common(tmp: Path) -> list[str]:
    return [
        "--store",
        "file",
        "--store-path",
        str(tmp / "store.sqlite"),
        "--lease-ttl",
        "2",
        "--log-level",
        "warning",
    ]


def start_gateway(
    spec: GatewaySpec,
    fleet: Fleet,
    procs: Processes,
    *,
    model_name: str,
    attach_args: Sequence[str] = (),
    timeout: float = 90,
) -> Gateway | str:
    """Start ``spec`` in front of ``fleet``; the gateway once its routes answer, else why not."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if spec.kind == "turnout":
        frontend = [
            sys.executable,
            "-m",
            "turnout",
            "frontend",
            "--port",
            str(port),
            "--router-mode",
            spec.policy,
            *spec.frontend_args,
            *_turnout_common(procs.tmp),
        ]
        attach = [
            sys.executable,
            "-m",
            "turnout",
            "attach",
            "--api",
            fleet.face,
            "--model-name",
            model_name,
            *attach_args,
            *_turnout_common(procs.tmp),
        ]
        for u in fleet.urls:
            attach += ["--url", u]
        if spec.kv_events:
            for endpoint, replay_endpoint in zip(fleet.kv_events, fleet.kv_replay, strict=True):
                attach += ["--kv-events", endpoint, "--kv-events-replay", replay_endpoint]
        procs.spawn("frontend", frontend)
        procs.spawn("attach", attach)

        def ready() -> bool:
            models = httpx.get(url + "/health", timeout=2).json().get("models", [])
            return any(
                m["name"] == model_name and len(m["instances"]) == len(fleet.urls) for m in models
            )

        why = wait_for("turnout", ready, timeout, procs.dead)
        gateway = Gateway(url, ("frontend", "attach"), (tuple(frontend), tuple(attach)))
        return why or gateway
    metrics_port = free_port()
    if spec.kind == "smg":
        cmd = peers.smg_command(
            port=port, metrics_port=metrics_port, worker_urls=fleet.urls, policy=spec.policy
        )

        def ready() -> bool:
            workers = httpx.get(url + "/workers", timeout=2).json().get("workers", [])
            healthy = [w for w in workers if w.get("is_healthy") and w.get("status") == "ready"]
            return len(healthy) == len(fleet.urls)
    else:
        events = fleet.kv_events if spec.kv_events else []
        cmd = peers.vllm_router_command(
            port=port,
            metrics_port=metrics_port,
            worker_urls=fleet.urls,
            policy=spec.policy,
            kv_events=events,
            kv_replay=fleet.kv_replay if events else [],
            block_size=_fleet_block_size(fleet),
            model=model_name,
        )

        def ready() -> bool:
            return httpx.get(url + "/health", timeout=2).status_code == 200

    procs.spawn("gateway", cmd, env=peers.peer_env())
    why = wait_for(spec.kind, ready, timeout, procs.dead)
    return why or Gateway(url, ("gateway",), (tuple(cmd),))


def _fleet_block_size(fleet: Fleet) -> int:
    return fleet.block_size or 16


def retry_taken_ports(
    start: Callable[[], Gateway | str], fleet: Fleet, tries: int = 3
) -> Gateway | str:
    """``start()`` the engines and the gateway; when a process could not bind a port picked
    free a moment before (another process took it meanwhile, e.g. as an ephemeral port), stop
    everything and start again on new ports, up to ``tries`` times."""
    result = start()
    for _ in range(tries - 1):
        if not isinstance(result, str) or not PORT_TAKEN.search(result):
            break
        fleet.procs.stop()
        fleet.reset()
        result = start()
    return result


def warm_up(
    gateway: Gateway, dialect: Dialect, body: dict[str, Any], timeout: float = 60
) -> str | None:
    """One small request through the gateway, retried until it answers 200 (registration may
    lag its health); None, or the last failure."""
    body = {**body, "stream": False}
    body.pop("stream_options", None)
    deadline = time.monotonic() + timeout
    last = "no attempt"
    while time.monotonic() < deadline:
        try:
            resp = httpx.post(gateway.url + dialect.path, json=body, timeout=30)
            if resp.status_code == 200:
                return None
            last = f"HTTP {resp.status_code}: {resp.text[:300]}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    return f"warm-up request failed: {last}"


@dataclass(frozen=True, slots=True)
class RunSetup:
    """What every gateway's run of one trace shares."""

    trace: Trace
    plan: CellPlan
    flags: MockerFlags
    num_engines: int
    concurrency: int
    timeout_s: float


def trace_plan(trace: Trace, dialect: Dialect, model: str) -> list[Planned]:
    """The trace as replay items in ``dialect`` (a session's turn follows its previous one)."""
    make = generate_body if dialect is GENERATE else completions_body
    last: dict[str, int] = {}
    items: list[Planned] = []
    for i, request in enumerate(trace.requests):
        previous = last.get(request.session_id) if trace.has_sessions else None
        last[request.session_id] = i

        def body(request: Any = request) -> dict[str, Any]:
            return make(model, trace.prompt_tokens(request).tolist(), request.output_length)

        items.append(Planned(request.arrival_s, previous, body))
    return items


def run_gateway(spec: GatewaySpec, setup: RunSetup, tmp: Path) -> dict[str, Any]:
    """Fresh engines, ``spec`` in front, the trace replayed; the run's entry."""
    entry: dict[str, Any] = {
        "gateway": spec.label,
        "kind": spec.kind,
        "policy": spec.policy,
        "engine_face": spec.face,
        "request_api": spec.dialect.path,
    }
    procs = Processes(tmp)
    fleet = Fleet(procs, spec.face, block_size=setup.flags.block_size)
    try:
        started = time.perf_counter()

        def start() -> Gateway | str:
            why = fleet.start_mockers(
                setup.num_engines,
                setup.flags,
                model_name=MODEL_NAME,
                encoding=spec.encoding,
                hash_type=spec.hash_type,
            )
            if why is not None:
                return f"mocker-servers: {why}"
            return start_gateway(spec, fleet, procs, model_name=MODEL_NAME)

        gateway = retry_taken_ports(start, fleet)
        if isinstance(gateway, str):
            entry["skipped"] = gateway
            return entry
        entry["commands"] = [" ".join(c) for c in gateway.commands]
        make = generate_body if spec.dialect is GENERATE else completions_body
        # Two whole blocks of tokens no trace request holds (ids above the trace's range).
        probe = make(MODEL_NAME, list(range(45000, 45000 + 2 * setup.flags.block_size)), 2)
        why = warm_up(gateway, spec.dialect, probe)
        if why is not None:
            entry["skipped"] = why
            return entry
        if spec.kind == "vllm-router" and spec.kv_events:
            time.sleep(1.0)  # the warm-up's BlockStored reaches the router
            log = ANSI_ESCAPE.sub("", procs.log_text("gateway"))
            rejected = [line for line in log.splitlines() if VLLM_ROUTER_DECODE_ERROR in line]
            if rejected:
                entry["skipped"] = (
                    "vllm-router's kv_aware index drops the mocker-server's KV "
                    f"event batches: {rejected[0].strip()[-160:]}"
                )
                return entry
        entry["startup_s"] = round(time.perf_counter() - started, 2)
        print(
            f"[{spec.label}] up in {entry['startup_s']} s; replaying "
            f"{len(setup.trace.requests)} requests",
            flush=True,
        )
        items = trace_plan(setup.trace, spec.dialect, MODEL_NAME)
        deadline = setup.plan.wall_span_s * 4 + 120
        entry.update(
            measure(
                fleet,
                procs,
                gateway,
                len(items),
                functools.partial(
                    replay,
                    gateway.url,
                    spec.dialect,
                    items,
                    time_scale=setup.plan.time_scale,
                    concurrency=setup.concurrency,
                    timeout_s=setup.timeout_s,
                    deadline_s=deadline,
                ),
                speedup=setup.plan.speedup,
            )
        )
    finally:
        procs.stop()
    return entry


def measure(
    fleet: Fleet,
    procs: Processes,
    gateway: Gateway,
    num_requests: int,
    run: Callable[[], Coroutine[Any, Any, tuple[list[RequestResult], float]]],
    *,
    speedup: float,
    settle_s: float = 1.0,
    idle_s: float = 4.0,
) -> dict[str, Any]:
    """Run one replay and read every figure of it off the engines and the processes.

    The gateway's CPU is read over ``idle_s`` of quiet first, ``settle_s`` after the warm-up
    (its health checks and metric polls go on without traffic), so the entry has both the
    gross CPU per request and the CPU per request net of that idle rate. psutil reads CPU in
    10 ms ticks: the net figure of a short run is rough.
    """
    names = gateway.process_names
    time.sleep(settle_s)
    idle_before = procs.cpu_seconds(names)
    time.sleep(idle_s)
    idle = procs.cpu_seconds(names)
    idle_rate = {n: (idle[n] - idle_before[n]) / idle_s for n in names}
    before, engines_before = fleet.read_counters(), fleet.cpu_seconds()
    cpu_before, wall_before = procs.cpu_seconds(names), time.perf_counter()
    results, elapsed = asyncio.run(run())
    cpu_after, wall = procs.cpu_seconds(names), time.perf_counter() - wall_before
    engines_cpu = fleet.cpu_seconds() - engines_before
    counters = fleet.read_counters().minus(before)
    cpu = {n: cpu_after[n] - cpu_before[n] for n in names}
    gross = sum(cpu.values())
    net = gross - sum(idle_rate.values()) * wall
    share, spread = counters.cached_share, counters.spread
    n = max(1, num_requests)
    entry: dict[str, Any] = {
        "cached_share": round(share, 4) if share is not None else None,
        "prompt_tokens_engines": int(sum(counters.queries)),
        "cached_tokens_engines": int(sum(counters.hits)),
        "prompt_tokens_per_engine": [int(q) for q in counters.queries],
        "spread": round(spread, 3) if spread is not None else None,
        "gateway_cpu_s": round(gross, 3),
        "gateway_cpu_ms_per_request": round(1000 * gross / n, 3),
        "gateway_cpu_ms_per_request_net_of_idle": round(1000 * net / n, 3),
        "gateway_cpu_ms_per_request_by_process": {
            k: round(1000 * v / n, 3) for k, v in cpu.items()
        },
        "gateway_idle_cpu_per_s": {k: round(v, 4) for k, v in idle_rate.items()},
        "engines_cpu_s": round(engines_cpu, 2),
        "summary": summarize(results, elapsed, speedup),
    }
    if entry["summary"]["num_errors"]:
        entry["gateway_log_tail"] = procs.log_tail(names[0], 10)
    return entry
