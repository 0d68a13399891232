"""The TTFT cost against hand-computed cases; the block cost unchanged; sessions as a soft
preference; cache salts partitioning the index."""

from __future__ import annotations

import random

import pytest

from turnout.protocols.block_hashing import compute_block_hashes
from turnout.protocols.kv import BlockStored, KvCacheEvent, LoadReport, StepSample, StoredBlock
from turnout.router.kv.active_sequences import ActiveSequences
from turnout.router.kv.base import OverlapScores, WorkerKey
from turnout.router.kv.config import KvRouterConfig, RouterCost
from turnout.router.kv.core import KvRouterCore
from turnout.router.kv.selector import select_worker
from turnout.router.kv.sessions import SessionTable
from turnout.router.kv.step_time import StepTimeModels

BS = 16
A, B, C = WorkerKey(1), WorkerKey(2), WorkerKey(3)


def overlaps(scores: dict[WorkerKey, int]) -> OverlapScores:
    return OverlapScores(scores=dict(scores), num_blocks=max(scores.values(), default=0))


def linear_models(budget: int = 100_000) -> StepTimeModels:
    """Workers whose steps take 1 ms + 1 µs per token (fitted from exact reports, so within
    the prior's small pull)."""
    models = StepTimeModels()
    for key in (A, B, C):
        steps = [StepSample(p, 0, 0.001 + p * 1e-6) for p in range(16, 8000, 64)] * 4
        models.on_load(
            LoadReport(worker_id=key.worker_id, steps=steps, max_num_batched_tokens=budget)
        )
    return models


def test_ttft_cost_by_hand() -> None:
    models = linear_models()
    for key in (A, B):
        assert models.get(key).prefill_step_s(1000, 0) == pytest.approx(0.002, rel=0.02)
    active = ActiveSequences(block_size=BS)
    # A: 30 of 40 prompt blocks cached, but 3,000 tokens of prefill queued there.
    active.add_request("q", A, num_prompt_tokens=3000, overlap_blocks=0, now=0.0)
    config = KvRouterConfig(block_size=BS, router_cost=RouterCost.TTFT)
    sel = select_worker(
        [A, B], overlaps({A: 30}), active, 40, config, random.Random(0),
        num_tokens=640, step_models=models, explain=True,
    )  # fmt: skip
    rows = {row.worker_key: row for row in sel.candidates}
    # A: one step of 3,000 queued + 160 new tokens; B: one step of 640 tokens.
    assert rows[A].predicted_ttft_s == pytest.approx(0.001 + 3160e-6, rel=0.02)
    assert rows[B].predicted_ttft_s == pytest.approx(0.001 + 640e-6, rel=0.02)
    assert sel.worker_key == B and sel.cost is RouterCost.TTFT
    assert sel.predicted_ttft_s == rows[B].predicted_ttft_s
    # Without the queue, the cache wins: 160 tokens to compute against 640.
    idle = ActiveSequences(block_size=BS)
    sel = select_worker(
        [A, B], overlaps({A: 30}), idle, 40, config, random.Random(0),
        num_tokens=640, step_models=models,
    )  # fmt: skip
    assert sel.worker_key == A


def test_ttft_cost_counts_decodes_riding_along() -> None:
    models = StepTimeModels()
    active = ActiveSequences(block_size=BS)
    for i in range(50):  # 50 requests decoding on A
        active.add_request(f"d{i}", A, num_prompt_tokens=16, overlap_blocks=0, now=0.0)
        active.mark_prefill_done(f"d{i}")
    config = KvRouterConfig(block_size=BS)
    sel = select_worker(
        [A, B], overlaps({}), active, 4, config, random.Random(0),
        num_tokens=64, step_models=models, explain=True,
    )  # fmt: skip
    rows = {row.worker_key: row for row in sel.candidates}
    model = models.get(A)
    assert rows[A].predicted_ttft_s == pytest.approx(model.prefill_step_s(64, 50))
    assert rows[B].predicted_ttft_s == pytest.approx(model.prefill_step_s(64, 0))
    assert sel.worker_key == B


