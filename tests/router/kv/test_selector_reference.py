"""``select_worker``'s inlined cost loop and its numpy table against a plain reference over
random router states: same worker, same cost, same draw among ties (one seeded rng each),
same busy list."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnout.protocols.kv import LoadReport, StepSample
from turnout.router.kv import active_sequences, step_time
from turnout.router.kv.active_sequences import ActiveSequences
from turnout.router.kv.base import MAX_CHANGED_WORKERS, OverlapScores, WorkerKey
from turnout.router.kv.config import KvRouterConfig, RouterCost
from turnout.router.kv.cost_table import CostTable
from turnout.router.kv.selector import Selection, SelectionStatus, _CostTerms, select_worker
from turnout.router.kv.step_time import StepTimeModels
from turnout.router.kv.worker_load import WorkerLoads

BS = 16


def reference_costs(
    keys: list[WorkerKey],
    scores: dict[WorkerKey, int],
    active: ActiveSequences,
    new_blocks: int,
    num_tokens: int,
    config: KvRouterConfig,
    models: StepTimeModels | None,
    preferred: WorkerKey | None,
) -> list[tuple[float, float | None]]:
    """(cost, predicted TTFT) per candidate, term by term as the selector's docstring says."""
    out: list[tuple[float, float | None]] = []
    for key in keys:
        overlap = scores.get(key, 0)
        load = active.get_load(key)
        counters = active.counters.get(key)
        decodes = 0 if counters is None else counters.num_requests - counters.prefill_requests
        bonus = preferred is not None and key == preferred and config.session_weight > 0
        if models is None:
            prefill = max(-(-load.active_prefill_tokens // BS) + new_blocks - overlap, 0)
            cost = config.overlap_score_weight * prefill + (load.active_decode_blocks + new_blocks)
            out.append((cost - config.session_weight if bonus else cost, None))
            continue
        model = models.get(key)
        new_tokens = num_tokens - overlap * BS
        predicted = model.predict_ttft(load.active_prefill_tokens, new_tokens, decodes)
        cost = predicted - (
            config.session_weight * model.prefill_step_s(BS, decodes) if bonus else 0
        )
        if config.itl_weight and decodes:
            cost += config.itl_weight * decodes * model.predict_ttft(0, new_tokens, decodes)
        out.append((cost, predicted))
    return out


def reference_choice(costs: list[float], temperature: float, rng: random.Random) -> int:
    lowest = min(costs)
    if temperature <= 0:
        tied = [i for i, c in enumerate(costs) if c == lowest]
        return tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]
    spread = max(costs) - lowest
    if spread <= 0:
        weights = [1.0] * len(costs)
    else:
        weights = [math.exp(-(c - lowest) / (spread * temperature)) for c in costs]
    total = math.fsum(weights)
    probabilities = [w / total for w in weights]
    r, acc = rng.random(), 0.0
    for i, p in enumerate(probabilities):
        acc += p
        if r < acc:
            return i
    return max(range(len(probabilities)), key=probabilities.__getitem__)


@st.composite
def router_states(draw: st.DrawFn) -> dict[str, object]:
    """A few workers (two ranks some), in-flight requests, overlaps, fitted models, busy
    reports and a config. Small token counts keep exact ties common."""
    num = draw(st.integers(1, 9))
    keys = [WorkerKey(i // 2 if draw(st.booleans()) else i + 100, i % 2) for i in range(num)]
    keys = list(dict.fromkeys(keys))
    active = ActiveSequences(block_size=BS)
    for n in range(draw(st.integers(0, 14))):
        active.add_request(
            f"r{n}",
            draw(st.sampled_from(keys)),
            num_prompt_tokens=draw(st.sampled_from([0, 16, 40, 300, 9000])),
            overlap_blocks=draw(st.integers(0, 3)),
            now=0.0,
        )
        if draw(st.booleans()):
            active.mark_prefill_done(f"r{n}")
    scores = {k: draw(st.integers(1, 40)) for k in keys if draw(st.integers(0, 2)) == 0}
    models = StepTimeModels()
    for key in keys:
        if draw(st.booleans()):
            per_token = draw(st.sampled_from([1e-6, 5e-6]))
            steps = [
                StepSample(p, d, 0.001 + p * per_token + d * 1e-5, 0.3)
                for p in (64, 512, 4096)
                for d in (0, 8)
            ]
            models.on_load(
                LoadReport(
                    worker_id=key.worker_id,
                    dp_rank=key.dp_rank,
                    steps=steps,
                    max_num_batched_tokens=draw(st.sampled_from([0, 1, 256, 8192])),
                )
            )
    loads = WorkerLoads(busy_kv_usage_threshold=0.5)
    for key in keys:
        if draw(st.integers(0, 4)) == 0:
            loads.on_load(
                LoadReport(worker_id=key.worker_id, dp_rank=key.dp_rank, kv_usage=0.9), 0.0
            )
    config = KvRouterConfig(
        block_size=BS,
        router_cost=draw(st.sampled_from(list(RouterCost))),
        overlap_score_weight=draw(st.sampled_from([0.0, 1.0, 2.5])),
        router_temperature=draw(st.sampled_from([0.0, 0.0, 0.7])),
        session_weight=draw(st.sampled_from([0.0, 1.0, 3.0])),
        itl_weight=draw(st.sampled_from([0.0, 0.0, 0.5])),
    )
    new_blocks = draw(st.integers(1, 60))
    return {
        "keys": keys,
        "active": active,
        "scores": scores,
        "models": models if draw(st.integers(0, 3)) else None,
        "loads": loads,
        "config": config,
        "new_blocks": new_blocks,
        "num_tokens": new_blocks * BS - draw(st.integers(0, BS - 1)),
        "preferred": draw(st.sampled_from([None, *keys])),
        "seed": draw(st.integers(0, 2**32)),
    }


@settings(max_examples=400, deadline=None)
@given(router_states())
def test_fast_selection_equals_the_reference(state: dict[str, object]) -> None:
    keys: list[WorkerKey] = state["keys"]  # type: ignore[assignment]
    active: ActiveSequences = state["active"]  # type: ignore[assignment]
    scores: dict[WorkerKey, int] = state["scores"]  # type: ignore[assignment]
    models: StepTimeModels | None = state["models"]  # type: ignore[assignment]
    loads: WorkerLoads = state["loads"]  # type: ignore[assignment]
    config: KvRouterConfig = state["config"]  # type: ignore[assignment]
    new_blocks: int = state["new_blocks"]  # type: ignore[assignment]
    num_tokens: int = state["num_tokens"]  # type: ignore[assignment]
    preferred: WorkerKey | None = state["preferred"]  # type: ignore[assignment]
    seed: int = state["seed"]  # type: ignore[assignment]

    busy = [k for k in keys if loads.is_busy(k, 1.0)]
    free = [k for k in keys if k not in busy]
    ttft = config.router_cost is RouterCost.TTFT and models is not None

    def select(explain: bool) -> Selection:
        return select_worker(
            keys, OverlapScores(dict(scores), 64), active, new_blocks, config,
            random.Random(seed), loads=loads, now=1.0, num_tokens=num_tokens,
            step_models=models, preferred=preferred, explain=explain,
        )  # fmt: skip

    fast, explained = select(False), select(True)
    table = CostTable(active, models or StepTimeModels(), min_candidates=1)
    tabled = select_worker(
        keys, OverlapScores(dict(scores), 64), active, new_blocks, config,
        random.Random(seed), loads=loads, now=1.0, num_tokens=num_tokens,
        step_models=models, preferred=preferred, table=table,
    )  # fmt: skip
    assert fast == tabled
    assert fast.busy == explained.busy == busy
    if not free:
        assert fast.status is explained.status is SelectionStatus.ALL_BUSY
        return
    expected = reference_costs(
        free, scores, active, new_blocks, num_tokens, config, models if ttft else None, preferred
    )
    chosen = reference_choice(
        [c for c, _ in expected], config.router_temperature, random.Random(seed)
    )
    for sel in (fast, explained):
        assert sel.status is SelectionStatus.SELECTED
        assert sel.worker_key == free[chosen]
        assert sel.overlap_blocks == scores.get(free[chosen], 0)
        assert sel.predicted_ttft_s == expected[chosen][1]
    assert fast.candidates == []
    # The inlined loop's costs themselves, exactly (a choice may hide a last-bit difference).
    inlined = _CostTerms(
        OverlapScores(dict(scores), 64), active, new_blocks, config, num_tokens=num_tokens,
        step_models=models if ttft else None, preferred=preferred,
    ).costs(free)  # fmt: skip
    if not (ttft and config.itl_weight):  # (the ITL term is priced by rows only)
        assert inlined == [c for c, _ in expected]
        from_table = _CostTerms(
            OverlapScores(dict(scores), 64), active, new_blocks, config, num_tokens=num_tokens,
            step_models=models if ttft else None, preferred=preferred,
        ).costs(free, table)  # fmt: skip
        assert from_table.tolist() == inlined  # type: ignore[union-attr]
    assert [row.cost for row in explained.candidates] == [c for c, _ in expected]
    assert [row.worker_key for row in explained.candidates] == free


@pytest.mark.parametrize("max_changed", [MAX_CHANGED_WORKERS, 0])
@pytest.mark.parametrize("cost", list(RouterCost))
def test_table_follows_every_change(
    cost: RouterCost, max_changed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One table over a long run of requests, reports and departures: after each change the
    table's decision is the loop's (rows copied when their worker changed, or all of them
    when more changed than the sources list, slots reused, and the slots of a candidate tuple
    seen before reused while no slot moved)."""
    monkeypatch.setattr(active_sequences, "MAX_CHANGED_WORKERS", max_changed)
    monkeypatch.setattr(step_time, "MAX_CHANGED_WORKERS", max_changed)
    rng = random.Random(5)
    config = KvRouterConfig(block_size=BS, router_cost=cost, session_weight=2.0)
    active = ActiveSequences(block_size=BS)
    models = StepTimeModels()
    table = CostTable(active, models, min_candidates=1)
    live = [WorkerKey(i, r) for i in range(12) for r in range(2)]
    members = tuple(live)  # as a router passes its live set: one tuple until it changes
    in_flight: list[str] = []
    for step in range(600):
        op = rng.random()
        if op < 0.4:
            request_id = f"q{step}"
            tokens, cached = rng.randrange(1, 5000), rng.randrange(0, 3)
            active.add_request(
                request_id,
                rng.choice(live),
                num_prompt_tokens=tokens,
                overlap_blocks=cached,
                now=0.0,
            )
            in_flight.append(request_id)
        elif op < 0.6 and in_flight:
            active.mark_prefill_done(rng.choice(in_flight))
        elif op < 0.8 and in_flight:
            active.free(in_flight.pop(rng.randrange(len(in_flight))))
        elif op < 0.95:
            key = rng.choice(live)
            samples = [StepSample(p, rng.randrange(0, 9), 0.001 + p * rng.choice([1e-6, 3e-6]), 0.4)
                       for p in (32, 700, 3000)]  # fmt: skip
            models.on_load(LoadReport(worker_id=key.worker_id, dp_rank=key.dp_rank, steps=samples,
                                      max_num_batched_tokens=rng.choice([512, 8192])))  # fmt: skip
        else:
            gone = rng.choice(live).worker_id
            active.remove_worker(gone)
            models.remove_worker(gone)
            table.remove_worker(gone)
            live = [k for k in live if k.worker_id != gone] + [WorkerKey(100 + step, 0)]
            if rng.random() < 0.5:  # else a stale tuple: its slots moved, it must be re-gathered
                members = tuple(live)
        candidates: Sequence[WorkerKey] = (
            members if rng.random() < 0.5 else rng.sample(live, rng.randrange(1, len(live)))
        )
        scores = {k: rng.randrange(1, 30) for k in live if rng.random() < 0.3}  # not all candidates
        new_blocks = rng.randrange(1, 200)
        preferred = rng.choice([None, rng.choice(live)])
        seed = rng.randrange(1 << 30)
        results = [
            select_worker(
                candidates,
                OverlapScores(scores, 64),
                active,
                new_blocks,
                config,
                random.Random(seed),
                num_tokens=new_blocks * BS,
                step_models=models,
                preferred=preferred,
                table=with_table,
            )
            for with_table in (None, table)
        ]
        assert results[0] == results[1], step
    assert len(table) <= len(live) + 2 * 12


def test_changes_are_listed_only_for_a_reader_and_only_up_to_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a reader nothing is kept; past the bound the answer is "reload everything"
    (``None``), never a growing set."""
    monkeypatch.setattr(active_sequences, "MAX_CHANGED_WORKERS", 4)
    active = ActiveSequences(block_size=BS)
    for i in range(100):
        active.add_request(f"q{i}", WorkerKey(i, 0), num_prompt_tokens=8, overlap_blocks=0, now=0.0)
    assert active.take_changed() is None  # the first read: everything
    for i in range(5):
        active.add_request(f"r{i}", WorkerKey(i, 0), num_prompt_tokens=8, overlap_blocks=0, now=0.0)
    assert active.take_changed() is None  # past the bound
    active.add_request("s", WorkerKey(7, 0), num_prompt_tokens=8, overlap_blocks=0, now=0.0)
    assert active.take_changed() == {WorkerKey(7, 0)}
    assert active.take_changed() == set()
