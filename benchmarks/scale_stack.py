"""One deployment of the scale benchmark: services, frontends, mocker processes, each on its host.

``Stack`` starts, for one worker count and one plane set, a private etcd (and nats-server for
the NATS planes), ``frontends`` KV-routing frontends with replica sync, and the mocker worker
processes (``per_process`` instances each), and stops them all. In ``netns`` mode each worker
process runs on a "host" of its own: a network namespace joined to the benchmark's by a veth
pair on a private bridge (``tests/integration/hosts.py``); etcd, NATS and the frontends listen
on the bridge address. In ``loopback`` mode everything shares 127.0.0.1.

Also here, what the benchmark reads from the processes: ``/health`` instance counts, and the
Prometheus text of ``/metrics`` (counter sums, histogram quantiles).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src"), str(ROOT / "benchmarks")]

from tests.integration.hosts import Hosts  # noqa: E402
from tests.servers.etcd import EtcdServer  # noqa: E402
from tests.servers.nats import NatsServerProcess  # noqa: E402
from tests.servers.process import free_port  # noqa: E402

from process_groups import stop_process_groups  # noqa: E402

#: Plane sets the benchmark knows: store+request plane+event plane.
PLANE_SETS = ("etcd+tcp+zmq", "etcd+nats+nats")
MODEL = "mock"


@dataclass
class StackConfig:
    planes: str
    workers: int
    frontends: int = 2
    per_process: int = 128
    speedup: float = 100.0
    num_gpu_blocks: int = 2048
    hosts: str = "netns"  # or "loopback"
    frontend_flags: Sequence[str] = ()
    tap: bool = True
    log_level: str = "warning"


@dataclass
class Stack:
    """The processes of one run; ``close()`` stops them all (safe to call twice)."""

    config: StackConfig
    tmp: Path
    hosts: Hosts | None = None
    host_mode: str = "loopback"
    address: str = "127.0.0.1"
    etcd: EtcdServer | None = None
    nats: NatsServerProcess | None = None
    frontends: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    tap: subprocess.Popen[bytes] | None = None
    tap_path: Path | None = None
    common: list[str] = field(default_factory=list)

    def start_services(self) -> None:
        c = self.config
        processes = math.ceil(c.workers / c.per_process)
        if c.hosts == "netns":
            self.hosts = Hosts([f"w{i}" for i in range(processes)], self.tmp)
            self.host_mode = self.hosts.mode
            if self.hosts.mode == "netns":
                # The bridge's own address: the benchmark's side of every veth pair.
                self.address = self.hosts.address("w0").rsplit(".", 1)[0] + ".1"
        store, request_plane, event_plane = c.planes.split("+")
        self.etcd = EtcdServer(self.tmp / "etcd", self.address).start()
        self.common = ["--store", store, "--store-endpoints", self.etcd.url,
                       "--request-plane", request_plane, "--event-plane", event_plane,
                       "--log-level", c.log_level]  # fmt: skip
        if "nats" in (request_plane, event_plane):
            self.nats = NatsServerProcess(self.address, log_path=self.tmp / "nats.log").start()
            self.common += ["--nats-url", self.nats.url]

    def start_frontends(self) -> None:
        py = sys.executable
        for i in range(self.config.frontends):
            port = free_port("127.0.0.1")
            argv = [py, "-m", "turnout", "frontend", "--port", str(port), "--router-mode", "kv",
                    "--bind-host", self.address, "--advertise-host", self.address,
                    *self.common, *self.config.frontend_flags]  # fmt: skip
            with open(self.tmp / f"frontend{i}.log", "ab") as log:
                self.frontends.append(
                    subprocess.Popen(
                        argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
            self.ports.append(port)
        deadline = time.monotonic() + 60
        for port in self.ports:
            while health(port) is None:
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError("a frontend did not answer /health within 60 s")
                time.sleep(0.1)

    def start_tap(self) -> None:
        self.tap_path = self.tmp / "tap.json"
        argv = [sys.executable, str(ROOT / "benchmarks/event_tap.py"), str(self.tap_path),
                "--bind-host", self.address, *self.common]  # fmt: skip
        with open(self.tmp / "tap.log", "ab") as log:
            self.tap = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip

    def start_workers(self) -> None:
        c = self.config
        left = c.workers
        i = 0
        while left > 0:
            k = min(left, c.per_process)
            argv = [sys.executable, "-m", "turnout", "worker", "--engine", "mocker",
                    "--model-name", MODEL, "--num-workers", str(k),
                    "--speedup-ratio", str(c.speedup), "--num-gpu-blocks", str(c.num_gpu_blocks),
                    *self.common]  # fmt: skip
            if self.hosts is not None and self.hosts.mode == "netns":
                addr = self.hosts.address(f"w{i}")
                argv += ["--bind-host", addr, "--advertise-host", addr]
                self.workers.append(self.hosts.spawn(f"w{i}", argv, f"worker{i}"))
            else:
                with open(self.tmp / f"worker{i}.log", "ab") as log:
                    self.workers.append(
                        subprocess.Popen(
                            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                        )
                    )
            left -= k
            i += 1

    def wait_registered(self, timeout: float) -> float:
        """Seconds from now until every frontend lists all the instances."""
        t0 = time.monotonic()
        pending = list(self.ports)
        while pending:
            self.check_alive()
            pending = [p for p in pending if (health(p) or 0) < self.config.workers]
            if time.monotonic() - t0 > timeout:
                counts = [health(p) for p in self.ports]
                raise TimeoutError(f"instances seen by the frontends after {timeout}s: {counts}")
            if pending:
                time.sleep(0.2)
        return time.monotonic() - t0

    def check_alive(self) -> None:
        for i, proc in enumerate(self.frontends):
            if proc.poll() is not None:
                tail = (self.tmp / f"frontend{i}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"frontend {i} exited with {proc.returncode}: {tail}")

    def frontend_procs(self) -> list[psutil.Process]:
        return [psutil.Process(p.pid) for p in self.frontends]

    def worker_procs(self) -> list[psutil.Process]:
        procs: list[psutil.Process] = []
        for p in self.workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(p.pid)
                # Through ``ip netns exec``, the worker is the leader's child (exec'd in place
                # on recent iproute2; a child on older ones).
                procs.extend(proc.children(recursive=True) or [proc])
        return procs

    def tap_counts(self) -> dict[str, float]:
        if self.tap_path is None:
            return {}
        with contextlib.suppress(OSError, ValueError):
            return dict(json.loads(self.tap_path.read_text()))
        return {}

    def close(self) -> None:
        procs = [*self.frontends, *self.workers, *([self.tap] if self.tap else [])]
        stop_process_groups(procs, grace_s=10.0)
        if self.hosts is not None:
            self.hosts.close()
        if self.nats is not None:
            self.nats.stop()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd.remove_data()


def health(port: int) -> int | None:
    """Instances of the served model that the frontend on ``port`` lists; None if it does
    not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as exc:  # 503 until a model is served
        try:
            body = json.loads(exc.read())
        except ValueError:
            return 0
    except (OSError, ValueError):
        return None
    return max((len(m["instances"]) for m in body.get("models", [])), default=0)


