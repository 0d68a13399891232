"""``turnout serve`` supervises its workers: restarts with backoff, gives up on a worker that
keeps dying, and exits non-zero when none is left. Unit tests with a fake clock and fake
processes; one process test kills a real worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
from tests.integration.procs import health, start_serve, stop_serve, wait_until

from turnout.cli.serve import WorkerSupervisor, describe_exit, spawn_child
from turnout.frontend.service import free_port


class FakeProcess:
    def __init__(self, pid: int, code: int, lifetime: float, clock: FakeClock) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._code = code
        self._lifetime = lifetime
        self._clock = clock

    async def wait(self) -> int:
        self._clock.now += self._lifetime
        self.returncode = self._code
        return self._code

    def send_signal(self, sig: int) -> None:
        pass

    def kill(self) -> None:
        pass


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def supervisor(lifetimes: list[float], clock: FakeClock) -> WorkerSupervisor:
    runs = iter(lifetimes)

    async def spawn(argv: list[str]) -> FakeProcess:
        return FakeProcess(100 + len(clock.slept), -signal.SIGKILL, next(runs), clock)

    return WorkerSupervisor(["worker"], "worker 0", spawn=spawn, clock=clock, sleep=clock.sleep)


async def test_a_worker_that_keeps_dying_is_restarted_with_backoff_then_given_up() -> None:
    clock = FakeClock()
    sup = supervisor([0.5] * 10, clock)
    await sup.start()
    await sup.run()
    assert sup.gave_up
    assert clock.slept == [1.0, 2.0, 4.0, 8.0]  # the 5th death within a minute ends it
    assert sup.restarts == 4


async def test_backoff_is_capped_and_resets_after_a_long_run() -> None:
    clock = FakeClock()
    # Dies quickly 4 times, then runs for 10 minutes, then dies quickly until given up.
    sup = supervisor([0.1, 0.1, 0.1, 0.1, 600.0, *[0.1] * 8], clock)
    sup._max_delay = 4.0
    await sup.start()
    await sup.run()
    assert sup.gave_up
    assert clock.slept == [1.0, 2.0, 4.0, 4.0, 1.0, 2.0, 4.0, 4.0]


async def test_a_stopped_supervisor_does_not_restart() -> None:
    clock = FakeClock()
    sup = supervisor([0.1, 0.1], clock)
    await sup.start()
    sup.stop()
    await sup.run()
    assert not sup.gave_up and sup.restarts == 0


async def test_a_restart_that_cannot_spawn_counts_as_a_death_not_a_silent_stop() -> None:
    """Spawning can fail (no file descriptors, no memory): that is retried with backoff and
    given up on like a crash, never left as a supervisor that silently stopped."""
    clock = FakeClock()
    spawned = 0

    async def spawn(argv: list[str]) -> FakeProcess:
        nonlocal spawned
        spawned += 1
        if spawned > 1:
            raise OSError(24, "Too many open files")
        return FakeProcess(100, -signal.SIGKILL, 0.5, clock)

    sup = WorkerSupervisor(["worker"], "worker 0", spawn=spawn, clock=clock, sleep=clock.sleep)
    await sup.start()
    await sup.run()
    assert sup.gave_up
    assert clock.slept == [1.0, 2.0, 4.0, 8.0]


def test_exit_descriptions() -> None:
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"
    assert describe_exit(2) == "exit status 2"


@pytest.mark.slow
def test_serve_restarts_a_killed_worker(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(tmp_path, port, "--engine", "echo", "--num-workers", "1",
                       "--model-name", "echo", "--lease-ttl", "2")  # fmt: skip
    log_path = tmp_path / "serve.log"

    def logs() -> str:
        return log_path.read_text(errors="replace")[-4000:]

    try:
        wait_until(lambda: len(health(url).get("echo", [])) == 1, 60, "the worker", logs)
        first = health(url)["echo"][0]
        (child,) = psutil.Process(proc.pid).children()
        child.kill()
        wait_until(lambda: health(url).get("echo", []) not in ([], [first]), 60, "a restart", logs)
        assert "worker 0 (pid" in logs() and "signal SIGKILL; restarting it in 1s" in logs()
        body = {"model": "echo", "prompt": "hello there", "max_tokens": 2}
        r = httpx.post(url + "/v1/completions", timeout=30, json=body)
        assert r.status_code == 200, r.text
    finally:
        stop_serve(proc)


@pytest.mark.slow
def test_serve_gives_up_on_workers_that_keep_dying_and_exits_non_zero(tmp_path: Path) -> None:
    """A worker that cannot start dies 5 times within a minute (restarts after 1, 2, 4, 8 s):
    serve gives up on it with one error line and, with no worker left, exits non-zero."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "turnout", "serve", "--port", str(port), "--engine", "echo",
             "--num-workers", "1", "--model-path", str(tmp_path / "missing.gguf"),
             "--store-path", str(tmp_path / "store.sqlite")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log_path.read_text(errors="replace")
    assert code != 0, text[-3000:]
    assert text.count("restarting it in") == 4, text[-3000:]
    assert "its 5th death within 60s; giving up on it" in text, text[-3000:]
    assert "every worker failed for good" in text, text[-3000:]


async def test_workers_do_not_inherit_a_per_process_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A system port set for ``serve`` would make every worker bind the same port: children
    get the environment without it, and with every other variable."""
    monkeypatch.setenv("TURNOUT_SYSTEM_PORT", "9090")
    monkeypatch.setenv("TURNOUT_LOG_LEVEL", "debug")
    read_r, read_w = os.pipe()
    try:
        script = (
            "import os; os.write(int(os.environ['FD']), repr(("
            "os.environ.get('TURNOUT_SYSTEM_PORT'), os.environ.get('TURNOUT_LOG_LEVEL'))).encode())"
        )
        monkeypatch.setenv("FD", str(read_w))
        child = await spawn_child([sys.executable, "-c", script], pass_fds=(read_w,))
        assert await child.wait() == 0
        os.close(read_w)
        read_w = -1
        assert os.read(read_r, 1024).decode() == "(None, 'debug')"
    finally:
        os.close(read_r)
        if read_w >= 0:
            os.close(read_w)
