"""``docs/deploy.md`` runs as written: every block tagged ``doc-step`` (see ``doc_steps``), in
page order, in one shell, in an empty directory, with every host of the page on a loopback
address of its own.

The blocks make the certificates with their own ``openssl`` lines, start etcd with TLS and a
user limited to ``v1/``, NATS from ``deploy/nats/nats-server.conf`` with TLS and a password,
then a frontend and two mocker workers on tcp + zmq under plane TLS and again on NATS, each
answering a real request, and stop everything. A block that fails fails the test, and so does
a process the blocks leave running; the test kills whatever is left either way.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.deploy.doc_steps import DocShell, DocStep, DocStepError, bash_commands, parse_steps
from tests.servers.process import require

from turnout.cli.main import build_parser

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "deploy.md"

#: The steps the page must hold, in order, with each one's deadline in seconds. A tag the page
#: uses that is not here (a typo, a step added without a deadline) fails the test.
STEP_DEADLINES = {
    "hosts": 10,
    "certs": 30,
    "etcd": 30,
    "etcd-auth": 30,
    "turnout-env": 10,
    "nats": 20,
    "tcp-zmq": 90,
    "nats-nats": 90,
    "upgrade": 90,
    "backup": 20,
    "stop": 20,
}

#: The binaries the steps call.
TOOLS = ("openssl", "etcd", "etcdctl", "nats-server", "curl", "jq")


def _loopback_hosts() -> dict[str, str]:
    """A loopback address per host of the page, in a 127.x.y.0/24 of this run's own, so that
    the standard ports (2379, 4222, 8000, ...) do not collide with another run's."""
    net = f"127.{random.randint(100, 254)}.{random.randint(1, 254)}"
    names = ("ETCD_HOST", "NATS_HOST", "FRONTEND_HOST", "WORKER1_HOST", "WORKER2_HOST")
    return {name: f"{net}.{i}" for i, name in enumerate(names, start=1)}


def _environment() -> dict[str, str]:
    """The shell's environment: this one without any ``TURNOUT_*``, ``ETCD*`` or ``NATS_*``
    setting, turnout's interpreter first on PATH (``nats-server`` from /usr/sbin too), and
    the secrets turnout reads from its environment (test values)."""
    prefixes = ("TURNOUT_", "ETCD", "NATS_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", ""), "/usr/sbin"])
    env["TURNOUT_STORE_PASSWORD"] = "sk-turnout-test-etcd-turnout"
    env["TURNOUT_NATS_PASSWORD"] = "sk-turnout-test-nats-turnout"
    env["TURNOUT_API_KEY"] = "sk-turnout-test-api-key"
    return env


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[DocShell]:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"])
    for tool in TOOLS:
        require(tool, found=shutil.which(tool, path=path) is not None)
    work = tmp_path / "deploy"
    work.mkdir()
    variables = {
        **_loopback_hosts(),
        "TURNOUT_SRC": str(REPO),
        "ETCD_ROOT_PASSWORD": "sk-turnout-test-etcd-root",
    }
    doc_shell = DocShell(work, _environment(), variables)
    try:
        yield doc_shell
    finally:
        doc_shell.close()


def _logs(directory: Path) -> str:
    """The tails of the processes' logs the steps wrote, for a failure message."""
    parts = []
    for log in sorted(directory.glob("*.log")):
        parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-2500:]}")
    return "\n".join(parts)


def test_page_tags_only_known_steps_in_order() -> None:
    steps = parse_steps(DOC.read_text())
    assert [step.name for step in steps] == list(STEP_DEADLINES)


def test_docs_deploy_runs_as_written(shell: DocShell) -> None:
    steps = parse_steps(DOC.read_text())
    unknown = [step.name for step in steps if step.name not in STEP_DEADLINES]
    assert steps, "docs/deploy.md has no block tagged doc-step"
    assert not unknown, f"steps without a deadline in this test: {unknown}"
    for number, step in enumerate(steps, start=1):
        try:
            shell.run(number, step, STEP_DEADLINES[step.name])
        except DocStepError as exc:
            pytest.fail(f"{exc}\n{_logs(shell.cwd)}", pytrace=False)
    left = shell.leftover_processes()
    assert not left, f"the page's steps left processes running: {[p.cmdline() for p in left]}"


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``""`` -> the top-level parser, and each subcommand's name -> its parser."""
    found = {"": parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def test_every_turnout_line_of_the_page_names_real_flags() -> None:
    """The examples too (attach beside vLLM, the NATS settings): each ``--flag`` of a
    ``turnout`` command line is one its subcommand takes."""
    parsers = _options(build_parser())
    commands = bash_commands(DOC.read_text(), "turnout")
    assert len(commands) > 10
    for line, words in commands:
        command = words[1] if len(words) > 1 and words[1] in parsers else ""
        known = {o for a in parsers[command]._actions for o in a.option_strings}
        flags = [w.split("=", 1)[0] for w in words[1:] if w.startswith("--")]
        unknown = [flag for flag in flags if flag not in known]
        assert not unknown, f"docs line {line}: `turnout {command}` takes no {unknown}"


def test_bash_commands_joins_lines_and_stops_at_operators() -> None:
    text = (
        '```bash\nturnout worker --a 1 \\\n  --b "x y" >log 2>&1 &  # note\n'
        "echo turnout --c\nturnout status | jq --d\n```\n"
    )
    assert bash_commands(text, "turnout") == [
        (2, ["turnout", "worker", "--a", "1", "--b", "x y"]),
        (5, ["turnout", "status"]),
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("```bash doc-stp=x\necho\n```\n", "unknown fence tag"),
        ("```bash doc-step=\necho\n```\n", "unknown fence tag"),
        ("```bash doc-step=a doc-step=b\necho\n```\n", "unknown fence tag"),
        ("```yaml doc-step=a\nk: v\n```\n", "only bash blocks"),
        ("```bash doc-step=a\n```\n```bash doc-step=a\n```\n", "tagged twice"),
        ("```bash doc-step=a\necho\n", "never closed"),
    ],
)
def test_malformed_tags_are_refused(text: str, error: str) -> None:
    with pytest.raises(DocStepError, match=error):
        parse_steps(text)


def test_untagged_blocks_are_examples() -> None:
    text = "```bash\nrm -rf /\n```\n\n```bash doc-step=one\necho 1\n```\n"
    assert parse_steps(text) == [DocStep("one", "echo 1\n", 5)]


def test_a_failing_step_names_itself(tmp_path: Path) -> None:
    doc_shell = DocShell(tmp_path, dict(os.environ))
    try:
        steps = parse_steps(
            "```bash doc-step=ok\nA=1\n```\n```bash doc-step=bad\necho $A; false\n```\n"
        )
        assert doc_shell.run(1, steps[0], 10) == []
        with pytest.raises(DocStepError, match=r"step 'bad' \(docs line 4\) failed.*\n1$"):
            doc_shell.run(2, steps[1], 10)
    finally:
        doc_shell.close()


def test_background_processes_are_killed_on_close(tmp_path: Path) -> None:
    doc_shell = DocShell(tmp_path, dict(os.environ))
    try:
        step = DocStep("sleepers", "sleep 300 &\nsetsid sleep 300 &\n", 1)
        doc_shell.run(1, step, 10)
        assert len(doc_shell.leftover_processes()) == 2
    finally:
        doc_shell.close()
    assert doc_shell.leftover_processes() == []
