"""Fixtures for the attach engine's tests; every test is checked for leftover tasks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest


@pytest.fixture(autouse=True)
async def no_leaks() -> AsyncIterator[None]:
    """Fail a test that leaves a task running (a subscriber or publisher not stopped)."""
    yield
    for _ in range(5):
        await asyncio.sleep(0)
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    assert not tasks, f"tasks left running: {tasks}"
