"""Stopping the server processes a benchmark started, each in its own process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable


def stop_process_groups(procs: Iterable[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGINT every process group, wait up to ``grace_s`` for a clean exit, then SIGKILL what
    is left (a group may hold children after its leader exited). Safe to call twice."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
