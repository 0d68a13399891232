"""The output-parser benchmark runs, and every case that holds calls finds both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_runs_and_finds_the_calls(tmp_path: Path) -> None:
    out = tmp_path / "parsers.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/output_parsers.py"), "--rounds", "2",
         "--out", str(out)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 10
    calls = {r["case"]: r["calls_per_response"] for r in rows}
    assert all(n == 2 for case, n in calls.items() if "calls" in case)
    assert all(r["us_per_token"] > 0 for r in rows)
