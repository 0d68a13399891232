"""The translator, without sockets: engine events in, turnout events out, checked against
turnout's own hashing and the router's real indexer."""

from __future__ import annotations

import logging

import pytest

from turnout.engines.attach.native_kv import LogGate, NativeKvTranslator
from turnout.engines.mocker_server.native_kv import EngineBlockHasher
from turnout.protocols.block_hashing import compute_block_hashes, compute_seq_hashes
from turnout.protocols.kv import AllBlocksCleared, BlockRemoved, BlockStored, KvCacheEvent
from turnout.protocols.native_kv import (
    EngineBlockHash,
    NativeCleared,
    NativeRemoved,
    NativeStored,
)
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.indexer import KvIndexer

BS = 4
PROMPT = list(range(1000, 1000 + 6 * BS))  # six blocks


class Engine:
    """A fake engine's event source: its own seeded hashes, chained as vLLM chains them."""

    def __init__(self, block_size: int = BS, hash_type: str = "int") -> None:
        self.hasher = EngineBlockHasher(hash_type=hash_type)  # type: ignore[arg-type]
        self.block_size = block_size

    def store(
        self,
        tokens: list[int],
        *,
        start: int = 0,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        medium: str | None = "GPU",
    ) -> tuple[NativeStored, list[EngineBlockHash]]:
        """A BlockStored for the full blocks of ``tokens`` from block ``start`` on."""
        hashes = self.hasher.block_hashes(
            tokens, self.block_size, lora_name=lora_name, cache_salt=cache_salt
        )
        bs = self.block_size
        event = NativeStored(
            block_hashes=hashes[start:],
            parent_hash=hashes[start - 1] if start else None,
            token_ids=tokens[start * bs : len(hashes) * bs],
            block_size=bs,
            lora_name=lora_name,
            lora_id=1 if lora_name else None,
            medium=medium,
            cache_salt=cache_salt if start == 0 else None,
        )
        return event, hashes


def index(*batches: list[KvCacheEvent]) -> KvIndexer:
    indexer = KvIndexer()
    for events in batches:
        assert indexer.apply_batch(events) == []  # never a gap in the translated ids
    return indexer


def matched(indexer: KvIndexer, tokens: list[int], **kw: str) -> dict[WorkerKey, int]:
    return dict(indexer.find_matches(compute_seq_hashes(tokens, BS, **kw)).scores)


@pytest.mark.parametrize("hash_type", ["int", "bytes"])
def test_turnout_hashes_and_prefix_overlap_across_workers(hash_type: str) -> None:
    engine_a, engine_b = Engine(hash_type=hash_type), Engine(hash_type=hash_type)
    a = NativeKvTranslator(block_size=BS, worker_id=1)
    b = NativeKvTranslator(block_size=BS, worker_id=2)
    first, _ = engine_a.store(PROMPT[: 2 * BS])
    rest, _ = engine_a.store(PROMPT, start=2)  # the same request, later blocks
    events_a = a.translate([first]) + a.translate([rest])
    other = PROMPT[: 3 * BS] + [7] * (3 * BS)  # shares three blocks with PROMPT
    (stored_b, _) = engine_b.store(other)
    events_b = b.translate([stored_b])

    local, seq = compute_block_hashes(PROMPT, BS)
    stored = [e.data for e in events_a]
    assert all(isinstance(d, BlockStored) for d in stored)
    assert [blk.block_hash for d in stored for blk in d.blocks] == seq  # type: ignore[union-attr]
    assert [blk.tokens_hash for d in stored for blk in d.blocks] == local  # type: ignore[union-attr]
    assert stored[1].parent_hash == seq[1]  # type: ignore[union-attr]
    assert [e.event_id for e in events_a] == [0, 1]

    indexer = index(events_a, events_b)
    assert matched(indexer, PROMPT) == {WorkerKey(1, 0): 6, WorkerKey(2, 0): 3}
    assert matched(indexer, PROMPT[: 4 * BS] + [0] * BS) == {WorkerKey(1, 0): 4, WorkerKey(2, 0): 3}


