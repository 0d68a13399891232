"""The command line: bad flags and bad settings fail at start-up with a clear message."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from turnout.cli.flags import env_name
from turnout.cli.main import build_parser
from turnout.protocols.model import MDC_ROOT, ModelDeploymentCard
from turnout.runtime.discovery import FileStore


def run(
    *args: str, tmp: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnout", *args, "--store-path", str(tmp / "s.sqlite")],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["worker", "--bogus"], "unrecognized arguments: --bogus"),
        (["worker", "--engine", "mocker", "--block-size", "0"], "block_size must be a positive"),
        (["worker", "--engine", "mocker", "--num-gpu-blocks", "999999999999"], "bookkeeping"),
        (["worker", "--engine", "nope"], "invalid choice: 'nope'"),
        (["frontend", "--router-mode", "magic"], "unknown router mode 'magic'"),
        (
            ["frontend", "--router-mode", "device-aware-weighted", "--router-cpu-gpu-ratio", "0"],
            "--router-cpu-gpu-ratio must be an integer >= 1, got 0",
        ),
        (["worker", "--device-type", "tpu"], "invalid choice: 'tpu'"),
        (["worker", "--role", "prefill"], "only the mocker engine runs disaggregated roles"),
        (
            ["worker", "--engine", "mocker", "--role", "decode", "--kv-transfer", "push"],
            "--kv-transfer push is a prefill worker's setting",
        ),
        (["worker", "--engine", "mocker", "--kv-transfer-bandwidth", "0"], "bandwidth_gbps"),
        (["worker", "--endpoint", "just-one-part"], "namespace/component/endpoint"),
        (
            ["worker", "--engine", "mocker", "--tool-call-parser", "hermez"],
            "unknown tool-call parser 'hermez' (known: deepseek_v3, harmony, hermes, ",
        ),
        (
            ["worker", "--reasoning-parser", "r2"],
            "unknown reasoning parser 'r2' (known: deepseek_r1, harmony, qwen3)",
        ),
        (
            ["frontend", "--store", "etcd", "--store-endpoints", "http://127.0.0.1:1"],
            "cannot reach etcd at",
        ),
        (["status", "--store", "etcd", "--store-endpoints", "http://127.0.0.1:1"], "127.0.0.1:1"),
        (
            ["worker", "--request-plane", "nats", "--nats-url", "nats://127.0.0.1:1"],
            "cannot reach NATS at",
        ),
        (
            ["frontend", "--event-plane", "nats", "--nats-url", "nats://127.0.0.1:1"],
            "nats://127.0.0.1:1",
        ),
        (
            ["worker", "--bind-host", "0.0.0.0", "--advertise-host", "0.0.0.0"],
            "--advertise-host must be an address others can dial",
        ),
    ],
)
def test_bad_settings_fail_clearly(args: list[str], words: str, tmp_path: Path) -> None:
    out = run(*args, tmp=tmp_path)
    assert out.returncode == 2, out
    assert words in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_every_flag_has_an_environment_variable() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():  # type: ignore[union-attr]
        for action in command._actions:
            flag = next((o for o in action.option_strings if o.startswith("--")), None)
            if flag in (None, "--help"):
                continue
            assert env_name(flag) in (action.help or ""), f"{name} {flag}"


def test_environment_sets_a_default(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "TURNOUT_ROUTER_MODE": "magic"}
    out = run("frontend", tmp=tmp_path, env=env)
    assert out.returncode == 2
    assert "unknown router mode 'magic'" in out.stderr


def test_readme_documents_every_flag() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    missing = []
    for name, command in sub.choices.items():  # type: ignore[union-attr]
        assert f"turnout {name}" in readme, name
        for action in command._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help" and f"`{flag}" not in readme:
                    missing.append(f"{name} {flag}")
    assert not missing, f"README lacks: {missing}"


@pytest.mark.slow
def test_the_worker_command_announces_its_parsers_in_the_card(tmp_path: Path) -> None:
    """Read back from the store by another process, as a frontend would."""
    store = tmp_path / "s.sqlite"
    worker = subprocess.Popen(
        [sys.executable, "-m", "turnout", "worker", "--engine", "mocker", "--model-name", "m",
         "--tool-call-parser", "mistral", "--reasoning-parser", "deepseek_r1",
         "--store", "file", "--store-path", str(store), "--log-level", "warning"],
    )  # fmt: skip

    async def cards() -> list[ModelDeploymentCard]:
        s = FileStore(store)
        try:
            kvs = await s.get_prefix(f"{MDC_ROOT}/")
        finally:
            await s.close()
        return [msgspec.json.decode(kv.value, type=ModelDeploymentCard) for kv in kvs]

    try:
        deadline = time.monotonic() + 60
        while not (found := asyncio.run(cards())):
            assert worker.poll() is None, "the worker exited"
            assert time.monotonic() < deadline, "no card within a minute"
            time.sleep(0.2)
        caps = found[0].capabilities
        assert (caps.tool_call_parser, caps.reasoning_parser) == ("mistral", "deepseek_r1")
    finally:
        worker.terminate()
        worker.wait(timeout=30)
