"""Start turnout's real processes for integration tests, and clean them up."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from turnout.frontend.service import free_port


@dataclass
class ProcessSet:
    """A frontend and workers sharing one file store; every process is killed at the end."""

    tmp: Path
    lease_ttl: float = 2.0
    port: int = field(default_factory=free_port)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    #: Store flags replacing the file store's (e.g. ``--store etcd --store-endpoints ...``),
    #: for stacks whose store is itself under test; None: the file store in ``tmp``.
    store_flags: list[str] | None = None

    @property
    def store_path(self) -> str:
        return str(self.tmp / "discovery.sqlite")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, args: Sequence[str], name: str) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"{name}-{len(self.procs)}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "turnout", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def common(self) -> list[str]:
        store = self.store_flags
        if store is None:
            store = ["--store", "file", "--store-path", self.store_path]
        return [*store, "--lease-ttl", str(self.lease_ttl)]

    def frontend(self, *extra: str) -> subprocess.Popen[bytes]:
        return self._spawn(
            ["frontend", "--port", str(self.port), *self.common(), *extra], "frontend"
        )

    def worker(self, *extra: str) -> subprocess.Popen[bytes]:
        return self._spawn(["worker", *self.common(), *extra], "worker")

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp.glob("*.log")
        )

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait(timeout=10)


def start_serve(tmp: Path, port: int, *args: str) -> subprocess.Popen[bytes]:
    """``turnout serve`` on ``port`` with a file store in ``tmp``; its output goes to
    ``tmp/serve.log``. Stop it with ``stop_serve``."""
    with open(tmp / "serve.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "turnout", "serve", "--port", str(port), *args,
             "--store-path", str(tmp / "store.sqlite")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


@contextlib.contextmanager
def running_serve(tmp: Path, *args: str, timeout: float = 90) -> Iterator[str]:
    """``turnout serve *args`` (``start_serve``) once its workers serve, as its URL; stopped
    on exit (``stop_serve``)."""
    port = free_port()
    proc = start_serve(tmp, port, *args)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: any(health(url).values()), timeout, "serve's workers")
        yield url
    finally:
        stop_serve(proc)


def stop_serve(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the serve tree, SIGKILL it if it lingers, then kill any worker left (workers
    run in sessions of their own)."""
    import psutil

    children = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for child in children:
        if child.is_running():
            child.kill()


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, logs: Callable[[], str] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(
        f"timed out after {timeout} s waiting for {what}\n{logs() if logs else ''}"
    )


def health(url: str) -> dict[str, list[str]]:
    """Model name -> live instance ids (hex), from the frontend's /health."""
    body = httpx.get(url + "/health", timeout=5).json()
    return {m["name"]: m["instances"] for m in body["models"]}
