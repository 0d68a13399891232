"""``turnout planner``: sizes the worker pools to the load within TTFT and ITL targets
(``turnout.planner``), acting through a connector: ``local`` worker processes, Kubernetes
Deployments, or only a metric for an external autoscaler. Run one per deployment, or two: they
elect a leader in the discovery store and only it acts.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import socket
from typing import Any

from prometheus_client import Gauge

from turnout.errors import ConfigError
from turnout.planner.capacity import load_profile
from turnout.planner.connectors.base import POOLS, Connector
from turnout.planner.decide import Policy, PoolLimits
from turnout.planner.leader import Candidate, LeaderElection
from turnout.planner.observe import FrontendScraper
from turnout.planner.pools import PoolView
from turnout.planner.predict import PREDICTORS, LoadPredictor
from turnout.planner.service import Planner, PlannerMetrics, PlannerSettings
from turnout.protocols.model import EndpointId
from turnout.runtime.addresses import DEFAULT_HOST
from turnout.runtime.planes import open_runtime
from turnout.runtime.system_server import SystemServer

from .flags import add_flag, add_runtime_flags, planes_config
from .lifecycle import run_command, run_until_signal
from .serve import prefill_endpoint, worker_argv
from .worker import add_worker_flags

log = logging.getLogger("turnout.cli")

DEFAULT_PORT = 9400
DEFAULT_WINDOW = 6
DEFAULT_SEASON = 86400.0
CONNECTORS = ("local", "kubernetes", "metrics-only")
#: The ``--store``/plane flags a local worker takes from the planner (secrets go by the
#: environment, which the workers inherit, never on a command line).
_PLANE_FLAGS = (
    "store", "store_path", "store_endpoints", "store_ca_cert", "store_cert", "store_key",
    "store_user", "request_plane", "event_plane", "nats_url", "nats_user", "nats_ca_cert",
    "nats_cert", "nats_key", "bind_host", "advertise_host",
)  # fmt: skip
_SECRET_FLAGS = ("store_password", "nats_password", "nats_token")
_KUBERNETES_FLAGS = ("kube_namespace", "deployment", "kubeconfig")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "planner", help="scale the worker pools to the load within TTFT and ITL targets"
    )
    add_flag(p, "--connector", choices=CONNECTORS,
             help="how to act: start and stop local worker processes, patch Kubernetes "
                  "Deployments, or only export turnout_planner_desired_replicas")  # fmt: skip
    add_flag(p, "--dry-run", action="store_true", help="decide and explain, never act")
    add_flag(p, "--ttft-slo", type=float,
             help="time-to-first-token target, seconds, at --slo-percentile")  # fmt: skip
    add_flag(p, "--itl-slo", type=float,
             help="inter-token latency target, seconds, at --slo-percentile")  # fmt: skip
    add_flag(p, "--slo-percentile", default=90.0, type=float,
             help="percentile of the frontends' TTFT and ITL held to the targets")  # fmt: skip
    add_flag(p, "--interval", default=10.0, type=float, help="seconds between decisions")
    add_flag(p, "--predictor", default="moving-average", choices=PREDICTORS,
             help="forecast of the next interval's load: the trend line through the last "
                  "--predictor-window intervals, the value one --season ago, or the "
                  "last")  # fmt: skip
    add_flag(p, "--predictor-window", default=DEFAULT_WINDOW, type=int,
             help="intervals the trend line fits")  # fmt: skip
    add_flag(p, "--season", default=DEFAULT_SEASON, type=float,
             help="seconds of one season (seasonal-naive)")  # fmt: skip
    add_flag(p, "--min-replicas", default="1",
             help="least workers per pool: N, or pool=N,... (pools: aggregated, prefill, "
                  "decode)")  # fmt: skip
    add_flag(p, "--max-replicas", default="8", help="most workers per pool: N, or pool=N,...")
    add_flag(p, "--max-workers", type=int, help="most workers over all pools (budget)")
    add_flag(p, "--max-gpus", type=int, help="most GPUs over all pools (budget)")
    add_flag(p, "--gpus-per-worker", default="1", help="GPUs one worker takes: N, or pool=N,...")
    add_flag(p, "--up-cooldown", default=30.0, type=float,
             help="seconds after a pool grew before it grows again")  # fmt: skip
    add_flag(p, "--down-cooldown", default=60.0, type=float,
             help="seconds after a change before a pool shrinks")  # fmt: skip
    add_flag(p, "--scale-down-after", default=60.0, type=float,
             help="seconds the load must fit fewer workers before a pool shrinks")  # fmt: skip
    add_flag(p, "--down-utilization", default=0.7, type=float,
             help="a pool shrinks only if the smaller pool runs the load at this share of its "
                  "capacity (hysteresis)")  # fmt: skip
    add_flag(p, "--disaggregated", action="store_true",
             help="size a prefill and a decode pool (default: one aggregated pool)")  # fmt: skip
    add_flag(p, "--prefill-endpoint",
             help="the prefill workers' endpoint (default: the prefill component of "
                  "--endpoint's namespace)")  # fmt: skip
    add_flag(p, "--profile", metavar="FILE",
             help="one worker's prefill and decode tokens/s within the targets (JSON); "
                  "default: from the step times the workers report")  # fmt: skip
    add_flag(p, "--frontend-url", action="append", default=None,
             help="a frontend whose /metrics to read (repeat; default: every frontend in the "
                  "discovery store)")  # fmt: skip
    add_flag(p, "--frontend-api-key", secret=True,
             help="bearer key for the frontends' /metrics (when they require one)")  # fmt: skip
    add_flag(p, "--host", default=DEFAULT_HOST,
             help="interface of the planner's HTTP endpoint (/planner/decisions, /metrics, "
                  "/health, /live)")  # fmt: skip
    add_flag(p, "--port", default=DEFAULT_PORT, type=int,
             help="port of that endpoint (0: any free port)")  # fmt: skip
    g = p.add_argument_group("kubernetes connector")
    add_flag(g, "--kube-namespace", help="the Deployments' namespace (default: the pod's, or "
             "the kubeconfig context's)")  # fmt: skip
    add_flag(g, "--deployment", action="append", default=None, metavar="POOL=NAME",
             help="the Deployment that runs a pool's workers (repeat per pool)")  # fmt: skip
    add_flag(g, "--kubeconfig", help="kubeconfig file (default: in-cluster, else ~/.kube/config)")
    before = {action.dest for action in p._actions}
    add_worker_flags(p, engine_default="mocker")
    # The flags that only the local connector's workers take (``check_flags``).
    worker_only = {a.dest for a in p._actions} - before - {"endpoint", "engine_flag_defaults"}
    p.set_defaults(worker_flag_defaults={name: p.get_default(name) for name in worker_only})
    add_runtime_flags(p)
    p.set_defaults(run=run)


def per_pool(flag: str, text: str, pools: tuple[str, ...]) -> dict[str, int]:
    """``N`` (every pool) or ``pool=N,...`` (the others keep what ``N`` entries gave, else 1)."""
    values: dict[str, int] = {}
    default: int | None = None
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.rpartition("=")
        try:
            number = int(value)
        except ValueError:
            raise ConfigError(f"{flag}: {value!r} is not a whole number") from None
        if number < 0:
            raise ConfigError(f"{flag}: {number} is below 0")
        if not sep:
            default = number
        elif name not in POOLS:
            raise ConfigError(f"{flag}: unknown pool {name!r} (pools: {', '.join(POOLS)})")
        else:
            values[name] = number
    return {pool: values.get(pool, default if default is not None else 1) for pool in pools}


def _endpoint(flag: str, text: str) -> EndpointId:
    try:
        return EndpointId.parse(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def check_flags(args: argparse.Namespace) -> None:
    """Values in range, and no flag that the chosen connector would ignore."""
    for name in ("connector", "ttft_slo", "itl_slo"):
        if getattr(args, name) is None:
            raise ConfigError(f"--{name.replace('_', '-')} is required")
    for name in ("ttft_slo", "itl_slo", "interval"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be above 0, got {value}")
    if not 0 < args.slo_percentile < 100:
        raise ConfigError(f"--slo-percentile must be between 0 and 100, got {args.slo_percentile}")
    if not 0 < args.down_utilization <= 1:
        raise ConfigError(f"--down-utilization must be in (0, 1], got {args.down_utilization}")
    for name in ("up_cooldown", "down_cooldown", "scale_down_after", "season"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more")
    if args.predictor_window < 1:
        raise ConfigError("--predictor-window must be at least 1")
    for flag, default, predictor in (
        ("predictor_window", DEFAULT_WINDOW, "moving-average"),
        ("season", DEFAULT_SEASON, "seasonal-naive"),
    ):
        if getattr(args, flag) != default and args.predictor != predictor:
            raise ConfigError(
                f"--{flag.replace('_', '-')} is the {predictor} predictor's; this planner runs "
                f"--predictor {args.predictor}"
            )
    for name in ("max_workers", "max_gpus"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be a port number (0-65535), got {args.port}")
    if args.connector != "kubernetes":
        for name in _KUBERNETES_FLAGS:
            if getattr(args, name) is not None:
                raise ConfigError(
                    f"--{name.replace('_', '-')} is the kubernetes connector's; this planner "
                    f"runs --connector {args.connector}"
                )
    elif not args.deployment:
        raise ConfigError("--connector kubernetes needs --deployment POOL=NAME for each pool")
    if args.connector != "local":
        defaults = args.worker_flag_defaults
        changed = [n for n, d in defaults.items() if getattr(args, n, d) != d]
        if changed:
            flags = ", ".join("--" + n.replace("_", "-") for n in changed)
            raise ConfigError(
                f"{flags}: worker flags are for --connector local, which starts the workers; "
                f"this planner runs --connector {args.connector}"
            )


def _pools(args: argparse.Namespace) -> dict[str, EndpointId]:
    endpoint = _endpoint("--endpoint", args.endpoint)
    if not args.disaggregated:
        if args.prefill_endpoint:
            raise ConfigError("--prefill-endpoint needs --disaggregated")
        return {"aggregated": endpoint}
    prefill = args.prefill_endpoint or prefill_endpoint(args.endpoint)
    return {"prefill": _endpoint("--prefill-endpoint", prefill), "decode": endpoint}


def _worker_planes(args: argparse.Namespace) -> list[str]:
    argv: list[str] = []
    for name in _PLANE_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def _worker_env(args: argparse.Namespace) -> None:
    """Secrets reach the local workers through the environment they inherit."""
    for name in _SECRET_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            os.environ["TURNOUT_" + name.upper()] = value


def make_connector(
    args: argparse.Namespace, runtime: Any, endpoints: dict[str, EndpointId], desired: Gauge
) -> Connector:
    if args.connector == "local":
        from turnout.planner.connectors.local import LocalConnector

        planes = _worker_planes(args)
        _worker_env(args)
        store_path = args.store_path or ""

        def argv_for(pool: str) -> list[str]:
            return worker_argv(
                args, store_path, args.threads or 1,
                role="aggregated" if pool == "aggregated" else pool, count=1, planes=planes,
            )  # fmt: skip

        hosts = {socket.gethostname()}
        if args.advertise_host:
            hosts.add(args.advertise_host)
        return LocalConnector(
            runtime.store, endpoints, argv_for, hosts=hosts,
            stop_timeout=args.drain_timeout + 30.0,
        )  # fmt: skip
    if args.connector == "kubernetes":
        from turnout.planner.connectors.kubernetes import KubernetesConnector

        deployments: dict[str, str] = {}
        for entry in args.deployment:
            pool, sep, name = entry.partition("=")
            if not sep or pool not in endpoints or not name:
                raise ConfigError(
                    f"--deployment {entry!r}: say POOL=NAME for a pool of this planner "
                    f"({', '.join(endpoints)})"
                )
            deployments[pool] = name
        missing = [pool for pool in endpoints if pool not in deployments]
        if missing:
            raise ConfigError(f"--deployment: no Deployment named for pool {', '.join(missing)}")
        return KubernetesConnector(
            deployments, namespace=args.kube_namespace, kubeconfig=args.kubeconfig
        )
    from turnout.planner.connectors.metrics_only import MetricsOnlyConnector

    return MetricsOnlyConnector(desired)


async def run_planner(args: argparse.Namespace) -> None:
    check_flags(args)
    endpoints = _pools(args)
    pools = tuple(endpoints)
    mins = per_pool("--min-replicas", args.min_replicas, pools)
    maxes = per_pool("--max-replicas", args.max_replicas, pools)
    gpus = per_pool("--gpus-per-worker", args.gpus_per_worker, pools)
    limits: dict[str, PoolLimits] = {}
    for pool in pools:
        if maxes[pool] < max(mins[pool], 1):
            raise ConfigError(
                f"--max-replicas {maxes[pool]} of pool {pool} is below its --min-replicas "
                f"{mins[pool]} (or 1)"
            )
        limits[pool] = PoolLimits(mins[pool], maxes[pool], max(gpus[pool], 1))
    profile = load_profile(args.profile) if args.profile else {}
    policy = Policy(
        ttft_slo=args.ttft_slo, itl_slo=args.itl_slo, up_cooldown=args.up_cooldown,
        down_cooldown=args.down_cooldown, scale_down_after=args.scale_down_after,
        down_utilization=args.down_utilization, max_workers=args.max_workers,
        max_gpus=args.max_gpus, queue_horizon=args.interval,
    )  # fmt: skip
    settings = PlannerSettings(
        interval=args.interval, percentile=args.slo_percentile, policy=policy, limits=limits,
        dry_run=bool(args.dry_run), profile=profile,
    )  # fmt: skip
    season = max(1, round(args.season / args.interval))
    runtime = await open_runtime(planes_config(args))
    connector: Connector | None = None
    views = {pool: PoolView(pool, endpoint, runtime.store) for pool, endpoint in endpoints.items()}
    scraper = FrontendScraper(
        runtime.store, urls=args.frontend_url or [], api_key=args.frontend_api_key
    )
    namespace = next(iter(endpoints.values())).namespace
    planner: Planner | None = None
    task: asyncio.Task[None] | None = None
    election: LeaderElection | None = None

    def report() -> dict[str, Any]:
        return planner.report() if planner is not None else {"decisions": []}

    def checks() -> dict[str, str | None]:
        if election is None:
            return {"election": "not started"}
        return {"election": None if election.leader is not None else "no leader known"}

    server = SystemServer(
        args.host, args.port, component="planner", checks=checks,
        details=lambda: {"leader": bool(election and election.leading)},
        routes={"/planner/decisions": report},
    )  # fmt: skip
    metrics = PlannerMetrics(server.registry)

    async def start() -> None:
        nonlocal connector, planner, task, election
        connector = make_connector(args, runtime, endpoints, metrics.desired)
        await connector.start()
        await server.start()
        election = LeaderElection(
            runtime.store, namespace,
            Candidate(host=socket.gethostname(), pid=os.getpid(), url=server.address),
            ttl=args.lease_ttl,
        )  # fmt: skip
        await election.start()
        for view in views.values():
            view.start(runtime.event_plane)
        planner = Planner(
            settings, scraper=scraper, pools=views, connector=connector, election=election,
            predictor=LoadPredictor(args.predictor, window=args.predictor_window, season=season),
            metrics=metrics,
        )  # fmt: skip
        task = asyncio.create_task(planner.run(), name="planner")
        log.info(
            "planning %s with the %s connector%s: ttft %gs, itl %gs at p%g, every %gs",
            ", ".join(f"{p} ({e.path()})" for p, e in endpoints.items()), args.connector,
            " (dry run)" if args.dry_run else "", args.ttft_slo, args.itl_slo,
            args.slo_percentile, args.interval,
        )  # fmt: skip

    async def stop() -> None:
        try:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            last = False
            if election is not None:
                was_leading = election.leading
                try:
                    last = was_leading and await election.others() == 0
                except Exception:
                    last = False
                await election.stop()
            if connector is not None:
                if last and args.connector == "local":
                    log.info("the last planner of this deployment: stopping its workers")
                await connector.close(stop_workers=last and args.connector == "local")
            for view in views.values():
                await view.close()
            await scraper.close()
            server.stop()
        finally:
            await runtime.shutdown()

    async def forever() -> None:
        await asyncio.Event().wait()

    await run_until_signal(start, stop, forever)


def run(args: argparse.Namespace) -> int:
    return run_command(args, lambda: run_planner(args))
