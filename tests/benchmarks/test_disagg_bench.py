"""The disaggregation benchmark's pieces (setups, trace, metrics parsing, chunk gaps) and a
real two-setup run on a few requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import disagg
from benchmarks import routing_quality as rq


def test_setups_split_the_same_workers() -> None:
    assert disagg.parse_setup("agg", 4) == disagg.Setup("agg", 0, 4)
    assert disagg.parse_setup("1:1", 4) == disagg.Setup("1:1", 2, 2)
    assert disagg.parse_setup("1:3", 4) == disagg.Setup("1:3", 1, 3)
    assert disagg.parse_setup("1:3", 8).prefill == 2
    for bad in ("1:2", "0:4", "x"):
        with pytest.raises(SystemExit):
            disagg.parse_setup(bad, 4)


def test_long_prompt_trace_is_unique_prompts_of_the_asked_size() -> None:
    trace = disagg.long_prompt_trace(20, 512, 16, seed=3)
    assert [r.input_length for r in trace.requests] == [512] * 20
    assert {r.output_length for r in trace.requests} == {16}
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    firsts = {int(trace.prompt_tokens(r)[0]) for r in trace.requests}
    assert len(firsts) > 15  # unique prompts: nothing to share
    assert not trace.has_sessions
    again = disagg.long_prompt_trace(20, 512, 16, seed=3)
    assert [r.arrival_s for r in again.requests] == arrivals


def test_disagg_counters_read_the_frontend_metrics() -> None:
    text = "\n".join([
        "# HELP turnout_disagg_requests_total Requests through each stage",
        'turnout_disagg_requests_total{model="m",stage="prefill"} 7.0',
        'turnout_disagg_requests_total{model="m",stage="decode"} 7.0',
        'turnout_disagg_local_total{model="m",reason="short_prompt"} 3.0',
        'turnout_disagg_stage_seconds_bucket{model="m",stage="prefill",le="0.1"} 2.0',
        'turnout_disagg_requests_created{model="m",stage="prefill"} 1796342897.87',
        'turnout_disagg_transfer_bytes_total{model="m"} 1024.0',
    ])  # fmt: skip
    counters = disagg.disagg_counters(text)
    assert counters["turnout_disagg_requests_total"] == {"prefill": 7.0, "decode": 7.0}
    assert counters["turnout_disagg_local_total"] == {"short_prompt": 3.0}
    assert counters["turnout_disagg_transfer_bytes_total"] == {"total": 1024.0}
    assert "turnout_disagg_stage_seconds_bucket" not in counters
    assert "turnout_disagg_requests_created" not in counters
    entry = {"summary": {"num_ok": 10}, "disagg": counters}
    assert disagg.disagg_share(entry) == pytest.approx(0.7)


def test_chunk_gaps_pool_the_gaps_of_successful_requests() -> None:
    ok = rq.RequestResult(0, chunk_times=[0.1, 0.2, 0.5])
    failed = rq.RequestResult(1, chunk_times=[0.1, 9.0], error="boom")
    assert rq.chunk_gaps([ok, failed]) == pytest.approx([0.1, 0.3])


@pytest.mark.slow
def test_a_small_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    report = disagg.main([
        "--traces", "long", "--setups", "agg", "1:1", "--workers", "2", "--requests", "6",
        "--isl", "1024", "--osl", "8", "--speedup-ratio", "4", "--prefill-min-tokens", "256",
        "--out", str(out), "--plot", str(tmp_path / "d.png"),
    ])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    [block] = report["traces"]
    agg, split = block["setups"]
    assert (agg["prefill"], agg["decode"], split["prefill"], split["decode"]) == (0, 2, 1, 1)
    for entry in (agg, split):
        assert entry["summary"]["num_ok"] == 6, entry["summary"]["first_errors"]
        assert entry["summary"]["output_tokens"] == 6 * 8
    assert disagg.disagg_share(split) == 1.0
    transferred = split["disagg"]["turnout_disagg_transfer_bytes_total"]["total"]
    assert transferred == 6 * 1024 * 131072
    assert Path(report["plot"]).exists()
