"""The suite-wide check that no test secret reaches a log line.

Every secret a test makes starts with ``SECRET_MARKER``. For the whole session a handler on
the root logger scans each record emitted in the test process (the formatted message, the
exception and stack text, and ``extra`` fields), libraries' records included, and the root
logger lets info records through so those are scanned too. Processes a test starts write
their output to ``*.log`` files under the test's ``tmp_path`` (``tests/integration/procs.py``
and the other spawners), and ``subprocess.run`` calls that capture output hand it back to the
test: both are scanned as well.

A hit fails the test during which it happened, with a report naming the logger and the
source line (or the file, or the command). Hits outside any test (in a module-scoped
fixture's teardown, from a thread after its test ended) are charged to the next test, or fail
the session at its end, where every ``*.log`` under the session's temporary directory is
scanned once more (module-scoped stacks write theirs there).
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: The prefix of every secret (API key, password, token) that a test makes.
SECRET_MARKER = "sk-turnout-test-"
#: Characters of context shown on each side of a hit in a report.
EXCERPT_CHARS = 60
#: Hits kept per test (more are counted, not kept): a leak in a loop must not flood memory.
MAX_KEPT = 20

# Attributes every LogRecord has; the others came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}


@dataclass(frozen=True, slots=True)
class Leak:
    """One place a secret showed up: where (a logger and source line, a file, a command)
    and the text around it."""

    where: str
    excerpt: str

    def __str__(self) -> str:
        return f"{self.where}: ...{self.excerpt}..."


def find_leaks(text: str, where: str) -> list[Leak]:
    """Each occurrence of ``SECRET_MARKER`` in ``text``, with its context."""
    leaks: list[Leak] = []
    start = text.find(SECRET_MARKER)
    while start != -1 and len(leaks) < MAX_KEPT:
        excerpt = text[max(0, start - EXCERPT_CHARS) : start + len(SECRET_MARKER) + EXCERPT_CHARS]
        leaks.append(Leak(where, excerpt.replace("\n", "\\n")))
        start = text.find(SECRET_MARKER, start + 1)
    return leaks


def record_text(record: logging.LogRecord) -> str:
    """Everything a formatter could print of ``record``: message, exception and stack text,
    and the ``extra`` fields a structured formatter would add."""
    try:
        parts = [record.getMessage()]
    except Exception:  # a bad format string is not ours to report; scan what is there
        parts = [str(record.msg), repr(record.args)]
    if record.exc_info:
        parts.append(logging.Formatter().formatException(record.exc_info))
    if record.exc_text:
        parts.append(record.exc_text)
    if record.stack_info:
        parts.append(record.stack_info)
    parts.extend(f"{k}={v!r}" for k, v in vars(record).items() if k not in _STANDARD)
    return "\n".join(parts)


def scan_record(record: logging.LogRecord) -> list[Leak]:
    """The leaks in one log record, each naming its logger, level and source line."""
    text = record_text(record)
    if SECRET_MARKER not in text:
        return []
    where = (
        f"log record of logger {record.name!r} ({record.levelname}) "
        f"at {record.pathname}:{record.lineno}"
    )
    return find_leaks(text, where)


def scan_logs_under(root: Path) -> list[Leak]:
    """The leaks in every ``*.log`` file under ``root`` (the output of processes tests ran)."""
    leaks: list[Leak] = []
    if not root.is_dir():
        return leaks
    for path in sorted(root.rglob("*.log")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue  # removed while we looked: its test cleaned up
        leaks.extend(find_leaks(text, f"process output {path}"))
    return leaks


def scan_output(output: object, where: str) -> list[Leak]:
    """The leaks in captured process output (``str``, ``bytes`` or None)."""
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    return find_leaks(output, where) if isinstance(output, str) else []


class LeakHandler(logging.Handler):
    """Collects the leaks of every record it sees (thread-safe; never raises)."""

    def __init__(self) -> None:
        super().__init__(level=logging.NOTSET)
        self._lock_leaks = threading.Lock()
        self._leaks: list[Leak] = []

    def emit(self, record: logging.LogRecord) -> None:
        leaks = scan_record(record)
        if leaks:
            self.add(leaks)

    def add(self, leaks: list[Leak]) -> None:
        with self._lock_leaks:
            self._leaks.extend(leaks[: MAX_KEPT - len(self._leaks)])

    def take(self) -> list[Leak]:
        """The leaks seen since the last call, and forget them."""
        with self._lock_leaks:
            leaks, self._leaks = self._leaks, []
        return leaks


def _report(leaks: list[Leak]) -> str:
    return (
        f"a test secret ({SECRET_MARKER}...) reached the logs {len(leaks)} time(s):\n"
        + "\n".join(f"  {leak}" for leak in leaks)
    )


class LogCheck:
    """The pytest plugin: installs the handler and the ``subprocess.run`` scan for the
    session, and fails the test (or the session) that leaked."""

    def __init__(self) -> None:
        self.handler = LeakHandler()
        self._root_level = logging.WARNING
        self._run: Any = None

    def pytest_configure(self, config: pytest.Config) -> None:
        root = logging.getLogger()
        root.addHandler(self.handler)
        self._root_level = root.level
        if root.level == logging.NOTSET or root.level > logging.INFO:
            root.setLevel(logging.INFO)  # info lines are the ones that must stay clean
        self._run = subprocess.run
        handler, run = self.handler, self._run

        def scanned_run(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
            result: subprocess.CompletedProcess[Any] = run(*args, **kwargs)
            command = args[0] if args else kwargs.get("args")
            where = f"output of {command!r}"[:200]
            handler.add(scan_output(result.stdout, where) + scan_output(result.stderr, where))
            return result

        subprocess.run = scanned_run

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        logging.getLogger().removeHandler(self.handler)
        logging.getLogger().setLevel(self._root_level)
        if self._run is not None:
            subprocess.run = self._run

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, None]:
        outcome = yield
        if call.when != "teardown":
            return
        leaks = self.handler.take()
        tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
        if isinstance(tmp_path, Path):
            leaks += scan_logs_under(tmp_path)
        if not leaks:
            return
        report = outcome.get_result()
        report.outcome = "failed"
        report.longrepr = _report(leaks)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        leaks = self.handler.take()
        # The session's temporary directory, if a test made one (None: none did, or
        # ``-p no:tmpdir``).
        factory = getattr(session.config, "_tmp_path_factory", None)
        basetemp = getattr(factory, "_basetemp", None)
        if isinstance(basetemp, Path):
            leaks += scan_logs_under(basetemp)
        if not leaks:
            return
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(_report(leaks), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