def test_removed_and_cleared_take_blocks_away() -> None:
    engine = Engine()
    tr = NativeKvTranslator(block_size=BS, worker_id=1)
    event, hashes = engine.store(PROMPT)
    indexer = index(tr.translate([event]))
    removed = tr.translate([NativeRemoved(block_hashes=hashes[4:], medium="GPU")])
    assert isinstance(removed[0].data, BlockRemoved)
    assert removed[0].data.block_hashes == compute_seq_hashes(PROMPT, BS)[4:]
    assert indexer.apply_batch(removed) == []
    assert matched(indexer, PROMPT) == {WorkerKey(1, 0): 4}
    assert tr.num_blocks() == 4
    cleared = tr.translate([NativeCleared()])
    assert isinstance(cleared[0].data, AllBlocksCleared)
    assert indexer.apply_batch(cleared) == []
    assert matched(indexer, PROMPT) == {}
    assert tr.num_blocks() == 0
    assert [e.event_id for e in removed + cleared] == [1, 2]
    # a removal of blocks never indexed changes nothing and takes no event id
    assert tr.translate([NativeRemoved(block_hashes=hashes)]) == []
    assert tr.stats.unknown_removed_blocks == 6


def test_lora_and_cache_salt_seed_the_hashes_and_children_inherit_the_salt() -> None:
    engine = Engine()
    tr = NativeKvTranslator(block_size=BS, worker_id=1)
    first, _ = engine.store(PROMPT[: 2 * BS], lora_name="sql", cache_salt="tenant-a")
    rest, _ = engine.store(PROMPT, start=2, lora_name="sql", cache_salt="tenant-a")
    events = tr.translate([first, rest])
    indexer = index(events)
    assert all(e.data.lora_name == "sql" for e in events)  # type: ignore[union-attr]
    assert matched(indexer, PROMPT, lora_name="sql", cache_salt="tenant-a") == {WorkerKey(1, 0): 6}
    assert matched(indexer, PROMPT) == {}
    assert matched(indexer, PROMPT, lora_name="sql") == {}
    assert matched(indexer, PROMPT, cache_salt="tenant-a") == {}


def test_engine_block_size_a_multiple_of_the_cards_maps_exactly() -> None:
    engine = Engine(block_size=2 * BS)  # each engine block is two turnout blocks
    tr = NativeKvTranslator(block_size=BS, worker_id=1)
    first, _ = engine.store(PROMPT[: 2 * BS])
    rest, hashes = engine.store(PROMPT, start=1)
    indexer = index(tr.translate([first, rest]))
    assert matched(indexer, PROMPT) == {WorkerKey(1, 0): 6}
    assert indexer.apply_batch(tr.translate([NativeRemoved(block_hashes=[hashes[2]])])) == []
    assert matched(indexer, PROMPT) == {WorkerKey(1, 0): 4}
    assert tr.snapshot().events[-1].data.blocks[-1].num_tokens == BS  # type: ignore[union-attr]


def test_engine_block_size_not_a_multiple_is_refused_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = Engine(block_size=6)
    tr = NativeKvTranslator(block_size=BS, worker_id=1)
    event, _ = engine.store(PROMPT)
    with caplog.at_level(logging.WARNING):
        assert tr.translate([event]) == []
        assert tr.translate([event]) == []
    assert tr.stats.block_size_refusals == 2
    lines = [r for r in caplog.records if "not a multiple" in r.getMessage()]
    assert len(lines) == 1 and "6" in lines[0].getMessage()
    assert tr.next_event_id() == 0


@pytest.mark.parametrize(
    ("change", "counter"),
    [
        ({"medium": "CPU_PINNED"}, "non_gpu_blocks"),
        ({"group_idx": 1}, "other_group_events"),
        ({"token_ids": PROMPT[:-1]}, "token_mismatches"),
        ({"token_ids": [2**32, *PROMPT[1:]]}, "token_mismatches"),
        ({"lora_id": 3}, "unnamed_lora_events"),
        ({"parent_hash": 12345}, "unknown_parent_events"),
        ({"first_opaque_block": 0}, "opaque_blocks"),
    ],
)
def test_what_is_not_indexed_is_counted(change: dict[str, object], counter: str) -> None:
    event, _ = Engine().store(PROMPT)
    for name, value in change.items():
        setattr(event, name, value)
    tr = NativeKvTranslator(block_size=BS, worker_id=1)
    assert tr.translate([event]) == []
    assert getattr(tr.stats, counter) > 0
    assert tr.num_blocks() == 0


def test_opaque_blocks_stop_the_chain_where_they_start() -> None:
    event, _ = Engine().store(PROMPT)
    event.first_opaque_block = 2  # a multimodal item in block 2
    tr = NativeKvTranslator(block_size=BS, worker_id=1)
    indexer = index(tr.translate([event]))
    assert matched(indexer, PROMPT) == {WorkerKey(1, 0): 2}
    assert tr.stats.opaque_blocks == 4


def test_non_gpu_removal_leaves_the_gpu_copy() -> None:
    event, hashes = Engine().store(PROMPT)
    tr = NativeKvTranslator(block_size=BS, worker_id=1)
    indexer = index(tr.translate([event]))
    assert tr.translate([NativeRemoved(block_hashes=hashes, medium="CPU")]) == []
    assert matched(indexer, PROMPT) == {WorkerKey(1, 0): 6}


