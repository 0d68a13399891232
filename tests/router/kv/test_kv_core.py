"""KvRouterCore end to end (exact and approximate modes) and the fast prompt hashing."""

from __future__ import annotations

import random

from turnout.protocols.block_hashing import compute_block_hashes, compute_seq_hashes
from turnout.protocols.kv import (
    BlockStored,
    KvCacheEvent,
    LoadReport,
    StoredBlock,
)
from turnout.router.kv.active_sequences import ActiveLoad, ActiveSequenceEvent
from turnout.router.kv.base import EventOutcome, WorkerKey
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.core import KvRouterCore
from turnout.router.kv.selector import SelectionStatus

BS = 16
A, B = WorkerKey(1), WorkerKey(2)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored_event(
    worker: WorkerKey, event_id: int, tokens: list[int], lora_name: str | None = None
) -> KvCacheEvent:
    """What an engine publishes after caching ``tokens`` (full blocks only)."""
    local, seq = compute_block_hashes(tokens, BS, lora_name=lora_name)
    blocks = [
        StoredBlock(block_hash=s, tokens_hash=loc, num_tokens=BS)
        for s, loc in zip(seq, local, strict=True)
    ]
    return KvCacheEvent(
        worker_id=worker.worker_id,
        dp_rank=worker.dp_rank,
        event_id=event_id,
        data=BlockStored(parent_hash=None, blocks=blocks, lora_name=lora_name),
    )


def prompt(seed: int, n: int) -> list[int]:
    return [random.Random(seed).randrange(32000) for _ in range(n)]


def test_exact_mode_routes_to_the_cache_and_keeps_the_books() -> None:
    clock = FakeClock()
    core = KvRouterCore(KvRouterConfig(block_size=BS), rng=random.Random(0), clock=clock)
    system = prompt(1, 160)  # 10 blocks
    assert core.on_kv_event(stored_event(A, 0, system)) is EventOutcome.APPLIED
    request = [*system, *prompt(2, 40)]  # 200 tokens: 12 full blocks, 13 blocks in all
    sel = core.route("r1", request, [A, B])
    assert (sel.worker_key, sel.overlap_blocks, sel.new_blocks) == (A, 10, 13)
    # 200 - 10*16 = 40 tokens left to prefill on A.
    assert core.active.get_load(A) == ActiveLoad(40, 13, 1)
    assert core.on_first_token("r1")
    assert core.active.get_load(A) == ActiveLoad(0, 13, 1)
    assert core.on_finished("r1")
    assert not core.on_finished("r1")
    assert core.active.get_load(A) == ActiveLoad(0, 0, 0)
    stats = core.get_stats()
    assert (stats.requests_routed, stats.blocks_routed, stats.overlap_blocks_routed) == (1, 12, 10)
    assert core.predicted_hit_rate == 10 / 12
    assert stats.indexer is not None and stats.indexer.events_applied == 1


def test_load_balances_when_nothing_is_cached() -> None:
    core = KvRouterCore(KvRouterConfig(block_size=BS), rng=random.Random(0), clock=FakeClock())
    first = core.route("r1", prompt(1, 64), [A, B])
    second = core.route("r2", prompt(2, 64), [A, B])
    assert {first.worker_key, second.worker_key} == {A, B}


def test_lora_blocks_hash_apart() -> None:
    core = KvRouterCore(KvRouterConfig(block_size=BS), rng=random.Random(0), clock=FakeClock())
    tokens = prompt(3, 64)
    core.on_kv_event(stored_event(A, 0, tokens, lora_name="sql"))
    assert core.route("base", tokens, [A, B]).overlap_blocks == 0
    core.on_finished("base")
    sel = core.route("adapter", tokens, [A, B], lora_name="sql")
    assert (sel.worker_key, sel.overlap_blocks) == (A, 4)


def test_approx_mode_learns_from_its_own_decisions() -> None:
    clock = FakeClock()
    config = KvRouterConfig(block_size=BS, use_kv_events=False, approx_ttl_s=120.0)
    core = KvRouterCore(config, rng=random.Random(0), clock=clock)
    tokens = prompt(4, 128)  # 8 blocks
    first = core.route("r1", tokens, [A, B])
    core.on_first_token("r1")
    core.on_finished("r1")
    second = core.route("r2", tokens, [A, B])
    assert (second.worker_key, second.overlap_blocks) == (first.worker_key, 8)
    core.on_finished("r2")
    clock.now += 121.0
    assert core.route("r3", tokens, [A, B]).overlap_blocks == 0
    event = stored_event(A, 0, tokens)
    assert core.on_kv_event(event) is EventOutcome.IGNORED
    assert core.get_stats().kv_events_ignored == 1


