"""``--system-port`` of ``turnout worker`` and ``turnout attach``: what ready means for each,
and the metrics each serves (the server itself is ``runtime.system_server``).

Ready means two parts, each named in ``/health``'s body when it is not:

* ``discovery``: every instance of the process is registered: its records written under a
  lease the store has not ended (a lost lease is "registering again" until the new one is
  written);
* ``engine``: every engine answers: started, not failed, and its own cheap health probe
  (``EngineBase.health``) passes; for ``attach``, the attached server answers its health
  checks (the server's state as ``AttachedServer`` tracks it).

Metrics are read from the engines at scrape time (nothing is counted on the request path):
for engines with schedulers (the mocker), each rank's load (requests running and waiting,
KV usage and blocks) and its loop's counters; for attached servers, their state, their
registrations and the requests relayed to them now.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from turnout.errors import ConfigError
from turnout.runtime.addresses import DEFAULT_HOST, is_wildcard
from turnout.runtime.identity import advertise_metrics, process_identity
from turnout.runtime.redact import redact_url
from turnout.runtime.serving import ServingInstance
from turnout.runtime.system_server import SystemServer

from .flags import add_flag

if TYPE_CHECKING:
    from turnout.engines.attach.server import AttachedServer
    from turnout.engines.base import EngineBase
    from turnout.engines.worker import Worker
    from turnout.runtime.component import DistributedRuntime


def add_system_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("system endpoint (probes and metrics)")
    add_flag(g, "--system-port", type=int,
             help="serve GET /live, /health (200 once registered in discovery with the engine "
                  "answering, else 503 naming the part that is not; 503 draining on SIGTERM) "
                  "and /metrics (the engine's and the process's metrics, build info) on this "
                  "port; 0: any free port, logged at start (default: off)")  # fmt: skip
    add_flag(g, "--system-host", default=DEFAULT_HOST,
             help="interface the system endpoint binds (0.0.0.0: all, e.g. for Kubernetes "
                  "probes)")  # fmt: skip


def system_server(
    args: argparse.Namespace,
    component: str,
    checks: Callable[[], dict[str, str | None]],
    collectors: Sequence[Collector],
    details: Callable[[], dict[str, Any]],
) -> SystemServer | None:
    """The system endpoint ``--system-port`` asks for (None: not asked)."""
    port = args.system_port
    if port is None:
        return None
    if not 0 <= port <= 65535:
        raise ConfigError(f"--system-port must be a port number (0-65535), got {port}")
    return SystemServer(args.system_host, port, component=component, checks=checks,
                        collectors=collectors, details=details)  # fmt: skip


def advertise_system_metrics(system: SystemServer | None, runtime: DistributedRuntime) -> None:
    """Name ``system``'s ``/metrics`` in the records this process writes (nothing without a
    system endpoint). A wildcard bind is named by the host the records give the process."""
    if system is None:
        return
    bound = urlsplit(system.address)
    host = bound.hostname or ""
    if is_wildcard(host):
        host = process_identity(runtime).host
    shown = f"[{host}]" if ":" in host else host
    advertise_metrics(f"http://{shown}:{bound.port}/metrics")


def registration_problem(serving: ServingInstance | None) -> str | None:
    """Why ``serving`` is not registered in discovery now (None: it is)."""
    if serving is None:
        return "not registered yet"
    lease = serving.lease
    if lease is None:
        return "not registered yet"
    if lease.lost.is_set():
        return f"instance {serving.instance_id:x} lost its lease; registering again"
    if lease.revoked:  # leaving, or between a lost lease and the next one
        return f"instance {serving.instance_id:x} is not registered (its lease was revoked)"
    return None


def engine_problem(engine: EngineBase) -> str | None:
    """Why ``engine`` does not answer (None: it does), from its cheap health probe."""
    try:
        return engine.health()
    except Exception as exc:  # a probe that raises is a failed probe (as the worker's)
        return f"health probe raised {exc!r}"


def _join(problems: list[str]) -> str | None:
    return "; ".join(problems) or None


class WorkerHealth:
    """Readiness of ``turnout worker``'s workers (``expected`` of them, appended to
    ``workers`` as they start)."""

    def __init__(self, workers: list[Worker], expected: int) -> None:
        self.workers = workers
        self.expected = expected

    def checks(self) -> dict[str, str | None]:
        discovery: list[str] = []
        engine: list[str] = []
        if len(self.workers) < self.expected:
            discovery.append(f"{len(self.workers)} of {self.expected} workers started")
        for worker in self.workers:
            if worker.failure is not None:
                engine.append(f"engine failed: {worker.failure}")
                continue
            problem = registration_problem(worker.serving)
            if problem is not None:
                discovery.append(problem)
            elif (reason := engine_problem(worker.engine)) is not None:
                engine.append(reason)
        if not self.workers:
            engine.append("not started yet")
        return {"discovery": _join(discovery), "engine": _join(engine)}

    def details(self) -> dict[str, Any]:
        return {"instances": [f"{w.serving.instance_id:x}" for w in self.workers if w.serving]}


def _worker_label(worker: Worker) -> str | None:
    return f"{worker.serving.instance_id:x}" if worker.serving is not None else None


class EngineCollector(Collector):
    """``turnout_worker_*``: each registered instance's engine, read at scrape time (see the
    module's docstring). ``instances()`` gives (instance id as hex, engine) pairs."""

    def __init__(self, instances: Callable[[], list[tuple[str, EngineBase]]]) -> None:
        self._instances = instances

    def collect(self) -> Iterator[Any]:
        labels = ["worker", "dp_rank"]
        up = GaugeMetricFamily(
            "turnout_worker_up", "1 while the instance's engine answers its health probe",
            labels=["worker"],
        )  # fmt: skip
        running = GaugeMetricFamily(
            "turnout_worker_requests_running", "Requests in the engine's batch", labels=labels
        )
        waiting = GaugeMetricFamily(
            "turnout_worker_requests_waiting", "Requests queued for the engine's batch",
            labels=labels,
        )  # fmt: skip
        kv_usage = GaugeMetricFamily(
            "turnout_worker_kv_usage", "Share of KV blocks in use (0 to 1)", labels=labels
        )
        kv_blocks = GaugeMetricFamily(
            "turnout_worker_kv_blocks", "KV blocks of the engine", labels=labels
        )
        prefill = GaugeMetricFamily(
            "turnout_worker_prefill_tokens", "Prompt tokens waiting to be prefilled",
            labels=labels,
        )  # fmt: skip
        steps = CounterMetricFamily(
            "turnout_worker_engine_steps", "Steps the engine's loop ran", labels=["worker"]
        )
        late = CounterMetricFamily(
            "turnout_worker_engine_late_seconds",
            "Seconds the engine's loop fell behind real time (simulated engines)",
            labels=["worker"],
        )
        for worker, engine in self._instances():
            up.add_metric([worker], 0 if engine_problem(engine) else 1)
            schedulers = getattr(engine, "get_schedulers", None)
            if schedulers is not None:
                for rank, scheduler in enumerate(schedulers()):
                    load = scheduler.get_load()
                    key = [worker, str(rank)]
                    running.add_metric(key, load.num_running)
                    waiting.add_metric(key, load.num_waiting)
                    kv_usage.add_metric(key, load.kv_usage)
                    kv_blocks.add_metric(key, load.total_kv_blocks)
                    prefill.add_metric(key, load.active_prefill_tokens)
            stats = getattr(engine, "get_stats", None)
            if stats is not None:
                totals = stats()
                steps.add_metric([worker], totals.num_steps)
                late.add_metric([worker], totals.late_s)
        yield from (up, running, waiting, kv_usage, kv_blocks, prefill, steps, late)


