"""The index on realistic chains (blocks stored with their parents), where find_matches takes
its galloping path for workers that hold whole prefixes and the block-by-block walk for
workers with holes; both must agree with a reference model."""

from __future__ import annotations

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from turnout.protocols.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    StoredBlock,
)
from turnout.router.kv.base import EventOutcome, WorkerKey
from turnout.router.kv.block_index import BlockOwnerIndex
from turnout.router.kv.indexer import KvIndexer

WORKERS = [WorkerKey(w) for w in range(4)]
ROOT, UNKNOWN = "root", "unknown"
PATHS = st.lists(st.integers(0, 2), min_size=1, max_size=7).map(tuple)


def seq_hash(path: tuple[int, ...]) -> int:
    """Stands in for a sequence hash: one distinct value per prefix path."""
    return xxhash.xxh3_64_intdigest(repr(path).encode())


def chain_event(
    worker: WorkerKey, event_id: int, path: tuple[int, ...], start: int, drop_parent: bool
) -> KvCacheEvent:
    """Store blocks path[:start+1] .. path; their first block's parent is path[:start]."""
    blocks = []
    for depth in range(start + 1, len(path) + 1):
        h = seq_hash(path[:depth])
        local = h if depth == 1 else h ^ 1  # a first block's sequence hash is its local hash
        blocks.append(StoredBlock(block_hash=h, tokens_hash=local, num_tokens=16))
    parent = None if start == 0 or drop_parent else seq_hash(path[:start])
    return KvCacheEvent(
        worker_id=worker.worker_id,
        event_id=event_id,
        data=BlockStored(parent_hash=parent, blocks=blocks),
    )


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"), st.sampled_from(WORKERS), PATHS, st.integers(0, 6), st.booleans()
        ),
        st.tuples(
            st.just("remove"), st.sampled_from(WORKERS), PATHS, st.integers(0, 6), st.booleans()
        ),
        st.tuples(st.just("clear"), st.sampled_from(WORKERS), PATHS, st.just(0), st.just(False)),
        st.tuples(st.just("query"), st.sampled_from(WORKERS), PATHS, st.just(0), st.just(False)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS)
def test_chains_with_holes_agree_with_reference(
    ops: list[tuple[str, WorkerKey, tuple[int, ...], int, bool]],
) -> None:
    indexer = KvIndexer()
    # worker -> held hash -> recorded parent hash (or ROOT / UNKNOWN), first store wins
    parents: dict[WorkerKey, dict[int, object]] = {w: {} for w in WORKERS}
    next_id = dict.fromkeys(WORKERS, 0)
    for op, key, path, k, flag in ops:
        held = parents[key]
        if op == "store":
            start = min(k, len(path) - 1)
            event = chain_event(key, next_id[key], path, start, drop_parent=flag)
            next_id[key] += 1
            assert indexer.apply_event(event) is EventOutcome.APPLIED
            parent: object = ROOT if start == 0 else UNKNOWN if flag else seq_hash(path[:start])
            for depth in range(start + 1, len(path) + 1):
                h = seq_hash(path[:depth])
                held.setdefault(h, parent)
                parent = h
        elif op == "remove":
            # Remove one block (flag) or a whole prefix: holes appear in the middle of chains.
            depths = [min(k, len(path) - 1) + 1] if flag else range(1, len(path) + 1)
            hashes = [seq_hash(path[:d]) for d in depths]
            event = KvCacheEvent(
                worker_id=key.worker_id,
                event_id=next_id[key],
                data=BlockRemoved(block_hashes=hashes),
            )
            next_id[key] += 1
            indexer.apply_event(event)
            for h in hashes:
                held.pop(h, None)
        elif op == "clear":
            event = KvCacheEvent(
                worker_id=key.worker_id, event_id=next_id[key], data=AllBlocksCleared()
            )
            next_id[key] += 1
            indexer.apply_event(event)
            held.clear()
        else:
            chain = [seq_hash(path[:d]) for d in range(1, len(path) + 1)]
            expected = {}
            for worker, blocks in parents.items():
                depth = 0
                while depth < len(chain) and chain[depth] in blocks:
                    depth += 1
                if depth:
                    expected[worker] = depth
            assert indexer.find_matches(chain).scores == expected
        for worker, blocks in parents.items():
            closed = all(p == ROOT or p in blocks for p in blocks.values())
            assert indexer.is_prefix_closed(worker) == closed


def test_galloping_finds_every_depth() -> None:
    index = BlockOwnerIndex()
    chain = [seq_hash((i,)) for i in range(300)]
    depths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 299, 300]
    for i, depth in enumerate(depths):
        index.store_chain(index.ensure_worker(WorkerKey(i)), chain[:depth], parent=-1)
    assert all(index.is_prefix_closed(WorkerKey(i)) for i in range(len(depths)))
    expected = {WorkerKey(i): depth for i, depth in enumerate(depths)}
    assert index.find_matches(chain).scores == expected
    assert index.find_matches(chain[:40]).scores == {
        WorkerKey(i): min(depth, 40) for i, depth in enumerate(depths)
    }
