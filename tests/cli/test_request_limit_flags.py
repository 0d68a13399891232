"""The request-limit flags reach ``FrontendConfig.limits``, for ``frontend`` and ``serve``,
from the command line or ``TURNOUT_*``; a bound below 1 stops the command."""

from __future__ import annotations

import pytest

from turnout.cli.frontend import frontend_config
from turnout.cli.main import build_parser
from turnout.errors import ConfigError
from turnout.llm.limits import RequestLimits


@pytest.mark.parametrize("command", ["frontend", "serve"])
def test_defaults(command: str) -> None:
    cfg = frontend_config(build_parser().parse_args([command]))
    assert cfg.limits == RequestLimits()


@pytest.mark.parametrize("command", ["frontend", "serve"])
def test_flags_and_environment(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNOUT_MAX_MESSAGES", "50")
    args = build_parser().parse_args(
        [command, "--max-stop-strings", "4", "--max-stop-string-chars", "32",
         "--max-stop-token-ids", "8", "--max-tools", "3", "--max-tools-chars", "999",
         "--max-choices", "2", "--max-response-items", "4096"]
    )  # fmt: skip
    assert frontend_config(args).limits == RequestLimits(
        max_stop_strings=4,
        max_stop_string_chars=32,
        max_stop_token_ids=8,
        max_messages=50,
        max_tools=3,
        max_tools_chars=999,
        max_choices=2,
        max_response_items=4096,
    )


def test_a_bound_below_one_is_refused() -> None:
    args = build_parser().parse_args(["frontend", "--max-response-items", "0"])
    with pytest.raises(ConfigError, match="--max-response-items"):
        frontend_config(args)
