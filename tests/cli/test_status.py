"""``turnout status``: what the store holds, read by a separate process, as text and JSON."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from turnout.runtime.discovery import FileStore

pytestmark = pytest.mark.slow


def status(store: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnout", "status", "--store", "file", "--store-path",
         str(store), "--log-level", "warning", *extra],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_status_lists_models_and_instances_with_address_and_load(tmp_path: Path) -> None:
    store = tmp_path / "s.sqlite"
    empty = status(store, "--load-wait", "0")
    assert empty.returncode == 0, empty.stderr
    assert "nothing registered" in empty.stdout

    worker = subprocess.Popen(
        [sys.executable, "-m", "turnout", "worker", "--engine", "mocker", "--num-workers", "2",
         "--model-name", "mock", "--endpoint", "team/backend/generate", "--speedup-ratio", "0",
         "--store", "file", "--store-path", str(store), "--log-level", "warning"],
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            out = status(store, "--json", "--load-wait", "2.5")
            assert out.returncode == 0, out.stderr
            doc = json.loads(out.stdout)
            space = doc["namespaces"].get("team", {"instances": []})
            if len(space["instances"]) == 2 and all("load" in i for i in space["instances"]):
                break
            assert time.monotonic() < deadline, out.stdout
        assert doc["store"] == "file"
        model = space["models"]["mock"]
        assert model["types"] == "Chat|Completions" and model["input"] == "tokens"
        ids = sorted(i["id"] for i in space["instances"])
        assert sorted(model["instances"]) == ids
        for row in space["instances"]:
            assert row["endpoint"] == "team/backend/generate"
            assert row["transport"] == "tcp" and row["address"].startswith("127.0.0.1:")
            assert row["load"]["running"] == 0 and row["load"]["kv_usage"] == 0

        # A malformed record is shown as skipped, not fatal.
        async def put_garbage() -> None:
            s = FileStore(store)
            await s.put("v1/instances/team/backend/generate/zz", b"{not json")
            await s.close()

        asyncio.run(put_garbage())
        text = status(store, "--load-wait", "0")
        assert text.returncode == 0, text.stderr
        assert "model mock" in text.stdout and text.stdout.count("instance ") == 2
        assert "skipped v1/instances/team/backend/generate/zz" in text.stdout
    finally:
        worker.terminate()
        worker.wait(timeout=30)
