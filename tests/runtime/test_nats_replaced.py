"""A NATS server replaced under the same address: every process recovers by itself.

A frontend and a worker (the mocker, which reports its load) run on NATS for both planes
(discovery in the file store). nats-server is killed and a fresh one (no state, a new server
id) started on the same port: the processes reconnect and subscribe again by themselves,
requests are served again (request plane), and the worker's load reports reach a new
subscriber (event plane), with a line per change of state in the logs, not a loop.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.procs import ProcessSet, health, wait_until
from tests.servers.nats import NatsServerProcess, nats_binary
from tests.servers.process import require

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsServerProcess]:
    require("nats-server", nats_binary() is not None)
    server = NatsServerProcess(log_path=tmp_path / "nats-server.log").start()
    try:
        yield server
    finally:
        server.kill()


def served(url: str) -> bool:
    """Whether one request is served now."""
    try:
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "mock", "prompt": "hi there", "max_tokens": 2},
            timeout=10,
        )
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def loads(procs: ProcessSet, planes: list[str]) -> list[Any]:
    """The load of each instance ``turnout status`` hears on the event plane."""
    done = subprocess.run(
        [sys.executable, "-m", "turnout", "status", "--json", "--load-wait", "2",
         *procs.common(), *planes],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return []
    namespaces = json.loads(done.stdout).get("namespaces", {}).values()
    return [row.get("load") for ns in namespaces for row in ns.get("instances", [])]


def test_processes_recover_when_nats_is_replaced(nats: NatsServerProcess, tmp_path: Path) -> None:
    procs = ProcessSet(tmp_path, lease_ttl=2.0)
    planes = ["--request-plane", "nats", "--event-plane", "nats", "--nats-url", nats.url]
    try:
        procs.frontend(*planes)
        procs.worker("--engine", "mocker", "--model-name", "mock", *planes)
        wait_until(lambda: len(health(procs.url).get("mock", [])) == 1, 60, "worker", procs.logs)
        assert served(procs.url)
        wait_until(lambda: any(loads(procs, planes)), 60, "a load report", procs.logs)

        nats.kill()
        nats.start()  # a fresh server: no subscriptions, a new server id, the same port

        wait_until(lambda: served(procs.url), 60, "a request served again", procs.logs)
        wait_until(lambda: any(loads(procs, planes)), 60, "load reports again", procs.logs)
        for _ in range(4):
            assert served(procs.url)
        logs = procs.logs()
        # A line per process and change of state, not a loop of warnings.
        assert logs.count("lost the NATS server") <= 2, logs
        assert logs.count("reconnected to NATS") <= 2, logs
    finally:
        procs.close()
