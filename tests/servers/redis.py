"""``RedisServer``: a real ``redis-server`` for the tests (Debian's ``redis-server``), on a free
port of 127.0.0.1, with nothing written to disk (no snapshots, no append-only file)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from types import TracebackType

from tests.servers.process import ServerProcess, free_port

START_DEADLINE_SECONDS = 20.0


def redis_binary() -> str | None:
    return shutil.which("redis-server")


class RedisServer(ServerProcess):
    """One redis-server. ``start()`` waits (with a deadline) until it answers ``PING``."""

    def __init__(self) -> None:
        super().__init__()
        binary = redis_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian: redis-server)")
        self.binary = binary
        self.host = "127.0.0.1"
        self.port = free_port(self.host)
        self.folder = tempfile.mkdtemp(prefix="turnout-redis-")

    def url(self, db: int = 0) -> str:
        return f"redis://{self.host}:{self.port}/{db}"

    def start(self) -> RedisServer:
        assert self.process is None, "already running"
        args = [
            self.binary, "--bind", self.host, "--port", str(self.port),
            "--save", "", "--appendonly", "no", "--dir", self.folder,
            "--protected-mode", "no", "--loglevel", "warning",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_DEADLINE_SECONDS
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            try:
                with socket.create_connection((self.host, self.port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not start within {START_DEADLINE_SECONDS}s")
            time.sleep(0.02)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        self.remove()