def _old_block_choice(
    candidates: list[WorkerKey],
    scores: dict[WorkerKey, int],
    active: ActiveSequences,
    new_blocks: int,
    weight: float,
    rng: random.Random,
) -> tuple[WorkerKey, list[float]]:
    """The block cost as it was before the TTFT cost existed (Dynamo's formula)."""
    costs = []
    for key in candidates:
        counters = active.counters.get(key)
        prefill_blocks = -(-counters.prefill_tokens // BS) if counters else 0
        decode_blocks = counters.decode_blocks if counters else 0
        prefill = max(prefill_blocks + new_blocks - scores.get(key, 0), 0)
        costs.append(weight * prefill + decode_blocks + new_blocks)
    lowest = min(costs)
    tied = [i for i, c in enumerate(costs) if c == lowest]
    chosen = tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]
    return candidates[chosen], costs


@pytest.mark.parametrize("weight", [0.0, 1.0, 4.0])
def test_blocks_cost_keeps_the_old_decisions_exactly(weight: float) -> None:
    setup = random.Random(42)
    config = KvRouterConfig(block_size=BS, router_cost=RouterCost.BLOCKS,
                            overlap_score_weight=weight)  # fmt: skip
    models = linear_models()
    for case in range(300):
        keys = [WorkerKey(i) for i in range(setup.randrange(1, 6))]
        active = ActiveSequences(block_size=BS)
        for n in range(setup.randrange(0, 12)):
            active.add_request(
                f"{case}-{n}", setup.choice(keys), num_prompt_tokens=setup.randrange(1, 900),
                overlap_blocks=setup.randrange(0, 4), now=0.0,
            )  # fmt: skip
        scores = {k: setup.randrange(0, 20) for k in keys if setup.random() < 0.6}
        new_blocks = setup.randrange(1, 30)
        seed = setup.randrange(1 << 30)
        expected, costs = _old_block_choice(
            keys, scores, active, new_blocks, weight, random.Random(seed)
        )
        sel = select_worker(
            keys, overlaps(scores), active, new_blocks, config, random.Random(seed),
            step_models=models, num_tokens=new_blocks * BS, explain=True,
        )  # fmt: skip
        assert sel.worker_key == expected
        assert [row.cost for row in sel.candidates] == costs
        assert all(row.predicted_ttft_s is None for row in sel.candidates)


def test_session_preference_breaks_near_ties_and_yields_under_load() -> None:
    models = linear_models()
    config = KvRouterConfig(block_size=BS, session_weight=1.0)
    idle = ActiveSequences(block_size=BS)
    # Equal workers: without a session the choice is random; with one, it is the session's.
    chosen = {
        select_worker(
            [A, B, C],
            overlaps({}),
            idle,
            8,
            config,
            random.Random(seed),
            num_tokens=128,
            step_models=models,
            preferred=B,
        ).worker_key
        for seed in range(20)
    }
    assert chosen == {B}
    # B now has 2,000 tokens of prefill queued: 2 ms more than the others, far more than the
    # bonus (one 16-token step, about 1 ms): the session moves.
    busy = ActiveSequences(block_size=BS)
    busy.add_request("x", B, num_prompt_tokens=2000, overlap_blocks=0, now=0.0)
    sel = select_worker(
        [A, B, C], overlaps({}), busy, 8, config, random.Random(0),
        num_tokens=128, step_models=models, preferred=B, explain=True,
    )  # fmt: skip
    assert sel.worker_key != B and sel.preferred_worker_id == B.worker_id
    rows = {row.worker_key: row for row in sel.candidates}
    assert rows[B].session_bonus == pytest.approx(models.get(B).prefill_step_s(BS, 0))
    # Weight 0 turns the preference off.
    off = KvRouterConfig(block_size=BS, session_weight=0.0)
    picks = {
        select_worker(
            [A, B, C],
            overlaps({}),
            idle,
            8,
            off,
            random.Random(seed),
            num_tokens=128,
            step_models=models,
            preferred=B,
        ).worker_key
        for seed in range(30)
    }
    assert picks == {A, B, C}