def test_engine_hash_map_is_bounded_and_what_leaves_it_leaves_the_index(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = Engine()
    tr = NativeKvTranslator(block_size=BS, worker_id=1, max_blocks=4)
    event, hashes = engine.store(PROMPT)
    with caplog.at_level(logging.WARNING):
        events = tr.translate([event])
    assert tr.num_blocks() == 4 and tr.stats.map_evictions == 2
    assert isinstance(events[-1].data, BlockRemoved)
    indexer = index(events)
    seq = compute_seq_hashes(PROMPT, BS)
    assert indexer.get_num_blocks(WorkerKey(1, 0)) == 4
    assert not indexer.holds(WorkerKey(1, 0), seq[0])  # the least recent left first
    # what the map still holds can be removed; what it dropped is already gone
    assert indexer.apply_batch(tr.translate([NativeRemoved(block_hashes=hashes)])) == []
    assert indexer.get_num_blocks(WorkerKey(1, 0)) == 0
    assert sum("max_blocks" in r.getMessage() for r in caplog.records) == 1


def test_a_parent_in_use_stays_mapped() -> None:
    engine = Engine()
    tr = NativeKvTranslator(block_size=BS, worker_id=1, max_blocks=3)
    root, _ = engine.store(PROMPT[:BS])
    tr.translate([root])
    for i in range(4):  # four children of the one root block, each pushing out the oldest
        tokens = PROMPT[:BS] + [i] * BS
        child, _ = engine.store(tokens, start=1)
        assert tr.translate([child])[0].data.parent_hash is not None  # type: ignore[union-attr]
    assert tr.stats.unknown_parent_events == 0
    snapshot = tr.snapshot()
    assert snapshot.events[0].data.parent_hash is None  # type: ignore[union-attr]
    assert tr.num_blocks() == 3


def test_snapshot_rebuilds_the_same_view_parents_first() -> None:
    engine = Engine()
    tr = NativeKvTranslator(block_size=BS, worker_id=9)
    first, _ = engine.store(PROMPT[: 3 * BS])
    branch, _ = engine.store(PROMPT[: 3 * BS] + [5] * (2 * BS), start=3)
    rest, hashes = engine.store(PROMPT, start=3)
    live = tr.translate([first, branch, rest, NativeRemoved(block_hashes=[hashes[5]])], dp_rank=1)
    # storing under block 2 again moves it after its children in the map
    tr.translate([engine.store(PROMPT[: 3 * BS] + [6] * BS, start=3)[0]], dp_rank=1)
    snapshot = tr.snapshot(dp_rank=1)
    assert (snapshot.worker_id, snapshot.dp_rank, snapshot.next_event_id) == (9, 1, 5)
    seen: set[int] = set()
    for event in snapshot.events:  # every parent comes before its children
        data = event.data
        assert isinstance(data, BlockStored)
        assert data.parent_hash is None or data.parent_hash in seen
        seen.update(b.block_hash for b in data.blocks)
    fresh = KvIndexer()
    fresh.reset_worker(WorkerKey(9, 1), snapshot.events, next_event_id=snapshot.next_event_id)
    assert dict(fresh.find_matches(compute_seq_hashes(PROMPT, BS)).scores) == {WorkerKey(9, 1): 5}
    assert fresh.is_prefix_closed(WorkerKey(9, 1))
    assert len(live) == 4 and tr.snapshot(dp_rank=0).events == []


def test_clear_and_ranks_number_their_own_events() -> None:
    event, _ = Engine().store(PROMPT)
    tr = NativeKvTranslator(block_size=BS, worker_id=1)
    assert [e.event_id for e in tr.translate([event], dp_rank=0)] == [0]
    assert [e.event_id for e in tr.translate([event], dp_rank=1)] == [0]
    cleared = tr.clear(dp_rank=1)
    assert [(e.event_id, e.dp_rank) for e in cleared] == [(1, 1)]
    assert tr.num_blocks(0) == 6 and tr.num_blocks(1) == 0
    tr.worker_id = 42  # learnt late
    assert tr.clear(0)[0].worker_id == 42


def test_log_gate_rate_limits_each_kind(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    gate = LogGate(logging.getLogger("test.gate"), interval_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            gate.warning("a", "trouble %s", "a")
        gate.warning("b", "other %s", "b")
        now[0] = 61.0
        gate.warning("a", "trouble %s", "a")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["trouble a", "other b", "trouble a (4 more since the last line)"]
