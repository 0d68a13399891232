"""The suite-wide log check (``tests/log_check.py``) can fail: a secret in a log record, in a
process's log file or in captured process output fails the test that leaked it."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.log_check import SECRET_MARKER, LeakHandler, find_leaks, scan_logs_under, scan_record

#: Built at run time so that this file's own text holds no whole secret.
FAKE_KEY = SECRET_MARKER + "0123456789abcdef"

INNER_CONFTEST = """
import pytest
from tests.log_check import LogCheck

def pytest_configure(config):
    config.pluginmanager.register(LogCheck(), "turnout-log-check")
"""

INNER_TESTS = """
import logging
import subprocess
import sys

KEY = "sk-turnout-test-" + "inner"

def test_logs_a_key():
    logging.getLogger("turnout.fake").info("calling upstream with %s", KEY)

def test_logs_a_key_in_a_traceback():
    try:
        raise ValueError(KEY)
    except ValueError:
        logging.getLogger("turnout.fake").warning("upstream failed", exc_info=True)

def test_a_process_log_holds_a_key(tmp_path):
    (tmp_path / "worker-0.log").write_text("INFO started with " + KEY + "\\n")

def test_captured_output_holds_a_key():
    subprocess.run([sys.executable, "-c", "print('sk-turnout-test-' + 'out')"],
                   capture_output=True, check=True)

def test_clean():
    logging.getLogger("turnout.fake").info("calling upstream with key %s", "1a2b3c4d5e6f")
"""


INNER_MODULE_STACK = """
import pytest

@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("stack")
    (logs / "frontend-0.log").write_text("INFO key " + "sk-turnout-test-" + "module" + "\\n")
    return logs

def test_uses_a_module_stack(stack):
    assert stack.is_dir()
"""


def _run_suite(tmp_path: Path, tests: str) -> tuple[int, str]:
    """Run ``tests`` under the check in a child pytest; its exit status and output. Its
    temporary directory is removed after: the process logs in it hold secrets."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(INNER_CONFTEST)
    (suite / "test_leaks.py").write_text(tests)
    (suite / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    basetemp = tmp_path / "inner-tmp"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    # Popen, not run: the check scans what run captures, and this output holds the secrets.
    with subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         f"--basetemp={basetemp}", str(suite)],
        cwd=suite, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    ) as child:  # fmt: skip
        out, _ = child.communicate(timeout=120)
    shutil.rmtree(basetemp, ignore_errors=True)
    return child.returncode, out.decode(errors="replace")


def _record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("turnout.fake", logging.INFO, "/src/x.py", 42, msg, args, None)
    record.__dict__.update(extra)
    return record


def test_a_record_with_a_secret_is_flagged_with_its_logger_and_line() -> None:
    leaks = scan_record(_record("key %s rejected", FAKE_KEY))
    assert len(leaks) == 1
    assert "'turnout.fake'" in leaks[0].where and "/src/x.py:42" in leaks[0].where
    assert scan_record(_record("key %s rejected", "1a2b3c4d5e6f")) == []


def test_extra_fields_and_exceptions_are_scanned() -> None:
    assert scan_record(_record("audit", who=FAKE_KEY))
    try:
        raise RuntimeError(FAKE_KEY)
    except RuntimeError:
        record = _record("failed")
        record.exc_info = sys.exc_info()
    assert scan_record(record)


def test_the_handler_collects_and_forgets() -> None:
    handler = LeakHandler()
    handler.handle(_record("%s", FAKE_KEY))
    handler.handle(_record("clean"))
    assert len(handler.take()) == 1
    assert handler.take() == []


def test_every_occurrence_is_found_and_log_files_are_read(tmp_path: Path) -> None:
    assert len(find_leaks(f"{FAKE_KEY} and {FAKE_KEY}", "text")) == 2
    inner = tmp_path / "scan"
    inner.mkdir()
    (inner / "frontend.txt").write_text(FAKE_KEY)  # not a process log: not read
    assert scan_logs_under(inner) == []
    (inner / "frontend.log").write_text(f"line\n{FAKE_KEY}\n")
    (leak,) = scan_logs_under(inner)
    assert "frontend.log" in leak.where
    (inner / "frontend.log").unlink()


def test_a_leaking_test_fails_in_a_pytest_run(tmp_path: Path) -> None:
    """Runs a small suite under the check in a child pytest: every leaking test errors at
    teardown with a report naming where the secret was, the clean one passes."""
    code, text = _run_suite(tmp_path, INNER_TESTS)
    assert code == 1, text
    assert "5 passed, 4 errors" in text, text  # passed their calls, failed at teardown
    for name in (
        "test_logs_a_key",
        "test_logs_a_key_in_a_traceback",
        "test_a_process_log_holds_a_key",
        "test_captured_output_holds_a_key",
    ):
        assert f"ERROR at teardown of {name}" in text, text
    assert "log record of logger 'turnout.fake' (INFO) at" in text, text
    assert "test_leaks.py:9" in text, text
    assert "worker-0.log" in text and "output of [" in text, text


def test_a_leak_outside_any_test_fails_the_session(tmp_path: Path) -> None:
    """A module-scoped stack's process log is scanned at the session's end."""
    code, text = _run_suite(tmp_path, INNER_MODULE_STACK)
    assert code == 1 and "1 passed" in text, text
    assert "reached the logs" in text and "frontend-0.log" in text, text
