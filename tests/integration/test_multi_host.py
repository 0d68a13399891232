"""A deployment across hosts: etcd and NATS on one, the frontend on another, workers on two more.

The hosts are network namespaces where the machine allows it, else loopback addresses (see
``hosts.py``; the test prints which). Checked through every combination of request plane and
event plane over etcd: models appear, requests succeed streamed and not, KV routing sends a
repeated prefix back to the host that holds it, ``turnout status`` shows every instance with
its address and load. Then the faults: a worker host cut off mid-stream loses its instances
when their leases end, its streams migrate with no token lost, and when it comes back its
workers register again by themselves.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tests.integration.hosts import Hosts
from tests.integration.procs import health, wait_until
from tests.servers.etcd import EtcdServer
from tests.servers.nats import NatsServerProcess
from tests.servers.process import require

from turnout.frontend.service import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LEASE_TTL = "2"
HTTP_PORT = 8000


def _need(binary: str) -> None:
    require(binary)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    _need("etcd")
    _need("nats-server")
    tmp = tmp_path_factory.mktemp("hosts")
    hosts = Hosts(["fe", "w1", "w2", "svc"], tmp)
    print(f"multi-host test: hosts are {hosts.mode} ({hosts.hosts})")
    cluster = Cluster(hosts, tmp)
    try:
        cluster.start_services()
        yield cluster
    finally:
        hosts.close()
        cluster.etcd.stop()
        cluster.nats.stop()


class Cluster:
    """etcd and NATS on ``svc``; frontends and workers started per test on the other hosts."""

    def __init__(self, hosts: Hosts, tmp: Path) -> None:
        self.hosts = hosts
        self.tmp = tmp
        svc = hosts.address("svc")
        netns = hosts.mode == "netns"
        # In namespaces every host has its own ports; on shared loopback they must be free.
        self.etcd = EtcdServer(
            tmp / "etcd",
            svc,
            command_prefix=hosts["svc"].prefix(),
            ports=(2379, 2380) if netns else None,
        )
        self.nats = NatsServerProcess(
            svc,
            command_prefix=hosts["svc"].prefix(),
            port=4222 if netns else None,
            log_path=tmp / "nats.log",
        )
        self.http_port = HTTP_PORT if netns else free_port(hosts.address("fe"))
        self.etcd_url = self.etcd.url
        self.nats_url = self.nats.url
        self.url = f"http://{hosts.address('fe')}:{self.http_port}"
        self._runs = 0

    def start_services(self) -> None:
        self.etcd.start()
        self.nats.start()

    def new_namespace(self) -> str:
        """A namespace of its own for each run: leftovers of an earlier one never mix in."""
        self._runs += 1
        return f"run{self._runs}"

    def planes(self, request_plane: str, event_plane: str) -> list[str]:
        return ["--store", "etcd", "--store-endpoints", self.etcd_url,
                "--request-plane", request_plane, "--event-plane", event_plane,
                "--nats-url", self.nats_url, "--lease-ttl", LEASE_TTL]  # fmt: skip

    def address_flags(self, host: str, *, wildcard: bool = False) -> list[str]:
        """``wildcard``: bind 0.0.0.0 and let the worker find the address that routes to
        etcd (only meaningful with real interfaces: netns mode)."""
        if wildcard and self.hosts.mode == "netns":
            return ["--bind-host", "0.0.0.0"]
        address = self.hosts.address(host)
        return ["--bind-host", address, "--advertise-host", address]

    def turnout(self, host: str, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        return self.hosts.spawn(host, [sys.executable, "-m", "turnout", *argv], log)

    def frontend(self, ns: str, planes: list[str], *extra: str) -> None:
        self.turnout(
            "fe",
            ["frontend", "--host", self.hosts.address("fe"), "--port", str(self.http_port),
             "--namespace", ns, *planes, *self.address_flags("fe"), *extra],
            f"{ns}-frontend",
        )  # fmt: skip

    def worker(self, host: str, ns: str, planes: list[str], *extra: str, wildcard: bool = False):  # type: ignore[no-untyped-def]
        return self.turnout(
            host,
            ["worker", "--endpoint", f"{ns}/backend/generate", *planes,
             *self.address_flags(host, wildcard=wildcard), *extra],
            f"{ns}-worker-{host}",
        )  # fmt: skip

    def wait_models(self, want: dict[str, int], timeout: float = 120) -> None:
        wait_until(
            lambda: all(len(health(self.url).get(m, [])) == n for m, n in want.items()),
            timeout,
            f"models {want}",
            self.hosts.logs,
        )

    def stop_run(self) -> None:
        for host in ("fe", "w1", "w2"):
            self.hosts.restore(host)
            self.hosts.stop_processes(host)


def complete(url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "mock", "prompt": prompt, "max_tokens": 4, "ignore_eos": True,
              "nvext": {"extra_fields": ["worker_id", "routing"]}, **extra},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def prompt_of(seed: int, tokens: int = 512) -> list[int]:
    return [1000 + (seed * 7919 + i * 31) % 30000 for i in range(tokens)]


@pytest.mark.parametrize(
    ("request_plane", "event_plane"),
    [("tcp", "zmq"), ("tcp", "nats"), ("nats", "zmq"), ("nats", "nats")],
)
def test_requests_and_kv_routing_across_hosts(
    cluster: Cluster, request_plane: str, event_plane: str
) -> None:
    ns = cluster.new_namespace()
    planes = cluster.planes(request_plane, event_plane)
    try:
        cluster.frontend(ns, planes, "--router-mode", "kv")
        mocker = ["--engine", "mocker", "--model-name", "mock", "--block-size", "16"]
        cluster.worker("w1", ns, planes, *mocker, wildcard=True)
        cluster.worker("w2", ns, planes, *mocker)
        cluster.worker("w2", ns, planes, "--engine", "echo", "--model-name", "echo")
        cluster.wait_models({"mock": 2, "echo": 1})

        api = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
        chat = api.chat.completions.create(
            model="mock", messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
        assert chat.choices[0].finish_reason in ("length", "stop")
        assert chat.usage is not None and chat.usage.completion_tokens > 0
        pieces = [
            c.choices[0].text
            for c in api.completions.create(
                model="echo", prompt="one two three", max_tokens=3, stream=True
            )
            if c.choices
        ]
        assert "".join(pieces).strip().startswith("one")

        # KV routing across hosts: a prompt's second visit goes where its blocks are.
        homes = {seed: complete(cluster.url, prompt_of(seed))["nvext"]["worker_id"]
                 for seed in range(2)}  # fmt: skip

        def indexed_at_home(seed: int) -> bool:
            """The router credits the home worker with the prompt's first block: its KV
            events crossed the event plane. (The probe is that one block, a prefix of the
            prompt, so wherever it runs it cannot draw the prompt away from home.)"""
            probe = complete(cluster.url, prompt_of(seed)[:16], max_tokens=1)
            candidates = probe["nvext"]["routing"]["candidates"]
            return any(
                c["worker_id"] == homes[seed] and c["overlap_blocks"] >= 1 for c in candidates
            )

        for seed in range(2):
            wait_until(lambda s=seed: indexed_at_home(s), 30, f"prompt {seed}'s KV events",
                       cluster.hosts.logs)  # fmt: skip
        for seed in range(2):
            again = complete(cluster.url, prompt_of(seed)[:496] + [7] * 16)
            assert again["nvext"]["worker_id"] == homes[seed]
            assert again["nvext"]["routing"]["overlap_blocks"] >= 496 // 16

        status = subprocess.run(
            [*cluster.hosts["fe"].prefix(), sys.executable, "-m", "turnout", "status",
             "--json", "--load-wait", "2.5", *planes, "--log-level", "warning"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        doc = json.loads(status.stdout)
        space = doc["namespaces"][ns]
        assert set(space["models"]) == {"mock", "echo"}
        hosts_seen = {row["address"].rsplit(":", 1)[0] for row in space["instances"]}
        if request_plane == "tcp":  # nats addresses are subjects, not hosts
            assert hosts_seen == {cluster.hosts.address("w1"), cluster.hosts.address("w2")}
        assert any("load" in row for row in space["instances"]), space
    finally:
        cluster.stop_run()


def _stream(api: openai.OpenAI, results: list[Any], started: threading.Semaphore) -> None:
    try:
        stream = api.completions.create(
            model="echo", prompt="alpha beta gamma delta epsilon zeta eta theta",
            max_tokens=200, stream=True, stream_options={"include_usage": True},
            extra_body={"nvext": {"extra_fields": ["migrations"]}},
        )  # fmt: skip
        usage, reason = None, None
        for n, chunk in enumerate(stream, 1):
            if n == 5:
                started.release()
            for choice in chunk.choices:
                reason = choice.finish_reason or reason
            usage = chunk.usage or usage
        results.append((usage.completion_tokens if usage else None, reason))
    except Exception as exc:  # reported by the test, which sees every outcome
        results.append(exc)
        started.release()


@pytest.mark.parametrize(("request_plane", "event_plane"), [("tcp", "zmq"), ("nats", "nats")])
def test_a_cut_off_host_loses_its_instances_its_streams_migrate_and_it_comes_back(
    cluster: Cluster, request_plane: str, event_plane: str
) -> None:
    ns = cluster.new_namespace()
    planes = cluster.planes(request_plane, event_plane)
    echo = ["--engine", "echo", "--model-name", "echo", "--echo-delay-ms", "50"]
    try:
        cluster.frontend(ns, planes, "--migration-limit", "3")
        cluster.worker("w1", ns, planes, *echo)
        cluster.worker("w2", ns, planes, *echo)
        cluster.wait_models({"echo": 2})
        before = set(health(cluster.url)["echo"])

        api = openai.OpenAI(
            base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )
        results: list[Any] = []
        started = threading.Semaphore(0)
        threads = [threading.Thread(target=_stream, args=(api, results, started)) for _ in range(4)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=60), "streams did not start"
        cluster.hosts.cut("w2")
        # The cut host's instance leaves when its lease ends; the others stay.
        cluster.wait_models({"echo": 1}, timeout=30)
        for t in threads:
            t.join(timeout=120)
        assert results == [(200, "length")] * 4, (results, cluster.hosts.logs())
        metrics = httpx.get(cluster.url + "/metrics", timeout=5).text
        assert 'turnout_migrations_total{model="echo"}' in metrics

        cluster.hosts.restore("w2")
        # Its worker registers again by itself, under a new instance id.
        cluster.wait_models({"echo": 2}, timeout=60)
        after = set(health(cluster.url)["echo"])
        assert len(after - before) == 1
        # Discovery can announce it before its request plane is back (a NATS client
        # reconnects on its own schedule; until then the frontend sets it aside): within a
        # deadline, requests reach both hosts again.
        served: set[str] = set()
        deadline = time.monotonic() + 60
        while served != after:
            assert time.monotonic() < deadline, (served, after, cluster.hosts.logs())
            r = httpx.post(
                cluster.url + "/v1/completions",
                json={"model": "echo", "prompt": "a b", "max_tokens": 2,
                      "nvext": {"extra_fields": ["worker_id"]}},
                timeout=30,
            )  # fmt: skip
            assert r.status_code == 200, r.text
            served.add(r.json()["nvext"]["worker_id"])
            time.sleep(0.1)
    finally:
        cluster.stop_run()


def test_an_etcd_outage_costs_no_request_and_no_restart(cluster: Cluster) -> None:
    """etcd goes away for three lease TTLs and comes back: the frontend keeps routing from
    what it knew; the worker keeps trying its keep-alive, and etcd, which restores leases with
    a fresh TTL when it starts, either still holds the lease (nothing was lost: the worker
    keeps its id) or says it ended (the worker registers again by itself); no request fails,
    during the outage or after."""
    ns = cluster.new_namespace()
    planes = cluster.planes("tcp", "zmq")
    try:
        cluster.frontend(ns, planes)
        worker = cluster.worker("w1", ns, planes, "--engine", "echo", "--model-name", "echo")
        cluster.wait_models({"echo": 1})
        processes = [*cluster.hosts["fe"].procs, worker]

        def ask() -> None:
            r = httpx.post(
                cluster.url + "/v1/completions",
                json={"model": "echo", "prompt": "a b c", "max_tokens": 3},
                timeout=30,
            )
            assert r.status_code == 200, r.text

        cluster.etcd.stop()
        try:
            outage_end = time.monotonic() + 3 * float(LEASE_TTL)
            while time.monotonic() < outage_end:
                ask()
                time.sleep(0.2)
        finally:
            cluster.etcd.start()
        # One instance serves again (the same or a new one); requests never fail.
        deadline = time.monotonic() + 60
        while len(health(cluster.url).get("echo", [])) != 1:
            assert time.monotonic() < deadline, cluster.hosts.logs()
            ask()
            time.sleep(0.2)
        for _ in range(10):
            ask()
        assert len(health(cluster.url)["echo"]) == 1
        assert all(p.poll() is None for p in processes), "a process exited"
    finally:
        cluster.stop_run()
