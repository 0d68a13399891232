"""Wait for a state, not for a time: poll a predicate under a deadline.

Tests use these instead of a fixed ``sleep`` that hopes an event has arrived: on a loaded
machine a fixed sleep is either too short (a flake) or longer than needed everywhere.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(
    predicate: Callable[[], object],
    *,
    timeout: float = 10.0,
    interval: float = 0.01,
    what: str = "",
) -> None:
    """Return once ``predicate()`` is truthy; fail the test after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() >= deadline:
            raise AssertionError(f"not reached within {timeout} s: {what or predicate}")
        await asyncio.sleep(interval)


def eventually_sync(
    predicate: Callable[[], object],
    *,
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str = "",
) -> None:
    """``eventually`` for tests outside an event loop (processes, threads)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not reached within {timeout} s: {what or predicate}")
        time.sleep(interval)
