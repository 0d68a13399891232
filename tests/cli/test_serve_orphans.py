"""``turnout serve`` owns its workers: killed outright (SIGKILL), it takes them with it. Each
worker stops gracefully when its link to serve breaks, revoking its lease, so the store shows
no instance of the tree long before a lease TTL; one that cannot stop exits hard."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from tests.integration.procs import health, start_serve, wait_until

from turnout.cli.parent_watch import ORPHAN_EXIT_STATUS
from turnout.frontend.service import free_port
from turnout.runtime.discovery import FileStore


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (an orphan is reaped by whoever adopts it, maybe late)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def instances(store_path: Path) -> list[str]:
    async def read() -> list[str]:
        store = FileStore(store_path)
        try:
            return [kv.key for kv in await store.get_prefix("v1/instances/")]
        finally:
            await store.close()

    return asyncio.run(read())


@pytest.mark.slow
def test_workers_die_with_a_killed_serve_and_leave_the_store(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A lease TTL far longer than the deadline: the instances must go by revocation.
    proc = start_serve(tmp_path, port, "--engine", "mocker", "--num-workers", "2",
                       "--model-name", "mock", "--speedup-ratio", "0", "--num-gpu-blocks", "512",
                       "--lease-ttl", "60")  # fmt: skip
    log_path = tmp_path / "serve.log"

    def logs() -> str:
        return log_path.read_text(errors="replace")[-4000:]

    children: list[psutil.Process] = []
    try:
        wait_until(lambda: len(health(url).get("mock", [])) == 2, 60, "two workers", logs)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "serve has no worker process"
        assert len(instances(tmp_path / "store.sqlite")) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        wait_until(lambda: not any(alive(c) for c in children), 20, "the workers to exit", logs)
        assert instances(tmp_path / "store.sqlite") == [], logs()
        assert "exiting now" not in logs()  # a graceful stop, not the hard exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for child in children:
            if alive(child):
                child.kill()


def test_a_worker_that_cannot_stop_exits_hard_after_its_grace() -> None:
    """SIGTERM ignored (a stuck stop, as far as the parent link can tell): the child exits
    on its own, with the orphan status, soon after the grace."""
    read_fd, write_fd = os.pipe()
    code = (
        "import signal, time\n"
        "from turnout.cli.parent_watch import watch_parent\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"watch_parent({read_fd}, grace=0.5)\n"
        "print('watching', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], pass_fds=(read_fd,), stdout=subprocess.PIPE
    )
    try:
        os.close(read_fd)
        assert child.stdout is not None and child.stdout.readline() == b"watching\n"
        assert child.poll() is None  # the parent lives: nothing happens
        started = time.monotonic()
        os.close(write_fd)  # what the kernel does when the parent dies
        assert child.wait(timeout=20) == ORPHAN_EXIT_STATUS
        assert time.monotonic() - started < 10
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        assert child.stdout is not None
        child.stdout.close()


def test_a_parent_gone_before_the_watch_started_is_noticed_at_once() -> None:
    """The race of the parent-death signal (the parent died between fork and prctl): the
    pipe is closed already, so the first read ends it."""
    read_fd, write_fd = os.pipe()
    os.close(write_fd)
    code = (
        "import time\n"
        "from turnout.cli.parent_watch import watch_parent\n"
        f"watch_parent({read_fd}, grace=30)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], pass_fds=(read_fd,))
    os.close(read_fd)
    try:
        assert child.wait(timeout=20) == -signal.SIGTERM  # the graceful path: SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_parent_death_signal_alone_ends_an_orphan(tmp_path: Path) -> None:
    """No pipe: a middle process starts a grandchild that sets the parent-death signal, then
    is SIGKILLed; the grandchild gets SIGTERM from the kernel."""
    pid_file = tmp_path / "grandchild.pid"
    grandchild = (
        "import os, time\n"
        "from turnout.cli.parent_watch import set_parent_death_signal\n"
        "import signal\n"
        "assert set_parent_death_signal(signal.SIGTERM)\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    middle = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", middle])
    orphan: psutil.Process | None = None
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", 20, "the grandchild")
        orphan = psutil.Process(int(pid_file.read_text()))
        parent.kill()
        parent.wait()
        wait_until(lambda: not alive(orphan), 20, "the orphan to exit")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if orphan is not None and alive(orphan):
            orphan.kill()
