"""``--system-port``: the system endpoint of ``turnout worker`` and ``turnout attach`` (``/live``,
``/health``, ``/metrics``) on real sockets: in process, against a real worker on the memory
store, and in real processes (a mocker worker behind a frontend; ``attach`` in front of a
``mocker-server`` that comes, and goes)."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.integration.procs import ProcessSet, wait_until
from tests.polling import eventually
from tests.servers.process import free_port

from turnout import __version__
from turnout.cli.main import main
from turnout.cli.system_port import EngineCollector, WorkerHealth, system_server, worker_engines
from turnout.engines.echo import EchoEngine
from turnout.engines.worker import Worker
from turnout.errors import ConfigError
from turnout.protocols.model import EndpointId
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.discovery.memory import MemoryStore
from turnout.runtime.system_server import SystemServer

ENDPOINT = EndpointId(namespace="t", component="backend", name="generate")
PROCESS_METRICS = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_open_fds",
    "process_start_time_seconds",
)


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> (labels, value) of a Prometheus text exposition, read by
    ``prometheus_client``'s own parser (which fails on a malformed line)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def assert_build_and_process(text: str, component: str) -> dict[str, Any]:
    found = samples(text)
    build = found["turnout_build_info"]
    assert len(build) == 1
    labels, value = build[0]
    assert value == 1
    assert labels["version"] == __version__ and labels["component"] == component
    assert re.fullmatch(r"3\.\d+\.\d+", labels["python"]), labels
    for name in PROCESS_METRICS:
        assert found[name][0][1] > 0, name
    return found


# ---------------------------------------------------------------- the server


@pytest.fixture
async def checked() -> AsyncIterator[tuple[SystemServer, dict[str, str | None]]]:
    """A system server whose readiness is a dict the test edits."""
    parts: dict[str, str | None] = {"discovery": "not registered yet", "engine": None}
    server = SystemServer("127.0.0.1", 0, component="worker", checks=lambda: dict(parts))
    await server.start()
    try:
        yield server, parts
    finally:
        server.stop()


async def test_health_names_the_part_not_ready_and_goes_503_when_draining(
    checked: tuple[SystemServer, dict[str, str | None]],
) -> None:
    server, parts = checked
    async with httpx.AsyncClient(base_url=server.address, timeout=10) as client:
        live = await client.get("/live")
        assert (live.status_code, live.json()) == (200, {"status": "live"})
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json() == {
            "status": "not_ready",
            "checks": {"discovery": "not registered yet", "engine": "ok"},
        }
        parts["discovery"] = None
        health = await client.get("/health")
        assert health.status_code == 200
        assert health.json() == {"status": "ready", "checks": {"discovery": "ok", "engine": "ok"}}
        server.drain()
        health = await client.get("/health")
        assert (health.status_code, health.json()["status"]) == (503, "draining")
        assert (await client.get("/live")).status_code == 200


async def test_other_paths_and_methods_are_refused_and_requests_are_bounded(
    checked: tuple[SystemServer, dict[str, str | None]],
) -> None:
    server, _ = checked
    async with httpx.AsyncClient(base_url=server.address, timeout=10) as client:
        missing = await client.get("/v1/models")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "not_found"
        wrong = await client.post("/health", content=b"{}")
        assert wrong.status_code == 405
        assert wrong.headers["allow"] == "GET"
        assert wrong.json()["error"]["code"] == "method_not_allowed"
        huge = await client.get("/live", headers={"x-filler": "a" * 10_000})
        assert huge.status_code == 431
        assert (await client.get("/live")).status_code == 200


async def test_metrics_parse_and_hold_the_build_and_the_process(
    checked: tuple[SystemServer, dict[str, str | None]],
) -> None:
    server, _ = checked
    async with httpx.AsyncClient(base_url=server.address, timeout=10) as client:
        metrics = await client.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert_build_and_process(metrics.text, "worker")


async def test_a_check_that_raises_is_a_part_not_ready() -> None:
    def broken() -> dict[str, str | None]:
        raise RuntimeError("boom")

    server = SystemServer("127.0.0.1", 0, component="worker", checks=broken)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.address, timeout=10) as client:
            health = await client.get("/health")
        assert health.status_code == 503
        assert "boom" in health.json()["checks"]["checks"]
    finally:
        server.stop()


def test_a_port_out_of_range_is_a_config_error() -> None:
    args = argparse.Namespace(system_port=70000, system_host="127.0.0.1")
    with pytest.raises(ConfigError, match="0-65535"):
        system_server(args, "worker", dict, [], dict)


async def test_a_port_taken_is_a_config_error(
    checked: tuple[SystemServer, dict[str, str | None]],
) -> None:
    taken = int(checked[0].address.rsplit(":", 1)[1])
    other = SystemServer("127.0.0.1", taken, component="worker", checks=dict)
    with pytest.raises(ConfigError, match="--system-port: cannot listen"):
        await other.start()


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"turnout {__version__}\n"


# ---------------------------------------------------------------- a real worker, in process


class ProbedEngine(EchoEngine):
    """Echo, whose health probe says what the test sets."""

    unhealthy: str | None = None

    def health(self) -> str | None:
        return self.unhealthy or super().health()


async def test_a_worker_is_ready_once_registered_and_while_its_engine_answers(
    gguf_path: str,
) -> None:
    runtime = await DistributedRuntime.create(
        store=MemoryStore(), request_plane="tcp", lease_ttl=30.0
    )
    workers: list[Worker] = []
    health = WorkerHealth(workers, 1)
    server = SystemServer("127.0.0.1", 0, component="worker", checks=health.checks,
                          collectors=[EngineCollector(worker_engines(workers))],
                          details=health.details)  # fmt: skip
    await server.start()
    engine = ProbedEngine(gguf_path)
    try:
        async with httpx.AsyncClient(base_url=server.address, timeout=10) as client:

            async def health_now() -> tuple[int, dict[str, Any]]:
                answer = await client.get("/health")
                return answer.status_code, answer.json()

            status, body = await health_now()
            assert status == 503
            assert body["checks"]["engine"] == "not started yet"
            worker = Worker(runtime, engine, ENDPOINT, health_interval=0)
            workers.append(worker)
            status, body = await health_now()
            assert (status, body["checks"]["discovery"]) == (503, "not registered yet")

            serving = await worker.start()
            status, body = await health_now()
            assert status == 200, body
            assert body["instances"] == [f"{serving.instance_id:x}"]
            up = samples((await client.get("/metrics")).text)["turnout_worker_up"]
            assert up == [({"worker": f"{serving.instance_id:x}"}, 1.0)]

            engine.unhealthy = "the step loop is stuck"
            status, body = await health_now()
            assert (status, body["checks"]["engine"]) == (503, "the step loop is stuck")
            engine.unhealthy = None

            engine.report_failure("the loop died")
            status, body = await health_now()
            assert (status, body["checks"]["engine"]) == (503, "engine failed: the loop died")
            await eventually(lambda: worker.failed.is_set(), what="the instance left")
            status, body = await health_now()
            assert status == 503
    finally:
        server.stop()
        for worker in workers:
            await worker.stop(0)
        await runtime.shutdown()


class GatedStore(MemoryStore):
    """A memory store whose lease grants wait while ``grants`` is clear."""

    def __init__(self) -> None:
        super().__init__()
        self.grants = asyncio.Event()
        self.grants.set()

    async def grant_lease(self, ttl: float) -> int:
        await self.grants.wait()
        return await super().grant_lease(ttl)


async def test_a_worker_whose_lease_ended_is_not_ready_until_registered_again(
    gguf_path: str,
) -> None:
    store = GatedStore()
    runtime = await DistributedRuntime.create(store=store, request_plane="tcp", lease_ttl=1.5)
    worker = Worker(runtime, EchoEngine(gguf_path), ENDPOINT, health_interval=0)
    health = WorkerHealth([worker], 1)
    try:
        serving = await worker.start()
        first = serving.instance_id
        assert health.checks() == {"discovery": None, "engine": None}
        store.grants.clear()
        await store.revoke_lease(first)  # as etcd rebuilt empty would answer
        await eventually(lambda: health.checks()["discovery"] is not None, what="not ready")
        assert f"{first:x}" in (health.checks()["discovery"] or "")
        store.grants.set()
        await eventually(lambda: health.checks()["discovery"] is None, what="registered again")
        assert serving.instance_id != first
        assert health.details() == {"instances": [f"{serving.instance_id:x}"]}
    finally:
        await worker.stop(0)
        await runtime.shutdown()


# ---------------------------------------------------------------- real processes


def system_address(procs: ProcessSet, proc: subprocess.Popen[bytes], timeout: float = 60) -> str:
    """The system endpoint's address, as the process logs it at start."""
    found: list[str] = []

    def logged() -> bool:
        assert proc.poll() is None, f"the process exited\n{procs.logs()}"
        match = re.search(r"system endpoint at (http://\S+) ", procs.logs())
        if match:
            found.append(match.group(1))
        return bool(found)

    wait_until(logged, timeout, "the system endpoint's address", procs.logs)
    return found[0]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessSet]:
    ps = ProcessSet(tmp_path)
    yield ps
    ps.close()


