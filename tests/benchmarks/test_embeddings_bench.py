"""The embeddings benchmark runs end to end (model directly, then ``turnout serve``) and
writes a row per batch size and client count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "embeddings.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/embeddings.py"), "--seconds", "0.3",
         "--batches", "1", "4", "--concurrency", "2", "--threads", "1", "--out", str(out)],
        check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["concurrency"]) for r in rows] == [(1, 1), (1, 2), (4, 1), (4, 2)]
    assert all(r["served"]["sentences_per_s"] > 0 and r["ratio"] > 0 for r in rows)
    assert (tmp_path / "embeddings.png").exists()
