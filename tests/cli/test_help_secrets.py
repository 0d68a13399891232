"""``--help`` shows each flag's default, read from its environment variable: never a secret."""

from __future__ import annotations

import argparse

import pytest

from turnout.cli.flags import add_runtime_flags

SECRET = "sk-turnout-test-help-secret"


def test_help_never_shows_secrets_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNOUT_STORE_PASSWORD", SECRET)
    monkeypatch.setenv("TURNOUT_NATS_PASSWORD", SECRET)
    monkeypatch.setenv("TURNOUT_NATS_TOKEN", SECRET)
    monkeypatch.setenv(
        "TURNOUT_NATS_URL", f"nats://turnout:{SECRET}@nats-1:4222,nats://nats-2:4222"
    )
    p = argparse.ArgumentParser()
    add_runtime_flags(p)
    text = p.format_help()
    assert SECRET not in text
    assert "nats://turnout:***@nats-1:4222" in text  # the URL itself still shows
    args = p.parse_args([])
    assert args.store_password == SECRET and args.nats_token == SECRET  # still read
