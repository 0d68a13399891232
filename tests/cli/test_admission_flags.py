"""The admission flags reach ``FrontendConfig``, from the command line or ``TURNOUT_*``."""

from __future__ import annotations

import pytest

from turnout.cli.frontend import frontend_config
from turnout.cli.main import build_parser
from turnout.errors import ConfigError
from turnout.frontend.service import Frontend, FrontendConfig


def test_defaults() -> None:
    cfg = frontend_config(build_parser().parse_args(["frontend"]))
    assert (cfg.max_inflight, cfg.max_inflight_per_model) == (1024, 0)
    assert (cfg.queue_size, cfg.queue_timeout, cfg.reject_status) == (1024, 30.0, 503)


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNOUT_QUEUE_SIZE", "7")
    monkeypatch.setenv("TURNOUT_REJECT_STATUS", "529")
    args = build_parser().parse_args(
        ["frontend", "--max-inflight", "32", "--max-inflight-per-model", "4",
         "--queue-timeout", "2.5"]
    )  # fmt: skip
    cfg = frontend_config(args)
    assert (cfg.max_inflight, cfg.max_inflight_per_model) == (32, 4)
    assert (cfg.queue_size, cfg.queue_timeout, cfg.reject_status) == (7, 2.5, 529)


def test_reject_status_is_one_of_the_overload_statuses() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["frontend", "--reject-status", "500"])
    # The environment bypasses argparse's choices: the frontend checks again.
    with pytest.raises(ConfigError, match="--reject-status"):
        Frontend(FrontendConfig(reject_status=500))
    with pytest.raises(ConfigError, match="--max-inflight"):
        Frontend(FrontendConfig(max_inflight=-1))