def test_core_remembers_sessions_and_frees_them_with_the_worker() -> None:
    core = KvRouterCore(KvRouterConfig(block_size=BS), rng=random.Random(3))
    tokens = list(range(1000, 1128))
    first = core.route("r1", tokens, [A, B, C], session_id="s1", now=1.0)
    assert first.preferred_worker_id is None
    for i in range(5):
        sel = core.route(f"r{i + 2}", tokens, [A, B, C], session_id="s1", now=2.0 + i)
        core.on_finished(f"r{i + 2}")
        assert sel.worker_key == first.worker_key
        assert sel.preferred_worker_id == first.worker_id
    assert first.worker_id is not None
    core.on_worker_removed(first.worker_id)
    sel = core.route("r9", tokens, [k for k in (A, B, C) if k != first.worker_key],
                     session_id="s1", now=20.0)  # fmt: skip
    assert sel.preferred_worker_id is None


def test_session_table_bounds() -> None:
    table = SessionTable(ttl_s=10.0, max_sessions=3)
    for i in range(5):
        table.record(f"s{i}", WorkerKey(i), now=float(i))
    assert len(table) == 3 and table.get("s0", 5.0) is None and table.get("s4", 5.0) == (4, 0)
    assert table.get("s2", 12.5) is None  # 10.5 s after its last turn
    table.record("s9", WorkerKey(9), now=100.0)  # the stale ones go on the next record
    assert len(table) == 1
    table.remove_worker(9)
    assert table.get("s9", 100.0) is None
    with pytest.raises(ValueError):
        SessionTable(ttl_s=0, max_sessions=1)


def _stored(worker: WorkerKey, event_id: int, tokens: list[int], salt: str | None) -> KvCacheEvent:
    local, seq = compute_block_hashes(tokens, BS, cache_salt=salt)
    blocks = [StoredBlock(s, loc, BS) for s, loc in zip(seq, local, strict=True)]
    return KvCacheEvent(
        worker_id=worker.worker_id, event_id=event_id,
        data=BlockStored(parent_hash=None, blocks=blocks),
    )  # fmt: skip


@pytest.mark.parametrize("cost", list(RouterCost))
def test_cache_salts_partition_the_index(cost: RouterCost) -> None:
    core = KvRouterCore(KvRouterConfig(block_size=BS, router_cost=cost), rng=random.Random(0))
    tokens = list(range(2000, 2320))  # 20 blocks
    core.on_kv_event(_stored(A, 0, tokens, "tenant-a"))
    own = core.route("a", tokens, [A, B], cache_salt="tenant-a", book=False)
    assert (own.worker_key, own.overlap_blocks) == (A, 20)
    other = core.route("b", tokens, [A, B], cache_salt="tenant-b", book=False, explain=True)
    assert all(row.overlap_blocks == 0 for row in other.candidates)
    unsalted = core.route("c", tokens, [A, B], book=False, explain=True)
    assert all(row.overlap_blocks == 0 for row in unsalted.candidates)


def test_itl_weight_counts_the_delay_inflicted_on_decoding_requests() -> None:
    models = linear_models()
    active = ActiveSequences(block_size=BS)
    for i in range(20):  # 20 requests decoding on A; none on B, but 10,000 tokens queued
        active.add_request(f"d{i}", A, num_prompt_tokens=16, overlap_blocks=0, now=0.0)
        active.mark_prefill_done(f"d{i}")
    active.add_request("q", B, num_prompt_tokens=10_000, overlap_blocks=0, now=0.0)

    def pick(weight: float) -> tuple[WorkerKey | None, dict[WorkerKey, object]]:
        config = KvRouterConfig(block_size=BS, itl_weight=weight)
        sel = select_worker(
            [A, B], overlaps({}), active, 64, config, random.Random(0),
            num_tokens=1024, step_models=models, explain=True,
        )  # fmt: skip
        return sel.worker_key, {row.worker_key: row for row in sel.candidates}

    chosen, rows = pick(0.0)
    assert chosen == A  # B's queue makes its first token later
    assert rows[A].inflicted_delay_s is None  # type: ignore[attr-defined]
    chosen, rows = pick(1.0)
    inflicted = rows[A].inflicted_delay_s  # type: ignore[attr-defined]
    assert inflicted == pytest.approx(20 * models.get(A).predict_ttft(0, 1024, 20))
    assert rows[A].cost == pytest.approx(rows[A].predicted_ttft_s + inflicted)  # type: ignore[attr-defined]
    assert chosen == B  # 20 requests would each wait through this prefill on A