def worker_engines(workers: list[Worker]) -> Callable[[], list[tuple[str, EngineBase]]]:
    """``EngineCollector``'s instances: the registered ones of ``workers``."""

    def instances() -> list[tuple[str, EngineBase]]:
        return [(label, w.engine) for w in list(workers) if (label := _worker_label(w)) is not None]

    return instances


# ---------------------------------------------------------------- turnout attach


def _attached(server: AttachedServer) -> tuple[ServingInstance | None, EngineBase | None]:
    """The serving instance and engine of ``server`` while it is attached (tokens mode: a
    worker around the engine; text mode: the relay's own instance)."""
    instance = server.instance
    worker = getattr(instance, "worker", None)
    holder = worker if worker is not None else instance
    return getattr(holder, "serving", None), getattr(holder, "engine", None)


class AttachHealth:
    """Readiness of ``turnout attach``: every server (``expected`` of them, appended to
    ``servers`` once the store is open) attached, registered and answering."""

    def __init__(self, servers: list[AttachedServer], expected: int) -> None:
        self.servers = servers
        self.expected = expected

    def checks(self) -> dict[str, str | None]:
        from turnout.engines.attach.server import ServerState

        discovery: list[str] = []
        engine: list[str] = []
        if len(self.servers) < self.expected:
            discovery.append("not connected to the store yet")
            engine.append("not started yet")
        for server in self.servers:
            url = redact_url(server.url)
            if server.state is not ServerState.SERVING:
                engine.append(f"{url}: {server.state.value} ({server.reason or 'starting'})")
                discovery.append(f"{url}: not registered")
                continue
            serving, attached = _attached(server)
            problem = registration_problem(serving)
            if problem is not None:
                discovery.append(f"{url}: {problem}")
            if attached is not None and (reason := engine_problem(attached)) is not None:
                engine.append(f"{url}: {reason}")
        return {"discovery": _join(discovery), "engine": _join(engine)}

    def details(self) -> dict[str, Any]:
        return {
            "servers": [
                {"url": redact_url(s.url), "state": s.state.value,
                 "instance": f"{s.instance_id:x}" if s.instance_id is not None else None}
                for s in self.servers
            ]
        }  # fmt: skip