def get_metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode(errors="replace")
    except OSError:
        return ""


def counter_sum(text: str, name: str) -> float:
    """Sum of every series of ``name`` (0 when absent)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def find_family(text: str, pattern: str) -> str | None:
    """The first histogram family whose name matches ``pattern`` (a regex)."""
    for m in re.finditer(r"^# TYPE (\S+) histogram$", text, re.M):
        if re.search(pattern, m.group(1)):
            return m.group(1)
    return None


def histogram_buckets(text: str, family: str) -> dict[float, float]:
    """Cumulative bucket counts of ``family``, summed over its label sets: {le: count}."""
    buckets: dict[float, float] = {}
    line = re.compile(
        rf'^{re.escape(family)}_bucket{{(?:[^}}]*,)?le="([^"]+)"[^}}]*}} (\S+)$', re.M
    )
    for le, value in line.findall(text):
        bound = math.inf if le == "+Inf" else float(le)
        buckets[bound] = buckets.get(bound, 0.0) + float(value)
    return buckets


def bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of cumulative ``buckets``, interpolated inside its bucket (as
    Prometheus' ``histogram_quantile``); ``inf`` when it lies past the last finite bound;
    None when empty."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return math.inf
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = bound, count
    return lower


def minus(after: dict[float, float], before: dict[float, float]) -> dict[float, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}
