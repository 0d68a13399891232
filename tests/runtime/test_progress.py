"""Progress on a terminal and nowhere else (``runtime.progress``): a bar renders on a
terminal, nothing is written off one or under JSON logs, bars that overlap share one display
with log lines whole above it, a large artifact fetch shows its bytes, and a real ``turnout
serve`` (with worker processes, and in-process) on a pseudo-terminal shows its workers coming
up while every log line, its workers' too, stays whole (and without a terminal, no control
character is written)."""

from __future__ import annotations

import asyncio
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
from turnout.runtime.progress import (
    MIN_BYTES,
    progress_bar,
    progress_shown,
    relay_lines,
    track,
)


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


def test_overlapping_bars_share_one_display_and_log_lines_stay_whole(
    root_handlers: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    root_handlers.handlers[:] = [log_handler("text")]
    line = "x" * 300  # wider than the display: it is not wrapped
    with progress_bar("workers ready", 2) as outer:
        with progress_bar("fetching a", MIN_BYTES, unit="bytes") as inner:
            inner.update(MIN_BYTES // 2)
            logging.getLogger("progress-test").warning("%s", line)
            assert sys.stderr is not terminal  # the display holds stderr
        outer.update(2)
    assert sys.stderr is terminal  # and gives it back when its last bar ends
    shown = terminal.getvalue()
    assert "workers ready" in shown and "fetching a" in shown and "2/2" in shown
    assert "MB" in shown
    logged = [part for part in shown.replace("\r", "\n").splitlines() if line in part]
    assert logged and all(re.search(r"WARNING progress-test.*x{300}$", part) for part in logged)


def test_track_counts_items_and_is_silent_off_a_terminal(
    root_handlers: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    root_handlers.handlers[:] = [log_handler("text")]
    plain = io.StringIO()
    monkeypatch.setattr(sys, "stderr", plain)
    assert list(track([1, 2, 3], "rounds")) == [1, 2, 3]
    assert plain.getvalue() == ""
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(track(["a", "b"], "cases", label=str)) == ["a", "b"]
    assert "cases: b" in terminal.getvalue() and "2/2" in terminal.getvalue()


#: A log line's start (text format).
STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
#: What may come right before a log line on a terminal: nothing, a line's end, or the
#: display's "erase the line" after it moved to the bar's start.
LINE_START = re.compile(r"(^|\n|\x1b\[2K(\x1b\[\?25h\r)?)$")


def whole_log_lines(text: str) -> list[str]:
    """The log lines in terminal output, each checked to start on a line of its own and to
    run to its end with no control sequence inside (a bar drawn over it would show as one)."""
    lines = []
    for match in STAMP.finditer(text):
        assert LINE_START.search(text[: match.start()]), repr(
            text[match.start() - 80 : match.end()]
        )
        line = re.match(r"[^\r\n]*", text[match.start() :])
        assert line is not None
        assert "\x1b" not in line.group(), repr(line.group())
        lines.append(line.group())
    return lines


def test_overlapping_bars_share_one_display_and_log_lines_pass_whole_above_it(
    root_handlers: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    root_handlers.handlers[:] = [log_handler("text")]
    long = "x" * 300  # wider than any terminal: one line all the same
    with progress_bar("first", 3) as first:
        second = progress_bar("second", 5)
        with second as bar:
            bar.update(2)
            logging.getLogger("test").warning("a long line %s", long)
            first.update(1)
        logging.getLogger("test").warning("after the second bar")
    assert sys.stderr is terminal
    shown = terminal.getvalue()
    assert "first" in shown and "second" in shown and "2/5" in shown
    lines = whole_log_lines(shown)
    assert [re.sub(r".* WARNING test pid=\d+ ", "", line) for line in lines] == [
        f"a long line {long}",
        "after the second bar",
    ]


def test_figures_printed_to_a_pipe_stay_in_it_while_a_bar_shows(
    root_handlers: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal, piped = Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(sys, "stdout", piped)
    root_handlers.handlers[:] = [log_handler("text")]
    with progress_bar("rounds", 2):
        print("figure 1.5")
    assert piped.getvalue() == "figure 1.5\n" and "figure" not in terminal.getvalue()


async def test_a_childs_output_is_relayed_whole_lines_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Recorder())
    reader = asyncio.StreamReader()
    relay = asyncio.create_task(relay_lines(reader))
    reader.feed_data(b"first li")
    reader.feed_data(b"ne\nsecond")
    await asyncio.sleep(0)  # the relay's turn: it holds the partial line
    reader.feed_data(" line \u00e9\nno end".encode())
    reader.feed_eof()
    await asyncio.wait_for(relay, 5)
    assert "".join(writes) == "first line\nsecond line \u00e9\nno end\n"
    assert all(w.endswith("\n") for w in writes)


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


@pytest.mark.parametrize(
    ("extra", "expected"), [((), 2), (("--in-process",), 1)], ids=["processes", "in-process"]
)
def test_serve_on_a_terminal_shows_its_workers_coming_up(
    tmp_path: Path, extra: tuple[str, ...], expected: int
) -> None:
    controller, terminal = pty.openpty()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "turnout", "serve", "--engine", "mocker", "--port", str(port),
         "--store-path", str(tmp_path / "store.sqlite"), *extra],
        stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal, start_new_session=True,
    )  # fmt: skip
    os.close(terminal)
    try:
        out = _read_until(controller, b"workers ready", 60)
        out += _read_until(controller, b"\x1b[?25h", 60)  # the display ends: all are up
        if b"added model" not in out:  # the frontend's line, before or after
            out += _read_until(controller, b"added model", 30)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out += _read_until(controller, b"\x00never", 5)
        proc.wait(timeout=30)
        os.close(controller)
    text = out.decode(errors="replace")
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    assert f"{expected}/{expected}" in re.findall(r"workers ready \S* (\d+/\d+)", plain), plain
    # Every log line, the workers' too, comes out whole, each from its line's start, however
    # the bar redraws around it.
    lines = whole_log_lines(text)
    assert any("serving on http://" in line for line in lines), text
    assert any(re.search(r" serving turnout/\S+ instance \w+ at \S+$", line) for line in lines)
    assert any("added model" in line for line in lines)


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