def attach_engines(servers: list[AttachedServer]) -> Callable[[], list[tuple[str, EngineBase]]]:
    """``EngineCollector``'s instances: the attached servers' engines now registered."""

    def instances() -> list[tuple[str, EngineBase]]:
        out = []
        for server in servers:
            serving, engine = _attached(server)
            if serving is not None and engine is not None:
                out.append((f"{serving.instance_id:x}", engine))
        return out

    return instances


class AttachCollector(Collector):
    """``turnout_attach_*``: each attached server's state, registrations and the requests
    relayed to it now (tokens mode)."""

    def __init__(self, servers: list[AttachedServer]) -> None:
        self._servers = servers

    def collect(self) -> Iterator[Any]:
        from turnout.engines.attach.server import ServerState

        state = GaugeMetricFamily(
            "turnout_attach_server_state", "1 for the state each attached server is in",
            labels=["url", "state"],
        )  # fmt: skip
        registrations = CounterMetricFamily(
            "turnout_attach_registrations",
            "Times each server was registered (the first time, and each return)",
            labels=["url"],
        )
        relayed = GaugeMetricFamily(
            "turnout_attach_requests_in_flight", "Requests relayed to the server now",
            labels=["url"],
        )  # fmt: skip
        for server in self._servers:
            url = redact_url(server.url)
            for each in ServerState:
                state.add_metric([url, each.value], 1 if server.state is each else 0)
            registrations.add_metric([url], server.registrations)
            worker = getattr(server.instance, "worker", None)
            if worker is not None:  # tokens mode: the engine relays each request
                relayed.add_metric([url], worker.engine.in_flight)
        yield from (state, registrations, relayed)
