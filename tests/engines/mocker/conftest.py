"""Fixtures shared by the mocker's engine-level tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from turnout.engines.mocker import MockerEngine


@pytest.fixture
async def engines() -> AsyncIterator[list[MockerEngine]]:
    """Engines a test creates; stopped, and checked for leaked tasks, afterwards."""
    before = asyncio.all_tasks()
    made: list[MockerEngine] = []
    yield made
    for engine in made:
        await engine.stop()
    for _ in range(3):
        await asyncio.sleep(0)
    current = asyncio.current_task()
    leaked = [t for t in asyncio.all_tasks() - before if not t.done() and t is not current]
    for task in leaked:
        task.cancel()
    assert not leaked, f"tasks left running: {[t.get_name() for t in leaked]}"
