"""Progress of long waits on a terminal (``rich``), and nothing anywhere else.

A progress bar shows only when stderr is a terminal and log lines are text: under a process
manager, in a container's log stream, with ``--log-format json`` or in a pipe, nothing but the
usual log lines is written. While a bar shows, log lines still come out whole, above it: the
log handler writes to whatever ``sys.stderr`` is (``runtime.log_context``), which the live
display redirects through itself.

Every progress is a view of a wait that has its own deadline; none waits on anything.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from turnout.runtime.log_context import JsonFormatter

#: Sizes under this many bytes are not worth a bar (artifact fetches).
MIN_BYTES = 4 * 1024 * 1024


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

    def __init__(self, progress: Any = None, task: Any = None) -> None:
        self._progress = progress
        self._task = task

    def update(
        self, completed: float, total: float | None = None, description: str | None = None
    ) -> None:
        if self._progress is None:
            return
        fields: dict[str, Any] = {"completed": completed}
        if total is not None:
            fields["total"] = total
        if description is not None:
            fields["description"] = description
        self._progress.update(self._task, **fields)


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
    that give ``stream``). ``unit="bytes"`` shows sizes and a transfer speed."""
    if not (force or progress_shown(stream)):
        yield Bar()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    console = Console(file=stream or sys.stderr, force_terminal=force or None)
    columns: list[Any] = [TextColumn("{task.description}"), BarColumn()]
    if unit == "bytes":
        columns += [DownloadColumn(), TransferSpeedColumn()]
    else:
        columns += [MofNCompleteColumn()]
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, redirect_stderr=True) as progress:
        task = progress.add_task(description, total=total)
        yield Bar(progress, task)
