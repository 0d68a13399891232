"""KvIndexer against a reference model (plain sets), event-id gaps, resync and removal."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnout.protocols.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    KvEventBatch,
    StoredBlock,
)
from turnout.router.kv.base import EventOutcome, WorkerKey
from turnout.router.kv.indexer import Gap, KvIndexer


def stored(worker: WorkerKey, event_id: int, hashes: Sequence[int]) -> KvCacheEvent:
    blocks = [StoredBlock(block_hash=h, tokens_hash=h ^ 0xFF, num_tokens=16) for h in hashes]
    return KvCacheEvent(
        worker_id=worker.worker_id,
        dp_rank=worker.dp_rank,
        event_id=event_id,
        data=BlockStored(parent_hash=None, blocks=blocks),
    )


def removed(worker: WorkerKey, event_id: int, hashes: Sequence[int]) -> KvCacheEvent:
    return KvCacheEvent(
        worker_id=worker.worker_id,
        dp_rank=worker.dp_rank,
        event_id=event_id,
        data=BlockRemoved(block_hashes=list(hashes)),
    )


def cleared(worker: WorkerKey, event_id: int) -> KvCacheEvent:
    return KvCacheEvent(
        worker_id=worker.worker_id,
        dp_rank=worker.dp_rank,
        event_id=event_id,
        data=AllBlocksCleared(),
    )


def reference_overlaps(
    holdings: dict[WorkerKey, set[int]], seq: Sequence[int]
) -> dict[WorkerKey, int]:
    out: dict[WorkerKey, int] = {}
    for key, blocks in holdings.items():
        depth = 0
        for h in seq:
            if h not in blocks:
                break
            depth += 1
        if depth:
            out[key] = depth
    return out


WORKERS = [WorkerKey(w, r) for w in range(3) for r in range(2)]
HASHES = st.integers(min_value=0, max_value=24).map(lambda i: (i * 0x9E3779B97F4A7C15) % 2**64)
HASH_LISTS = st.lists(HASHES, min_size=0, max_size=10)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.sampled_from(WORKERS), HASH_LISTS),
        st.tuples(st.just("remove"), st.sampled_from(WORKERS), HASH_LISTS),
        st.tuples(st.just("clear"), st.sampled_from(WORKERS), st.just([])),
        st.tuples(st.just("drop_worker"), st.sampled_from(WORKERS), st.just([])),
        st.tuples(st.just("query"), st.sampled_from(WORKERS), HASH_LISTS),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_find_matches_agrees_with_reference(ops: list[tuple[str, WorkerKey, list[int]]]) -> None:
    indexer = KvIndexer()
    holdings: dict[WorkerKey, set[int]] = {}
    next_id: dict[WorkerKey, int] = {}

    def eid(key: WorkerKey) -> int:
        n = next_id.get(key, 0)
        next_id[key] = n + 1
        return n

    for op, key, hashes in ops:
        if op == "store":
            assert indexer.apply_event(stored(key, eid(key), hashes)) is EventOutcome.APPLIED
            holdings.setdefault(key, set()).update(hashes)
        elif op == "remove":
            assert indexer.apply_event(removed(key, eid(key), hashes)) is EventOutcome.APPLIED
            holdings.get(key, set()).difference_update(hashes)
        elif op == "clear":
            assert indexer.apply_event(cleared(key, eid(key))) is EventOutcome.APPLIED
            holdings[key] = set()
        elif op == "drop_worker":
            # The whole instance leaves; a new one under the same id starts numbering at 0.
            expected_dropped = sum(
                len(b) for k, b in holdings.items() if k.worker_id == key.worker_id
            )
            assert indexer.remove_worker(key.worker_id) == expected_dropped
            for k in WORKERS:
                if k.worker_id == key.worker_id:
                    holdings.pop(k, None)
                    next_id.pop(k, None)
        else:
            assert indexer.find_matches(hashes).scores == reference_overlaps(holdings, hashes)
        assert indexer.num_blocks == sum(len(b) for b in holdings.values())
    for key in WORKERS:
        assert indexer.get_num_blocks(key) == len(holdings.get(key, ()))
    stats = indexer.get_stats()
    assert stats.gaps == 0
    assert stats.unique_blocks == len(set[int]().union(*holdings.values()))


def test_overlap_stops_at_first_missing_block() -> None:
    a, b = WorkerKey(1), WorkerKey(2)
    indexer = KvIndexer()
    indexer.apply_event(stored(a, 0, [10, 11, 12, 14]))  # lacks 13
    indexer.apply_event(stored(b, 0, [11, 12, 13]))  # lacks the first block
    scores = indexer.find_matches([10, 11, 12, 13, 14])
    assert scores.scores == {a: 3}
    assert scores.get(b) == 0
    assert scores.num_blocks == 5
    assert indexer.find_matches([]).scores == {}
    assert indexer.find_matches([99, 10]).scores == {}


def test_gap_flags_worker_and_resync_rebuilds_it() -> None:
    gaps: list[tuple[WorkerKey, int, int]] = []
    indexer = KvIndexer(on_gap=lambda k, e, g: gaps.append((k, e, g)))
    w = WorkerKey(7, 1)
    assert indexer.apply_event(stored(w, 0, [1, 2])) is EventOutcome.APPLIED
    assert indexer.apply_event(stored(w, 1, [3])) is EventOutcome.APPLIED
    assert not indexer.needs_resync(w)
    # Event 2 is lost; 3 arrives: a gap, applied anyway.
    assert indexer.apply_event(stored(w, 3, [4])) is EventOutcome.GAP
    assert gaps == [(w, 2, 3)]
    assert indexer.needs_resync(w)
    assert indexer.get_workers_needing_resync() == [w]
    assert indexer.find_matches([1, 2, 3, 4]).scores == {w: 4}
    # A late or repeated event is a duplicate and changes nothing.
    assert indexer.apply_event(removed(w, 2, [1])) is EventOutcome.DUPLICATE
    assert indexer.find_matches([1]).scores == {w: 1}

    # The snapshot (ids up to 10) replaces everything the worker had.
    snapshot = [stored(w, 9, [1, 5]), removed(w, 10, [5])]
    indexer.reset_worker(w, snapshot)
    assert not indexer.needs_resync(w)
    assert indexer.find_matches([1, 2]).scores == {w: 1}
    assert indexer.get_expected_event_id(w) == 11
    assert indexer.apply_event(stored(w, 10, [2])) is EventOutcome.DUPLICATE
    assert indexer.apply_event(stored(w, 11, [2])) is EventOutcome.APPLIED
    assert indexer.find_matches([1, 2]).scores == {w: 2}
    stats = indexer.get_stats()
    assert (stats.gaps, stats.resyncs, stats.events_duplicate) == (1, 1, 2)
    assert stats.workers_needing_resync == 0


def test_first_event_after_reset_must_be_the_announced_one() -> None:
    indexer = KvIndexer()
    w = WorkerKey(3)
    indexer.reset_worker(w, [], next_event_id=5)
    assert indexer.apply_event(stored(w, 6, [1])) is EventOutcome.GAP
    indexer.reset_worker(w, [])  # empty snapshot, no id: accept whatever comes next
    assert indexer.apply_event(stored(w, 42, [1])) is EventOutcome.APPLIED
    assert indexer.apply_event(stored(w, 43, [2])) is EventOutcome.APPLIED


@pytest.mark.parametrize(
    ("first_event_id", "got", "outcome"),
    [
        (0, 0, EventOutcome.APPLIED),
        (0, 5, EventOutcome.GAP),  # the router joined late: the worker's history is unknown
        (1, 1, EventOutcome.APPLIED),
        (None, 5, EventOutcome.APPLIED),
    ],
)
def test_first_event_of_unknown_worker(
    first_event_id: int | None, got: int, outcome: EventOutcome
) -> None:
    indexer = KvIndexer(first_event_id=first_event_id)
    assert indexer.apply_event(stored(WorkerKey(1), got, [1])) is outcome


def test_apply_batch_reports_gaps() -> None:
    a, b = WorkerKey(1), WorkerKey(2)
    indexer = KvIndexer()
    batch = KvEventBatch(
        events=[stored(a, 0, [1]), stored(b, 0, [1]), stored(a, 2, [2]), stored(b, 1, [2])]
    )
    assert indexer.apply_batch(batch) == [Gap(a, 1, 2)]
    assert indexer.find_matches([1, 2]).scores == {a: 2, b: 2}


def test_all_blocks_cleared_touches_one_worker_only() -> None:
    a, a1, b = WorkerKey(1, 0), WorkerKey(1, 1), WorkerKey(2)
    indexer = KvIndexer()
    for key in (a, a1, b):
        indexer.apply_event(stored(key, 0, [1, 2, 3]))
    indexer.apply_event(cleared(a, 1))
    assert indexer.find_matches([1, 2, 3]).scores == {a1: 3, b: 3}
    assert indexer.get_num_blocks(a) == 0


def test_remove_worker_drops_all_ranks_and_slots_are_reused_cleanly() -> None:
    indexer = KvIndexer()
    ranks = [WorkerKey(5, r) for r in range(3)]
    other = WorkerKey(6)
    for key in [*ranks, other]:
        indexer.apply_event(stored(key, 0, [1, 2]))
    assert indexer.remove_worker(5) == 6
    assert indexer.find_matches([1, 2]).scores == {other: 2}
    assert indexer.get_workers() == [other]
    # A new worker takes a freed slot: it must not inherit the old worker's blocks.
    newcomer = WorkerKey(9)
    indexer.apply_event(stored(newcomer, 0, [1]))
    assert indexer.find_matches([1, 2]).scores == {other: 2, newcomer: 1}
    assert indexer.remove_worker(12345) == 0


def test_more_workers_than_bits_in_a_word() -> None:
    indexer = KvIndexer()
    workers = [WorkerKey(i) for i in range(200)]
    chain = [(i * 0x9E3779B97F4A7C15 + 7) % 2**64 for i in range(50)]
    for depth, key in enumerate(workers):
        indexer.apply_event(stored(key, 0, chain[: depth % 50 + 1]))
    expected = {key: depth % 50 + 1 for depth, key in enumerate(workers)}
    assert indexer.find_matches(chain).scores == expected
    indexer.remove_worker(49)
    del expected[WorkerKey(49)]
    assert indexer.find_matches(chain).scores == expected
