"""Flags with environment defaults: every ``--some-flag`` reads ``TURNOUT_SOME_FLAG``."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any


def env_name(flag: str) -> str:
    return "TURNOUT_" + flag.lstrip("-").upper().replace("-", "_")


def add_flag(
    parser: argparse.ArgumentParser | Any, flag: str, *, default: Any = None, **kwargs: Any
) -> None:
    """``parser.add_argument`` whose default comes from the flag's environment variable."""
    env = env_name(flag)
    value = os.environ.get(env)
    if value is not None:
        if kwargs.get("action") == "store_true":
            default = value.strip().lower() in ("1", "true", "yes", "on")
        else:
            conv = kwargs.get("type", str)
            try:
                default = conv(value)
            except (TypeError, ValueError) as exc:
                raise SystemExit(f"turnout: bad value {value!r} in ${env}: {exc}") from None
    help_text = kwargs.pop("help", "")
    kwargs["help"] = f"{help_text} [env {env}]" + (
        f" (default: {default})" if default is not None and default is not False else ""
    )
    parser.add_argument(flag, default=default, **kwargs)


def add_runtime_flags(parser: argparse.ArgumentParser, *, planes: bool = True) -> None:
    """Discovery, planes, leases, logs. ``planes=False`` (``serve``, which always runs the
    file store, tcp and zmq) keeps only the settings that still mean something there."""
    if planes:
        add_flag(parser, "--store", default="file", choices=["memory", "file"],
                 help="discovery store")  # fmt: skip
    add_flag(parser, "--store-path", help="file store location (default: a per-user temp path)")
    if planes:
        add_flag(parser, "--request-plane", default="tcp", choices=["tcp", "local"],
                 help="request plane between frontend and workers")  # fmt: skip
        add_flag(parser, "--event-plane", choices=["local", "zmq"],
                 help="KV events and load reports (default: local on the memory store, "
                      "else zmq)")  # fmt: skip
    add_flag(parser, "--lease-ttl", default=10.0, type=float,
             help="seconds a dead process's registrations outlive it")  # fmt: skip
    add_flag(parser, "--log-level", default="info",
             choices=["debug", "info", "warning", "error"], help="log level")  # fmt: skip


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s pid=%(process)d %(message)s",
    )