@pytest.mark.slow
def test_a_worker_process_serves_probes_and_metrics_and_drains(procs: ProcessSet) -> None:
    """Ready once registered; the mocker's load in /metrics; on SIGTERM with a stream in
    flight, /health is 503 draining while /live still answers."""
    procs.frontend()
    worker = procs.worker("--engine", "mocker", "--model-name", "m", "--speedup-ratio", "0.05",
                          "--drain-timeout", "60", "--system-port", "0")  # fmt: skip
    system = system_address(procs, worker)
    wait_until(lambda: httpx.get(system + "/health", timeout=5).status_code == 200, 60,
               "the worker ready", procs.logs)  # fmt: skip
    body = httpx.get(system + "/health", timeout=5).json()
    assert body["status"] == "ready" and len(body["instances"]) == 1
    found = assert_build_and_process(httpx.get(system + "/metrics", timeout=5).text, "worker")
    (labels, blocks), *_ = found["turnout_worker_kv_blocks"]
    assert labels == {"worker": body["instances"][0], "dp_rank": "0"} and blocks == 16384

    wait_until(lambda: bool(httpx.get(procs.url + "/health", timeout=5).status_code == 200),
               60, "the frontend to see the worker", procs.logs)  # fmt: skip
    request = {"model": "m", "prompt": "hello", "max_tokens": 500, "stream": True}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", procs.url + "/v1/completions", json=request) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # in flight
        os.kill(worker.pid, signal.SIGTERM)
        wait_until(
                lambda: httpx.get(system + "/health", timeout=5).json()["status"] == "draining",
                30, "/health draining", procs.logs,
            )  # fmt: skip
        assert httpx.get(system + "/health", timeout=5).status_code == 503
        assert httpx.get(system + "/live", timeout=5).status_code == 200


