"""Run the shell blocks of a Markdown page as a reader would: in order, in one shell.

A block a reader is meant to run is a fenced block whose info string is ``bash`` followed by
``doc-step=NAME``::

    ```bash doc-step=certs
    openssl req ...
    ```

GitHub still highlights it as bash. Other ``bash`` blocks are examples and never run.
``parse_steps`` finds the tagged blocks and refuses a malformed tag (an unknown word in the
info string, a step without a name, a name used twice): a typo must not quietly turn a block
into an example.

``DocShell`` is one ``bash`` process (``set -euo pipefail``) that sources each block in turn, so
the variables, functions and background jobs of a block are there in the next, as in a
reader's terminal. Each step has a deadline. Every process the blocks start carries a marker
in its environment (``DOC_STEPS_RUN``): ``leftover_processes`` finds those still running, and
``close`` kills the shell's process group and then every marked process, whatever session it
moved to.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shlex
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

#: The info string of a step's fence: the language, then one ``doc-step=NAME``.
STEP_TAG = re.compile(r"doc-step=(?P<name>[a-z0-9][a-z0-9-]*)")
FENCE = re.compile(r"^```(?P<info>.*)$")
#: The environment variable that marks every process a run starts.
MARKER_ENV = "DOC_STEPS_RUN"
#: What the shell prints after each step (never part of a block's own output).
DONE_PREFIX = "__doc_step_done__"
#: Words that end a simple command (when written apart, as the page does).
SHELL_OPERATORS = frozenset({"|", "||", "&", "&&", ";"})
#: Most output lines kept per step for a failure message.
MAX_OUTPUT_LINES = 400


class DocStepError(Exception):
    """The page's tags are malformed, or a step failed or overran its deadline."""


@dataclass(frozen=True, slots=True)
class DocStep:
    """One tagged block: its name, its shell text, and the line its fence opens on."""

    name: str
    code: str
    line: int


def parse_steps(text: str) -> list[DocStep]:
    """The tagged blocks of ``text``, in page order (see the module docstring).

    Raises ``DocStepError`` for a fence whose info string names ``doc-step`` wrongly: a word
    beside ``bash`` other than one ``doc-step=NAME``, a tag on another language, a repeated
    name."""
    steps: list[DocStep] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        opening = index + 1
        words = match.group("info").split()
        end = index + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if end == len(lines):
            raise DocStepError(f"line {opening}: fence never closed")
        tags = words[1:]
        if tags:
            if words[0] != "bash":
                raise DocStepError(f"line {opening}: only bash blocks take tags, not {words[0]!r}")
            tag = STEP_TAG.fullmatch(tags[0]) if len(tags) == 1 else None
            if tag is None:
                raise DocStepError(
                    f"line {opening}: unknown fence tag {' '.join(tags)!r} "
                    "(a step is tagged `bash doc-step=NAME`)"
                )
            name = tag.group("name")
            if any(step.name == name for step in steps):
                raise DocStepError(f"line {opening}: step {name!r} is tagged twice")
            steps.append(DocStep(name, "\n".join(lines[index + 1 : end]) + "\n", opening))
        index = end + 1
    return steps


def bash_commands(text: str, program: str) -> list[tuple[int, list[str]]]:
    """Every command line of ``program`` in the ``bash`` blocks of ``text``, examples
    included: (the line it starts on, its words as the shell splits them, quotes removed, up
    to the first pipe, redirection or list operator). Continuation lines are joined; a line
    that does not start with ``program`` is skipped."""
    found: list[tuple[int, list[str]]] = []
    in_bash = False
    pending: tuple[int, str] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if match is not None:
            in_bash = not in_bash and match.group("info").split()[:1] == ["bash"]
            continue
        if not in_bash:
            continue
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line)
        elif line.lstrip().startswith(program + " "):
            pending = (number, line)
        if pending is not None and not line.endswith("\\"):
            start, command = pending
            words = shlex.split(command.replace("\\", " "), comments=True)
            ends = [i for i, word in enumerate(words) if word in SHELL_OPERATORS or ">" in word]
            found.append((start, words[: min(ends, default=len(words))]))
            pending = None
    return found


class DocShell:
    """One ``bash`` that runs steps in order in ``cwd`` (see the module docstring)."""

    def __init__(
        self, cwd: Path, env: Mapping[str, str], variables: Mapping[str, str] | None = None
    ) -> None:
        """``env`` is the shell's environment; ``variables`` are set in the shell before the
        first step without being exported, as a reader sets them in a terminal."""
        self.cwd = cwd
        self.run_id = uuid.uuid4().hex
        self._steps_dir = cwd / ".doc-steps"
        self._steps_dir.mkdir()
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.process = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            cwd=cwd,
            env={**env, MARKER_ENV: self.run_id},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, name="doc-shell-output", daemon=True)
        self._reader.start()
        assignments = "".join(
            f"{name}={shlex.quote(value)}\n" for name, value in (variables or {}).items()
        )
        self._send(f"set -euo pipefail\n{assignments}")

    def _read(self) -> None:
        """Feed the shell's output to ``_lines`` line by line; None once it closes."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text)
        self.process.stdin.flush()

    def run(self, number: int, step: DocStep, timeout: float) -> list[str]:
        """Run ``step`` (the ``number``-th) and return its output lines. Raises
        ``DocStepError`` with that output when the step fails (the shell exits: ``set -e``) or
        is not done within ``timeout`` seconds."""
        script = self._steps_dir / f"{number:02d}-{step.name}.sh"
        script.write_text(step.code)
        marker = f"{DONE_PREFIX} {number}"
        # Sourced with stdin from /dev/null: a command that reads stdin must not eat the
        # shell's own input (the next steps).
        self._send(f"source {script} </dev/null\nprintf '\\n%s\\n' '{marker}'\n")
        output: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._failure(step, output, f"not done within {timeout:.0f} s")
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                code = self.process.wait(timeout=10)
                raise self._failure(step, output, f"failed: the shell exited with status {code}")
            if line == marker:
                # the newline printed before the marker (the step's output may lack its own)
                if output and output[-1] == "":
                    output.pop()
                return output
            output.append(line)
            del output[:-MAX_OUTPUT_LINES]

    def _failure(self, step: DocStep, output: list[str], what: str) -> DocStepError:
        shown = "\n".join(output[-80:])
        return DocStepError(f"step {step.name!r} (docs line {step.line}) {what}; output:\n{shown}")

    def leftover_processes(self) -> list[psutil.Process]:
        """The processes this run started that still run (the shell itself left out)."""
        found = []
        for proc in psutil.process_iter():
            if proc.pid == self.process.pid:
                continue
            try:
                mine = proc.environ().get(MARKER_ENV) == self.run_id
                if mine and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def close(self) -> None:
        """Kill the shell's process group, then any marked process that left it, and reap
        the shell."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for proc in self.leftover_processes():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                continue
        self.process.wait(timeout=10)
        assert self.process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()
        self._reader.join(timeout=10)
        assert self.process.stdout is not None
        self.process.stdout.close()
