"""Cost, tie-breaking, temperature sampling and busy workers in select_worker."""

from __future__ import annotations

import math
import random
from collections import Counter

import msgspec
import pytest

from turnout.errors import ConfigError
from turnout.protocols.kv import LoadReport
from turnout.router.kv.active_sequences import ActiveSequences
from turnout.router.kv.base import OverlapScores, WorkerKey
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.selector import (
    Selection,
    SelectionStatus,
    select_worker,
    softmax_probabilities,
)
from turnout.router.kv.worker_load import WorkerLoads

A, B, C, D = (WorkerKey(i) for i in range(4))


def make_active() -> ActiveSequences:
    return ActiveSequences(block_size=16)


def test_cost_terms_and_lowest_cost_wins() -> None:
    active = make_active()
    # A: 40 tokens to prefill (3 blocks), 10 decode blocks. B idle. C idle.
    active.add_request("x", A, num_prompt_tokens=160, overlap_blocks=0, now=0.0)
    active.add_request("y", A, num_prompt_tokens=40, overlap_blocks=0, now=0.0)
    active.mark_prefill_done("x")
    overlaps = OverlapScores({A: 8, B: 2}, num_blocks=8)
    config = KvRouterConfig(overlap_score_weight=2.0)
    sel = select_worker([A, B, C], overlaps, active, 10, config, random.Random(0), explain=True)
    rows = {row.worker_key: row for row in sel.candidates}
    # A: prefill = max(3 + 10 - 8, 0) = 5; decode = 13 + 10 = 23; cost = 2*5 + 23 = 33
    assert (rows[A].active_prefill_blocks, rows[A].active_decode_blocks) == (3, 13)
    assert (rows[A].prefill_blocks, rows[A].decode_blocks, rows[A].cost) == (5, 23, 33.0)
    # B: prefill = 10 - 2 = 8; decode = 10; cost = 26.  C: 2*10 + 10 = 30.
    assert rows[B].cost == 26.0
    assert rows[C].cost == 30.0
    assert sel.status is SelectionStatus.SELECTED
    assert (sel.worker_key, sel.overlap_blocks, sel.new_blocks) == (B, 2, 10)
    assert all(row.probability is None for row in sel.candidates)


def test_prefill_term_never_negative() -> None:
    overlaps = OverlapScores({A: 10}, num_blocks=10)
    sel = select_worker(
        [A], overlaps, make_active(), 4, KvRouterConfig(), random.Random(0), explain=True
    )
    assert sel.candidates[0].prefill_blocks == 0
    assert sel.candidates[0].cost == 4.0


def test_ties_are_spread_over_tied_workers() -> None:
    rng = random.Random(7)
    overlaps = OverlapScores({A: 3, B: 3, C: 3}, num_blocks=3)  # D has no overlap: costlier
    config = KvRouterConfig()
    picks = Counter(
        select_worker([A, B, C, D], overlaps, make_active(), 4, config, rng).worker_key
        for _ in range(600)
    )
    assert set(picks) == {A, B, C}
    assert min(picks.values()) > 120  # about 200 each


def test_temperature_follows_softmax() -> None:
    active = make_active()
    active.add_request("busy", C, num_prompt_tokens=160, overlap_blocks=0, now=0.0)
    overlaps = OverlapScores({A: 4, B: 2}, num_blocks=4)
    config = KvRouterConfig(router_temperature=0.5)
    rng = random.Random(3)
    n = 4000
    picks: Counter[WorkerKey | None] = Counter()
    first: Selection | None = None
    for _ in range(n):
        sel = select_worker([A, B, C], overlaps, active, 4, config, rng, explain=True)
        first = first or sel
        picks[sel.worker_key] += 1
    assert first is not None
    costs = [row.cost for row in first.candidates]  # C: (10 + 4) + (10 + 4)
    assert costs == [4.0, 6.0, 28.0]
    lo, hi = min(costs), max(costs)
    weights = [math.exp(-(c - lo) / (hi - lo) / 0.5) for c in costs]
    expected = [w / sum(weights) for w in weights]
    probs = [row.probability for row in first.candidates]
    assert probs == pytest.approx(expected)
    for key, p in zip([A, B, C], expected, strict=True):
        assert picks[key] / n == pytest.approx(p, abs=0.03)


def test_softmax_equal_costs_is_uniform_and_tiny_temperature_is_greedy() -> None:
    assert softmax_probabilities([5.0, 5.0], 1.0) == [0.5, 0.5]
    probs = softmax_probabilities([1.0, 2.0, 3.0], 1e-6)
    assert probs[0] == pytest.approx(1.0)


def test_busy_workers_are_left_out_until_their_report_goes_stale() -> None:
    config = KvRouterConfig(busy_kv_usage_threshold=0.9, busy_num_waiting_threshold=4)
    loads = WorkerLoads.from_config(config)
    assert loads.on_load(LoadReport(worker_id=0, kv_usage=0.95), now=0.0)  # A
    assert loads.on_load(LoadReport(worker_id=1, num_waiting=5), now=0.0)  # B
    assert not loads.on_load(LoadReport(worker_id=2, kv_usage=0.5, num_waiting=4), now=0.0)
    overlaps = OverlapScores({A: 9}, num_blocks=9)
    sel = select_worker(
        [A, B, C], overlaps, make_active(), 9, config, random.Random(0), loads=loads, now=1.0
    )
    assert sel.worker_key == C
    assert sel.busy == [A, B]
    sel = select_worker(
        [A, B], overlaps, make_active(), 9, config, random.Random(0), loads=loads, now=1.0
    )
    assert sel.status is SelectionStatus.ALL_BUSY
    assert sel.worker_key is None
    assert not sel.ok
    # Reports older than load_report_ttl_s (10 s) no longer count.
    sel = select_worker(
        [A, B], overlaps, make_active(), 9, config, random.Random(0), loads=loads, now=11.0
    )
    assert sel.worker_key == A
    # A fresh report below the thresholds clears busy at once.
    loads.on_load(LoadReport(worker_id=0, kv_usage=0.1), now=12.0)
    assert not loads.is_busy(A, 12.0)


def test_no_candidates() -> None:
    sel = select_worker(
        [], OverlapScores({}, 0), make_active(), 1, KvRouterConfig(), random.Random(0)
    )
    assert sel.status is SelectionStatus.NO_CANDIDATES


def test_selection_round_trips_through_json() -> None:
    config = KvRouterConfig(router_temperature=1.0)
    sel = select_worker(
        [A, B],
        OverlapScores({A: 1}, 1),
        make_active(),
        2,
        config,
        random.Random(0),
        request_id="req-1",
        explain=True,
    )
    wire = msgspec.json.encode(sel)
    back = msgspec.json.decode(wire, type=Selection)
    assert back == sel
    doc = msgspec.json.decode(wire)
    assert doc["status"] == "selected"
    assert {"overlap_blocks", "prefill_blocks", "decode_blocks", "cost", "probability"} <= set(
        doc["candidates"][0]
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"overlap_score_weight": -1.0},
        {"router_temperature": math.nan},
        {"approx_ttl_s": 0.0},
        {"busy_kv_usage_threshold": 1.5},
        {"busy_num_waiting_threshold": -1},
    ],
)
def test_bad_config_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        KvRouterConfig(**kwargs)  # type: ignore[arg-type]