@pytest.mark.slow
def test_attach_is_ready_only_while_its_server_answers(procs: ProcessSet) -> None:
    """503 before the server is up (waiting), 200 once attached, 503 again when it dies."""
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    attach = procs._spawn(["attach", *procs.common(), "--url", url, "--api", "openai",
                           "--model-name", "relayed", "--retry-interval", "0.2",
                           "--health-interval", "0.2", "--system-port", "0"],
                          "attach")  # fmt: skip
    system = system_address(procs, attach)
    assert httpx.get(system + "/live", timeout=5).status_code == 200
    wait_until(lambda: "waiting" in httpx.get(system + "/health", timeout=5).text, 30,
               "attach waiting for its server", procs.logs)  # fmt: skip
    waiting = httpx.get(system + "/health", timeout=5)
    assert waiting.status_code == 503
    assert waiting.json()["checks"]["discovery"] == f"{url}: not registered"

    server = procs._spawn(["mocker-server", "--api", "vllm", "--port", str(port),
                           "--speedup-ratio", "0"], "mocker-server")  # fmt: skip
    wait_until(lambda: httpx.get(system + "/health", timeout=5).status_code == 200, 60,
               "attach ready", procs.logs)  # fmt: skip
    ready = httpx.get(system + "/health", timeout=5).json()
    assert ready["servers"][0]["state"] == "serving" and ready["servers"][0]["instance"]
    found = assert_build_and_process(httpx.get(system + "/metrics", timeout=5).text, "attach")
    states = {labels["state"]: value for labels, value in found["turnout_attach_server_state"]}
    assert states["serving"] == 1 and states["waiting"] == 0
    assert found["turnout_attach_registrations_total"] == [({"url": url}, 1.0)]

    os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=10)
    wait_until(lambda: httpx.get(system + "/health", timeout=5).status_code == 503, 30,
               "attach not ready once its server died", procs.logs)  # fmt: skip
    assert "waiting" in httpx.get(system + "/health", timeout=5).json()["checks"]["engine"]
