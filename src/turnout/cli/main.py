"""Entry point of the ``turnout`` command."""

from __future__ import annotations

import argparse
import sys

from turnout import __version__

from . import attach, frontend, mocker_server, planner, router, serve, status, worker


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turnout",
        description="A distributed LLM inference serving layer with an OpenAI-compatible API.",
    )
    parser.add_argument("--version", action="version", version=f"turnout {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.register(sub)
    frontend.register(sub)
    worker.register(sub)
    attach.register(sub)
    router.register(sub)
    planner.register(sub)
    mocker_server.register(sub)
    status.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
