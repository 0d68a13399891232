"""Progress of long waits on a terminal (``rich``), and nothing anywhere else.

A progress bar shows only when stderr is a terminal and log lines are text: under a process
manager, in a container's log stream, with ``--log-format json`` or in a pipe, nothing but the
usual log lines is written. While a bar shows, log lines still come out whole, above it: the
log handler writes to whatever ``sys.stderr`` is (``runtime.log_context``), which the live
display redirects through itself.

A process has one live display at a time, holding one line per bar: bars that overlap (an
artifact fetch while serve's workers come up, a benchmark's requests inside its rounds) share
it instead of each redrawing the same line, and it stops when its last bar ends.

Every progress is a view of a wait that has its own deadline; none waits on anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from turnout.runtime.log_context import JsonFormatter

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, Task
    from rich.text import Text

T = TypeVar("T")

#: Sizes under this many bytes are not worth a bar (artifact fetches).
MIN_BYTES = 4 * 1024 * 1024
#: Longest piece of a child's output held waiting for its line's end (``relay_lines``).
MAX_RELAYED_LINE = 64 * 1024
#: Redraws a second: a bar is for a person, and benchmarks measure the CPU around it.
REFRESH_PER_SECOND = 4


def progress_shown(stream: TextIO | None = None) -> bool:
    """Whether a bar may show: ``stream`` (stderr) is a terminal and no log handler writes
    JSON."""
    stream = sys.stderr if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a real stream
        return False
    if not tty:
        return False
    return not any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


class Bar:
    """One task's progress: ``update(completed, total=None, description=None)``; a no-op
    when no bar shows."""

    def __init__(self, progress: Progress | None = None, task: Any = None) -> None:
        self._progress = progress
        self._task = task

    def update(
        self, completed: float, total: float | None = None, description: str | None = None
    ) -> None:
        if self._progress is None:
            return
        self._progress.update(self._task, completed=completed, total=total, description=description)


def _amount_column() -> Any:
    """A column that shows sizes and speed for a task of ``unit="bytes"``, ``done/total``
    for any other: one display holds both kinds of bar."""
    from rich.progress import (
        DownloadColumn,
        MofNCompleteColumn,
        ProgressColumn,
        TransferSpeedColumn,
    )
    from rich.text import Text

    class Amount(ProgressColumn):
        def __init__(self) -> None:
            super().__init__()
            self._size = DownloadColumn()
            self._speed = TransferSpeedColumn()
            self._count = MofNCompleteColumn()

        def render(self, task: Task) -> Text:
            if task.fields.get("unit") == "bytes":
                return Text.assemble(self._size.render(task), " ", self._speed.render(task))
            return self._count.render(task)

    return Amount()


class _Display:
    """The process's one live display, started by its first bar and stopped by its last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._progress: Progress | None = None
        self._bars = 0
        #: What ``sys.stderr``/``sys.stdout`` were before the display took them.
        self._saved: dict[str, TextIO] = {}

    @contextlib.contextmanager
    def bar(
        self, description: str, total: float | None, unit: str, stream: TextIO
    ) -> Iterator[Bar]:
        progress = self._join(stream)
        task = progress.add_task(description, total=total, unit=unit)
        try:
            yield Bar(progress, task)
        finally:
            progress.refresh()  # its last state is drawn once, however short it lived
            progress.remove_task(task)
            self._leave()

    def _join(self, stream: TextIO) -> Progress:
        with self._lock:
            if self._progress is None:
                self._progress = self._start(stream)
            self._bars += 1
            return self._progress

    def _leave(self) -> None:
        with self._lock:
            self._bars -= 1
            if self._bars or self._progress is None:
                return
            progress, self._progress = self._progress, None
            progress.stop()
            for name, saved in self._saved.items():
                proxy = getattr(sys, name)
                if isinstance(proxy, _Lines):
                    proxy.drain()
                setattr(sys, name, saved)
            self._saved.clear()

    def _start(self, stream: TextIO) -> Progress:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(file=stream, force_terminal=True)
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            _amount_column(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            refresh_per_second=REFRESH_PER_SECOND,
            redirect_stderr=False,
            redirect_stdout=False,
        )
        progress.start()
        # stdout through the display only when it is the terminal too: a benchmark's figures
        # piped to a file stay in that file.
        names = ["stderr", "stdout"] if _isatty(sys.stdout) else ["stderr"]
        for name in names:
            self._saved[name] = getattr(sys, name)
            setattr(sys, name, _Lines(console, self._saved[name]))
        return progress


