"""``turnout serve --in-process`` refuses the plane credential flags: its planes are in memory,
so ``--plane-ca/--plane-cert/--plane-key`` would be silently ignored."""

from __future__ import annotations

import pytest

from turnout.cli.main import build_parser
from turnout.cli.serve_in_process import IN_PROCESS_PLANES, InProcessServe
from turnout.errors import ConfigError


def in_process(*extra: str) -> InProcessServe:
    return InProcessServe(
        build_parser().parse_args(["serve", "--engine", "mocker", "--in-process", *extra])
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--plane-ca", "ca.pem"), "--plane-ca: "),
        (
            ("--plane-ca", "ca.pem", "--plane-cert", "c.pem", "--plane-key", "k.pem"),
            "--plane-ca, --plane-cert, --plane-key: ",
        ),
        (("--plane-key", "k.pem"), "--plane-key: "),
    ],
)
def test_plane_credentials_are_refused_in_process(flags: tuple[str, ...], named: str) -> None:
    with pytest.raises(ConfigError) as refused:
        in_process(*flags)
    message = str(refused.value)
    assert message.startswith(named), message
    assert "in-process serving opens no plane" in message


def test_in_process_serving_without_them_has_its_in_memory_planes() -> None:
    assert in_process().config.planes == IN_PROCESS_PLANES
