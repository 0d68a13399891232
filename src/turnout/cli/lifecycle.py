"""How every ``turnout`` command runs: logging, the uvloop loop, signals, and clean errors.

A command's ``run(args)`` is ``run_command(args, main)`` (with the process's tracing set up
from ``--otlp-endpoint``, and flushed at exit): ``main`` is a coroutine function
that usually ends in ``run_until_signal``. A ``TurnoutError`` (bad flag value, bad
combination, a start-up failure we understand) becomes one log line and exit status 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import uvloop

from turnout.errors import TurnoutError
from turnout.runtime.asyncio_logs import quiet_asyncio
from turnout.runtime.tracing import configure_tracing, shutdown_tracing

from .flags import setup_logging

log = logging.getLogger("turnout.cli")

Step = Callable[[], Awaitable[object]]


def run_command(args: argparse.Namespace, main: Callable[[], Coroutine[Any, Any, None]]) -> int:
    setup_logging(
        args.log_level,
        log_format=getattr(args, "log_format", "text"),
        log_prompts=getattr(args, "log_prompts", False),
    )
    quiet_asyncio()
    try:
        service = f"turnout-{getattr(args, 'command', None) or 'process'}"
        configure_tracing(getattr(args, "otlp_endpoint", None), service)
        uvloop.run(main())
    except TurnoutError as exc:
        log.error("%s", exc)
        return 2
    finally:
        shutdown_tracing()  # exports what is queued, within tracing.EXIT_FLUSH_S
    return 0


async def run_until_signal(start: Step, stop: Step, wait: Step, drain: Step | None = None) -> None:
    """Start, then run until SIGINT/SIGTERM or until ``wait()`` returns; always stop. An
    exception from ``wait()`` is raised after stopping (a ``TurnoutError``: exit 2).

    ``drain``: run on the first signal, before ``stop`` (a frontend lets the requests in
    flight finish); a second signal cuts it short and stops at once."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    again = asyncio.Event()

    def on_signal() -> None:
        (again if stopping.is_set() else stopping).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await start()
        waiter = asyncio.ensure_future(wait())
        stopper = asyncio.ensure_future(stopping.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if waiter.done() and not waiter.cancelled():
            waiter.result()  # a failure of what we waited on is the command's failure
        if drain is not None:
            await _drain(drain, again, waiter)
        waiter.cancel()
    finally:
        await stop()


async def _drain(drain: Step, again: asyncio.Event, waiter: asyncio.Future[Any]) -> None:
    """Run ``drain`` until it ends, ``again`` is set (a second signal) or ``waiter`` ends;
    a drain that fails is logged: stopping goes on."""
    drainer = asyncio.ensure_future(drain())
    interrupt = asyncio.ensure_future(again.wait())
    watched: set[asyncio.Future[Any]] = {drainer, interrupt, waiter}
    await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
    interrupt.cancel()
    if not drainer.done():
        if again.is_set():
            log.info("second signal: stopping now")
        drainer.cancel()
    await asyncio.wait([drainer])
    if not drainer.cancelled() and drainer.exception() is not None:
        log.error("drain failed; stopping: %s", drainer.exception())
