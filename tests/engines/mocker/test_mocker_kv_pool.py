"""KvBlockPool: reference counts, LRU eviction leaves first, and events that replay exactly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.engines.mocker.replay import BS, ReplayModel

from turnout.engines.mocker import KvBlockPool
from turnout.protocols.block_hashing import compute_block_hashes
from turnout.protocols.kv import AllBlocksCleared, BlockRemoved, BlockStored


def chain(symbols: list[int]) -> tuple[list[int], list[int]]:
    """Block hashes of a prompt whose block i is ``[symbols[i]] * BS``: a small alphabet
    makes prompts share prefixes often."""
    tokens = [s for s in symbols for _ in range(BS)]
    local, seq = compute_block_hashes(tokens, BS)
    return list(local), list(seq)


class Holder:
    """A request holding a prefix of its chain: the same calls the scheduler makes."""

    def __init__(self, pool: KvBlockPool, symbols: list[int]) -> None:
        self.pool = pool
        self.local, self.seq = chain(symbols)
        self.held: list[int] = []
        self.private = 0

    def start(self) -> int | None:
        """Take the cached prefix and blocks for the rest; the hit, or None when no room."""
        hit = self.pool.num_cached_prefix(self.seq)
        self.pool.acquire_cached(self.seq[:hit])
        if not self.pool.allocate(len(self.seq) - hit):
            self.pool.free(self.seq[:hit])
            return None
        self.held = self.seq[:hit]
        self.private = len(self.seq) - hit
        for i in range(hit, len(self.seq)):
            self.pool.commit(self.seq[i], self.local[i], self.seq[i - 1] if i else None)
            self.held.append(self.seq[i])
            self.private -= 1
        return hit

    def finish(self) -> None:
        self.pool.free(self.held, self.private)
        self.held = []


ops = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.lists(st.integers(0, 2), min_size=1, max_size=6)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
        st.tuples(st.just("reset"), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=120, deadline=None)
@given(capacity=st.integers(1, 12), program=ops)
def test_random_programs_keep_invariants_and_events_replay(
    capacity: int, program: list[tuple[str, object]]
) -> None:
    pool = KvBlockPool(capacity, BS, worker_id=7)
    model = ReplayModel()
    live: list[Holder] = []
    for kind, arg in program:
        if kind == "start":
            assert isinstance(arg, list)
            h = Holder(pool, arg)
            # The hit is the longest prefix the replayed (router's) view holds.
            expected = 0
            for x in h.seq:
                if x not in model.resident:
                    break
                expected += 1
            hit = h.start()
            if hit is not None:
                assert hit == expected
                live.append(h)
        elif kind == "finish" and live:
            assert isinstance(arg, int)
            live.pop(arg % len(live)).finish()
        elif kind == "reset":
            assert pool.reset() == (pool.num_used == 0)
        pool.check_invariants()
        assert pool.num_used <= pool.capacity
        for holder in live:
            for x in holder.held:
                assert pool.get_ref_count(x) > 0  # in use: never free, never evicted
        events = pool.take_events()
        assert all(ev.worker_id == 7 for ev in events)
        model.apply(events)
        assert model.resident == pool.get_resident_hashes()
    for holder in live:
        holder.finish()
    pool.check_invariants()
    assert pool.num_used == 0


def test_shared_blocks_are_reference_counted() -> None:
    pool = KvBlockPool(8, BS)
    a, b = Holder(pool, [1, 2, 3]), Holder(pool, [1, 2, 4])
    assert a.start() == 0
    assert b.start() == 2
    assert pool.get_ref_count(a.seq[0]) == 2
    assert pool.num_used == 4
    a.finish()
    assert pool.get_ref_count(a.seq[0]) == 1
    assert pool.num_cached_free == 1  # a's tail block: resident, unreferenced
    b.finish()
    assert pool.num_used == 0 and pool.num_resident == 4


def test_eviction_is_lru_and_leaves_first() -> None:
    pool = KvBlockPool(4, BS)
    old = Holder(pool, [1, 2])
    old.start()
    old.finish()
    newer = Holder(pool, [3, 4])
    newer.start()
    newer.finish()
    pool.take_events()
    # Two blocks needed: the least recent chain goes, its leaf before its root.
    assert pool.allocate(1)
    (ev,) = pool.take_events()
    assert isinstance(ev.data, BlockRemoved)
    assert ev.data.block_hashes == [old.seq[1]]
    assert pool.allocate(1)
    (ev,) = pool.take_events()
    assert isinstance(ev.data, BlockRemoved) and ev.data.block_hashes == [old.seq[0]]
    assert pool.get_resident_hashes() == set(newer.seq)
    assert not pool.allocate(3)  # 2 private + 2 cached left: refused, nothing changed
    assert pool.get_resident_hashes() == set(newer.seq)
    assert pool.take_events() == []


def test_stored_event_carries_parent_and_chains_one_prefill() -> None:
    pool = KvBlockPool(8, BS)
    first = Holder(pool, [1, 2])
    first.start()
    (ev,) = pool.take_events()
    assert isinstance(ev.data, BlockStored)
    assert ev.data.parent_hash is None
    assert [b.block_hash for b in ev.data.blocks] == first.seq
    assert [b.tokens_hash for b in ev.data.blocks] == first.local
    second = Holder(pool, [1, 2, 5])
    assert second.start() == 2
    (ev,) = pool.take_events()
    assert isinstance(ev.data, BlockStored)
    assert ev.data.parent_hash == first.seq[1]
    assert ev.event_id == 1


def test_reset_refused_while_in_use() -> None:
    pool = KvBlockPool(4, BS)
    h = Holder(pool, [1])
    h.start()
    assert not pool.reset()
    h.finish()
    assert pool.reset()
    assert pool.num_resident == 0
    assert isinstance(pool.take_events()[-1].data, AllBlocksCleared)


def test_bad_geometry_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        KvBlockPool(0, 16)
    with pytest.raises(ValueError, match="positive"):
        KvBlockPool(16, 0)