def test_busy_and_missing_candidates() -> None:
    config = KvRouterConfig(block_size=BS, busy_num_waiting_threshold=2)
    core = KvRouterCore(config, rng=random.Random(0), clock=FakeClock())
    assert core.on_load(LoadReport(worker_id=1, num_waiting=3))
    assert core.route("r1", prompt(5, 32), [A]).status is SelectionStatus.ALL_BUSY
    assert core.route("r2", prompt(5, 32), []).status is SelectionStatus.NO_CANDIDATES
    assert "r1" not in core.active
    stats = core.get_stats()
    assert (stats.requests_all_busy, stats.requests_no_candidates, stats.requests_routed) == (
        1,
        1,
        0,
    )


def test_worker_removed_forgets_cache_requests_and_load() -> None:
    core = KvRouterCore(KvRouterConfig(block_size=BS), rng=random.Random(0), clock=FakeClock())
    tokens = prompt(6, 64)
    core.on_kv_event(stored_event(A, 0, tokens))
    core.route("r1", tokens, [A, B])
    core.on_worker_removed(A.worker_id)
    assert "r1" not in core.active
    assert core.index.find_matches(compute_seq_hashes(tokens, BS)).scores == {}


def test_gap_is_reported_and_snapshot_resyncs() -> None:
    gaps: list[tuple[WorkerKey, int, int]] = []
    core = KvRouterCore(
        KvRouterConfig(block_size=BS),
        rng=random.Random(0),
        clock=FakeClock(),
        on_gap=lambda k, e, g: gaps.append((k, e, g)),
    )
    tokens = prompt(7, 64)
    assert core.on_kv_event(stored_event(A, 4, tokens)) is EventOutcome.GAP
    assert gaps == [(A, 0, 4)]
    assert core.get_workers_needing_resync() == [A]
    core.on_kv_snapshot(A, [stored_event(A, 4, tokens[:32])])
    assert core.get_workers_needing_resync() == []
    assert core.route("r", tokens, [A, B]).overlap_blocks == 2


def test_replicas_share_active_sequences() -> None:
    events: list[ActiveSequenceEvent] = []
    one = KvRouterCore(router_id="one", publish_active=events.append, clock=FakeClock())
    two = KvRouterCore(router_id="two", clock=FakeClock())
    one.route("r1", prompt(8, 64), [A])
    for event in events:
        two.on_active_event(event)
    assert two.active.get_load(A) == one.active.get_load(A) == ActiveLoad(64, 4, 1)
    # Seeing A loaded, replica two sends the next request to B.
    assert two.route("r2", prompt(9, 64), [A, B]).worker_key == B


def test_a_pinned_request_is_booked_and_weighs_on_the_next_decision() -> None:
    """A request sent without a decision (a session's binding) is counted on its worker as
    a routed one is, so the next unpinned request goes to the other, idle worker."""
    clock = FakeClock()
    core = KvRouterCore(KvRouterConfig(block_size=BS), rng=random.Random(0), clock=clock)
    system = prompt(1, 160)
    core.on_kv_event(stored_event(A, 0, system))
    request = [*system, *prompt(2, 40)]
    assert core.book("pinned", request, A, session_id="s") == 10  # A holds 10 blocks
    assert core.active.get_load(A) == ActiveLoad(40, 13, 1)
    assert core.sessions.get("s", clock()) == A
    other = prompt(3, 200)  # cached nowhere: the load decides
    assert core.route("r2", other, [A, B]).worker_key == B
    assert core.on_finished("pinned")
    assert core.active.get_load(A) == ActiveLoad(0, 0, 0)


def test_explain_and_precomputed_hashes_leave_the_decision_alone() -> None:
    """``explain`` only adds the per-candidate rows; hashes from ``seq_hashes`` (computed
    once by the caller) give the decision and the books that hashing in ``route`` gives."""
    tokens = [*prompt(1, 160), *prompt(2, 40)]
    outcomes = []
    for explain, precomputed in ((False, False), (True, False), (False, True)):
        core = KvRouterCore(KvRouterConfig(block_size=BS), rng=random.Random(7), clock=FakeClock())
        core.on_kv_event(stored_event(A, 0, prompt(1, 160)))
        hashes = core.seq_hashes(tokens) if precomputed else None
        sel = core.route("r1", tokens, [A, B], explain=explain, seq_hashes=hashes)
        booked = core.book("r2", tokens, B, seq_hashes=hashes)
        assert bool(sel.candidates) is explain
        outcomes.append((sel.worker_key, sel.overlap_blocks, sel.predicted_ttft_s, booked,
                         core.active.get_load(A), core.active.get_load(B)))  # fmt: skip
    assert outcomes[0] == outcomes[1] == outcomes[2]
    assert outcomes[0][:2] == (A, 10)
    assert KvRouterCore(KvRouterConfig(block_size=BS)).seq_hashes(
        tokens, lora_name="sql", cache_salt="tenant"
    ) == compute_seq_hashes(tokens, BS, lora_name="sql", cache_salt="tenant")
