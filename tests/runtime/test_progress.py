"""Progress on a terminal and nowhere else (``runtime.progress``): a bar renders on a
terminal, nothing is written off one or under JSON logs, a large artifact fetch shows its
bytes, and a real ``turnout serve`` on a pseudo-terminal shows its workers coming up while its
log lines stay whole (and without a terminal, no control character is written)."""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from turnout.engines.worker import artifact_handler
from turnout.frontend.models.artifacts import ArtifactFetcher, DiskArtifactCache
from turnout.frontend.service import free_port
from turnout.llm.artifacts import ArtifactRegistry
from turnout.protocols.model import ARTIFACT_HANDLER, EndpointId
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery.memory import MemoryStore
from turnout.runtime.log_context import log_handler
from turnout.runtime.progress import MIN_BYTES, progress_bar, progress_shown


class Terminal(io.StringIO):
    """A buffer that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def root_handlers() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    saved = root.handlers[:]
    yield root
    root.handlers[:] = saved


def test_a_bar_renders_on_a_terminal_and_nothing_is_written_elsewhere(
    root_handlers: logging.Logger,
) -> None:
    terminal = Terminal()
    root_handlers.handlers[:] = [log_handler("text")]
    assert progress_shown(terminal)
    with progress_bar("workers ready", 4, stream=terminal) as bar:
        bar.update(3)
    assert "workers ready" in terminal.getvalue() and "3/4" in terminal.getvalue()
    plain = io.StringIO()
    assert not progress_shown(plain)
    with progress_bar("workers ready", 4, stream=plain) as bar:
        bar.update(3)
    assert plain.getvalue() == ""


def test_json_logs_mean_no_bar_even_on_a_terminal(root_handlers: logging.Logger) -> None:
    root_handlers.handlers[:] = [log_handler("json")]
    terminal = Terminal()
    assert not progress_shown(terminal)
    with progress_bar("x", 1, stream=terminal) as bar:
        bar.update(1)
    assert terminal.getvalue() == ""


@pytest.fixture
async def runtime() -> AsyncIterator[DistributedRuntime]:
    store = MemoryStore()
    rt = await DistributedRuntime.create(store=store, request_plane="tcp", lease_ttl=5.0)
    yield rt
    await rt.shutdown()
    await store.close()


async def _idle(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield b""


async def test_a_large_artifact_fetch_shows_its_bytes(
    runtime: DistributedRuntime,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    root_handlers: logging.Logger,
) -> None:
    endpoint = EndpointId(namespace="test", component="artifacts", name="generate")
    data = os.urandom(MIN_BYTES + 1024)
    registry = ArtifactRegistry()
    ref = registry.publish("weights.bin", "opaque", data)
    serving = await runtime.endpoint(endpoint).serve(_idle)
    serving.add_handler(ARTIFACT_HANDLER, artifact_handler([ref], registry))
    client = await runtime.endpoint(endpoint).client()
    terminal = Terminal()
    root_handlers.handlers[:] = [log_handler("text")]
    monkeypatch.setattr(sys, "stderr", terminal)
    fetcher = ArtifactFetcher(disk=DiskArtifactCache(tmp_path / "cache"))
    assert await fetcher.get_bytes(ref, client, prefer=serving.instance_id) == data
    shown = terminal.getvalue()
    assert "fetching weights.bin" in shown and "MB" in shown


def _read_until(fd: int, needle: bytes, timeout: float) -> bytes:
    """What the pty gave until ``needle`` came (or the deadline: then what came)."""
    out = b""
    deadline = time.monotonic() + timeout
    while needle not in out and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    return out


def test_serve_on_a_terminal_shows_its_workers_coming_up(tmp_path: Path) -> None:
    controller, terminal = pty.openpty()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "turnout", "serve", "--engine", "mocker", "--port", str(port),
         "--store-path", str(tmp_path / "store.sqlite")],
        stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal, start_new_session=True,
    )  # fmt: skip
    os.close(terminal)
    try:
        out = _read_until(controller, b"workers ready", 60)
        out += _read_until(controller, b"serving turnout/", 30)  # a worker's line, after
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out += _read_until(controller, b"\x00never", 5)
        proc.wait(timeout=30)
        os.close(controller)
    text = out.decode(errors="replace")
    assert "workers ready" in text, text
    lines = [line for line in text.replace("\r", "\n").splitlines() if " INFO " in line]
    # Log lines come out whole, each from its start, however the bar redraws around them.
    serving = [line for line in lines if "serving on http://" in line]
    assert serving and all(re.match(r"^(\x1b\[[0-9;?]*[A-Za-z])*\d{4}-\d\d-\d\d ", line)
                           for line in serving), serving  # fmt: skip


def test_serve_off_a_terminal_writes_no_control_character(tmp_path: Path) -> None:
    from tests.integration.procs import health, start_serve, stop_serve, wait_until

    port = free_port()
    proc = start_serve(tmp_path, port, "--engine", "mocker")
    try:
        wait_until(lambda: any(health(f"http://127.0.0.1:{port}").values()), 90, "workers")
    finally:
        stop_serve(proc)
    log = (tmp_path / "serve.log").read_text()
    assert "serving on http://" in log and "\x1b" not in log and "\r" not in log
