"""A memory watchdog for tests that provoke a process into growing.

A regression in a bound (stop strings, buffered streams, artifact sizes) must fail its test,
not take the machine down: ``MemoryWatchdog`` polls the resident size of one process (and,
optionally, its descendants) from a thread and kills the process the moment it passes the
limit, remembering the peak. The test then fails on ``check()`` with the figure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import psutil


class MemoryWatchdog:
    """Kills ``pid`` (SIGKILL) once its RSS (with ``children``: plus its descendants') passes
    ``limit_bytes``. Use as a context manager; ``check()`` raises when it fired."""

    def __init__(
        self,
        pid: int | None = None,
        *,
        limit_bytes: int,
        children: bool = False,
        interval: float = 0.05,
    ) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.limit_bytes = limit_bytes
        self.children = children
        self.interval = interval
        self.peak_bytes = 0
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memory-watchdog", daemon=True)

    def rss(self) -> int:
        """The watched resident size now (0 once the process is gone)."""
        try:
            proc = psutil.Process(self.pid)
            total = proc.memory_info().rss
            if self.children:
                for child in proc.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        total += child.memory_info().rss
            return int(total)
        except psutil.Error:
            return 0

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            rss = self.rss()
            self.peak_bytes = max(self.peak_bytes, rss)
            if rss > self.limit_bytes:
                self.fired = True
                if self.pid != os.getpid():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.pid, signal.SIGKILL)
                else:  # the test process itself: nothing to kill, stop it the hard way
                    os.kill(os.getpid(), signal.SIGABRT)
                return

    def __enter__(self) -> MemoryWatchdog:
        self.peak_bytes = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def check(self) -> None:
        """Fail if the process passed its limit (it was killed for it)."""
        assert not self.fired, (
            f"pid {self.pid} passed its memory limit of {self.limit_bytes / 2**20:.0f} MiB "
            f"(peak {self.peak_bytes / 2**20:.0f} MiB) and was killed"
        )
