"""``NatsServerProcess``: a real ``nats-server`` for the tests, on a free port of one address.

It starts in a few milliseconds, so tests that disrupt it (stop, kill, restart, pause) own one,
and the others share one per module. Readiness is the server's ``INFO`` line on a fresh TCP
connection, waited for with a deadline.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from tests.servers.process import ServerProcess, free_port

NATS_BINARY = "nats-server"
START_DEADLINE_SECONDS = 10.0


def nats_binary() -> str | None:
    """The path of ``nats-server``, or None when it is not installed."""
    return shutil.which(NATS_BINARY) or (
        "/usr/sbin/nats-server" if Path("/usr/sbin/nats-server").exists() else None
    )


def _stopped(task: Path) -> bool:
    """Whether the thread ``/proc/<pid>/task/<tid>`` is stopped (or gone)."""
    try:
        stat = (task / "stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "tT"


class NatsServerProcess(ServerProcess):
    """One nats-server. ``restart()`` brings it back on the same port, as after a crash."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        user: str | None = None,
        password: str | None = None,
        log_path: Path | None = None,
        command_prefix: Sequence[str] = (),
        port: int | None = None,
    ) -> None:
        """``command_prefix`` runs nats-server through another command (``ip netns exec NS``:
        on a test host of its own); ``port`` is then needed, since free ports cannot be
        probed from here."""
        super().__init__()
        binary = nats_binary()
        if binary is None:
            raise RuntimeError("nats-server is not installed (Debian: nats-server)")
        self.binary = binary
        self.host = host
        self.command_prefix = list(command_prefix)
        self.port = port or free_port(host)
        self.user = user
        self.password = password
        self.log_path = log_path

    @property
    def url(self) -> str:
        """The client URL, credentials included when the server has them."""
        auth = f"{self.user}:{self.password}@" if self.user else ""
        return f"nats://{auth}{self.host}:{self.port}"

    @property
    def plain_url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self) -> NatsServerProcess:
        assert self.process is None, "already running"
        args = [*self.command_prefix, self.binary, "-a", self.host, "-p", str(self.port)]
        if self.user:
            args += ["--user", self.user, "--pass", self.password or ""]
        out = self.log_path.open("ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            if self.log_path:
                out.close()  # type: ignore[union-attr]
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_DEADLINE_SECONDS
        assert self.process is not None
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}")
            try:
                with socket.create_connection((self.host, self.port), timeout=1) as sock:
                    if sock.recv(4) == b"INFO":
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"nats-server did not answer within {START_DEADLINE_SECONDS}s")
            time.sleep(0.01)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP) and return once it is frozen. The signal takes effect
        asynchronously: without the wait, a message sent right after ``pause`` may still be
        answered by a server thread that has not stopped yet."""
        super().pause()
        assert self.process is not None
        tasks = Path(f"/proc/{self.process.pid}/task")
        if not tasks.is_dir():
            time.sleep(0.05)  # no procfs: give the signal a moment
            return
        deadline = time.monotonic() + START_DEADLINE_SECONDS
        while not all(_stopped(task) for task in tasks.iterdir()):
            if time.monotonic() > deadline:
                raise RuntimeError("nats-server did not stop on SIGSTOP")
            time.sleep(0.001)

    def __enter__(self) -> NatsServerProcess:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.kill()
