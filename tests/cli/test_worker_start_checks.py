"""What ``turnout worker`` checks at start, in a real process: frontends on its planes, and
an advertised address that reaches it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from turnout.protocols.frontend import FrontendRecord, frontend_key
from turnout.runtime.discovery import FileStore

pytestmark = pytest.mark.slow


def worker_argv(store: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "turnout", "worker", "--engine", "echo", "--model-name", "m",
            "--store", "file", "--store-path", str(store), "--log-level", "warning",
            *extra]  # fmt: skip


def test_worker_that_no_frontend_would_serve_exits_2(tmp_path: Path) -> None:
    store = tmp_path / "s.sqlite"

    async def put_nats_frontend() -> None:
        s = FileStore(store)
        record = FrontendRecord(frontend_id=0xFE, host="10.0.0.1", pid=9, request_plane="nats",
                                event_plane="nats")  # fmt: skip
        await s.put(frontend_key(0xFE), msgspec.json.encode(record))
        await s.close()

    asyncio.run(put_nats_frontend())
    done = subprocess.run(worker_argv(store), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if "ERROR" in ln]
    assert "runs request plane tcp, event plane zmq, and no frontend does" in line
    assert "frontend fe at 10.0.0.1:9 runs nats/nats" in line


def test_worker_advertising_an_address_that_does_not_reach_it_warns_once(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            worker_argv(tmp_path / "s.sqlite", "--advertise-host", "127.0.0.2"),
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "--advertise-host" not in log.read_text():
            assert worker.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    lines = [ln for ln in log.read_text().splitlines() if "--advertise-host" in ln]
    assert len(lines) == 1 and "WARNING" in lines[0], lines
    assert "tcp request plane 127.0.0.2:" in lines[0] and "--bind-host" in lines[0]