class _Lines(io.TextIOBase):
    """``sys.stderr`` (and a terminal's ``sys.stdout``) while a display shows: each whole line
    written goes above the bars as it is, never wrapped at the terminal's width (a log line
    stays one line, for the terminal to fold and a person to copy); a partial line waits for
    its end."""

    def __init__(self, console: Console, stream: TextIO) -> None:
        super().__init__()
        self._console = console
        self._stream = stream
        self._lock = threading.Lock()
        self._partial = ""

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
            if lines:
                self._print(lines)
        return len(text)

    def flush(self) -> None:
        """Keeps a partial line until its end (logging flushes after every record, whole)."""

    def drain(self) -> None:
        """Writes out a partial line (the display is stopping)."""
        with self._lock:
            if self._partial:
                self._print([self._partial])
                self._partial = ""

    def _print(self, lines: list[str]) -> None:
        from rich.text import Text

        text = Text("\n").join(Text.from_ansi(line) for line in lines)
        self._console.print(text, soft_wrap=True, highlight=False)

    def isatty(self) -> bool:
        return _isatty(self._stream)

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")


def _isatty(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):
        return False


_DISPLAY = _Display()


@contextlib.contextmanager
def progress_bar(
    description: str,
    total: float | None,
    *,
    unit: str = "",
    stream: TextIO | None = None,
    force: bool = False,
) -> Iterator[Bar]:
    """A bar for the block's duration (``force``: show it even off a terminal, for tests
    that give ``stream``). ``unit="bytes"`` shows sizes and a transfer speed. A bar that
    starts while another shows joins that display (and its stream)."""
    if not (force or progress_shown(stream)):
        yield Bar()
        return
    with _DISPLAY.bar(description, total, unit, stream or sys.stderr) as bar:
        yield bar


def track(
    items: Iterable[T],
    description: str,
    *,
    total: int | None = None,
    label: Callable[[T], str] | None = None,
) -> Iterator[T]:
    """``items`` one by one, with a bar of how many are done (``total`` defaults to
    ``len(items)`` when it has one); ``label`` names the item in progress beside
    ``description`` (a benchmark's case or round)."""
    if total is None and isinstance(items, Sized):
        total = len(items)
    with progress_bar(description, total) as bar:
        for done, item in enumerate(items):
            if label is not None:
                bar.update(done, description=f"{description}: {label(item)}")
            yield item
            bar.update(done + 1)


async def relay_lines(reader: asyncio.StreamReader) -> None:
    """Copies a child process's output to this process's ``sys.stderr`` until it ends, whole
    lines at a time, to whatever ``sys.stderr`` is as each comes: while a bar shows, a child's
    log lines pass above it (written to the terminal directly, they would land on the bar's
    line and be erased by its next redraw). A line longer than ``MAX_RELAYED_LINE`` is
    written in pieces."""
    pending = bytearray()
    while chunk := await reader.read(MAX_RELAYED_LINE):
        pending += chunk
        end = pending.rfind(b"\n") + 1 or (len(pending) if len(pending) >= MAX_RELAYED_LINE else 0)
        if end:
            _write_err(pending[:end].decode(errors="replace"))
            del pending[:end]
    if pending:
        _write_err(pending.decode(errors="replace") + "\n")


def _write_err(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()
