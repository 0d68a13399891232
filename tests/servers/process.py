"""The lifecycle every test server process shares: stop, kill, restart, pause and resume."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from typing import Self

import psutil

#: Longest wait for a paused server to be reported stopped.
PAUSE_DEADLINE_SECONDS = 5.0


def free_port(host: str) -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """One server process; subclasses start it (``start``, which sets ``process``)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self._paused = False

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        """Stop cleanly (SIGTERM), waiting for the process to exit."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """Kill (SIGKILL), as a crash would."""
        self._end(signal.SIGKILL)

    def _end(self, sig: signal.Signals) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if self._paused:
            process.send_signal(signal.SIGCONT)
            self._paused = False
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def restart(self) -> None:
        """Start again on the same ports and data (stops it first if running)."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing answers.

        Returns once the kernel reports it stopped: the signal is delivered asynchronously,
        and a server thread running on another CPU could still answer a request sent at once.
        """
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        self._paused = True
        deadline = time.monotonic() + PAUSE_DEADLINE_SECONDS
        while psutil.Process(self.process.pid).status() != psutil.STATUS_STOPPED:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{self.process.pid} did not stop on SIGSTOP")
            time.sleep(0.001)

    def resume(self) -> None:
        """Thaw a paused server (SIGCONT)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)
        self._paused = False

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def require(binary: str, found: bool | None = None) -> None:
    """Skip the calling test when ``binary`` is missing on a developer's machine, but fail it
    under CI (``CI`` set), where the test command installs it: a silent skip there would turn
    a broken set-up green."""
    import os
    import shutil

    import pytest

    if (shutil.which(binary) is not None) if found is None else found:
        return
    message = f"{binary} is not installed (scripts/setup.sh installs it)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
