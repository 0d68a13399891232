"""The data structure under both KV indexers: which workers hold which sequence hashes.

Mental model: a sequence hash names a whole prefix (it chains its parent's), so "worker ``w``
holds the first ``k`` blocks of a request" is just "``w`` holds each of the request's first
``k`` sequence hashes". No tree is needed to answer it; a flat map from hash to holders is
enough, and in Python it is much faster than walking a radix tree of node objects.

::

    _owners:       SequenceHash -> int bitset over worker slots   (bit s = slot s holds it)
    _slot_blocks:  slot -> set of SequenceHash                     (for removal and clearing)
    _slot_keys:    slot -> WorkerKey | None (free)                 _slots: WorkerKey -> slot

Invariants (kept by every method here; nothing else touches these fields):

* bit ``s`` of ``_owners[h]`` is set  <=>  ``h in _slot_blocks[s]``;
* no ``_owners`` value is 0 (an unheld hash has no entry);
* ``_slot_keys[s]`` is ``None`` exactly for the free slots, which are in ``_free`` (a heap, so
  the lowest slot is reused first and bitsets stay narrow);
* ``_num_pairs == sum(len(b) for b in _slot_blocks)``.

``find_matches`` walks the request's hashes once with a bitset of workers still matching,
and stops as soon as no worker matches: a request nobody caches costs one dict lookup.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence

from turnout.router.kv.base import OverlapScores, WorkerKey


class BlockOwnerIndex:
    """Map from sequence hash to the set (bitset) of workers holding it. Not thread-safe."""

    __slots__ = ("_free", "_num_pairs", "_owners", "_slot_blocks", "_slot_keys", "_slots")

    def __init__(self) -> None:
        self._owners: dict[int, int] = {}
        self._slots: dict[WorkerKey, int] = {}
        self._slot_keys: list[WorkerKey | None] = []
        self._slot_blocks: list[set[int]] = []
        self._free: list[int] = []
        self._num_pairs = 0

    # --- workers -------------------------------------------------------------------------------

    def ensure_worker(self, key: WorkerKey) -> int:
        """The slot of ``key``, allocating one (lowest free first) when it is new."""
        slot = self._slots.get(key)
        if slot is not None:
            return slot
        if self._free:
            slot = heapq.heappop(self._free)
            self._slot_keys[slot] = key
        else:
            slot = len(self._slot_keys)
            self._slot_keys.append(key)
            self._slot_blocks.append(set())
        self._slots[key] = slot
        return slot

    def get_slot(self, key: WorkerKey) -> int | None:
        return self._slots.get(key)

    def has_worker(self, key: WorkerKey) -> bool:
        return key in self._slots

    def iter_workers(self) -> Iterator[WorkerKey]:
        return iter(list(self._slots))

    def release_worker(self, key: WorkerKey) -> int:
        """Drop every block of ``key`` and free its slot; returns the number of blocks dropped."""
        slot = self._slots.pop(key, None)
        if slot is None:
            return 0
        dropped = self._clear_slot(slot)
        self._slot_keys[slot] = None
        heapq.heappush(self._free, slot)
        return dropped

    # --- blocks --------------------------------------------------------------------------------

    def store(self, slot: int, seq_hashes: Iterable[int]) -> int:
        """Mark ``seq_hashes`` held by ``slot``; returns how many were new to it."""
        owners = self._owners
        get = owners.get
        blocks = self._slot_blocks[slot]
        bit = 1 << slot
        before = len(blocks)
        for h in seq_hashes:
            owners[h] = get(h, 0) | bit
            blocks.add(h)
        added = len(blocks) - before
        self._num_pairs += added
        return added

    def remove(self, slot: int, seq_hashes: Iterable[int]) -> int:
        """Mark ``seq_hashes`` no longer held by ``slot``; returns how many it held."""
        owners = self._owners
        blocks = self._slot_blocks[slot]
        keep = ~(1 << slot)
        removed = 0
        for h in seq_hashes:
            if h in blocks:
                blocks.remove(h)
                removed += 1
                mask = owners[h] & keep
                if mask:
                    owners[h] = mask
                else:
                    del owners[h]
        self._num_pairs -= removed
        return removed

    def clear(self, key: WorkerKey) -> int:
        """Drop every block of ``key`` but keep its slot; returns the number dropped."""
        slot = self._slots.get(key)
        return 0 if slot is None else self._clear_slot(slot)

    def _clear_slot(self, slot: int) -> int:
        blocks = self._slot_blocks[slot]
        owners = self._owners
        keep = ~(1 << slot)
        for h in blocks:
            mask = owners[h] & keep
            if mask:
                owners[h] = mask
            else:
                del owners[h]
        dropped = len(blocks)
        self._slot_blocks[slot] = set()  # a fresh set releases the old table's memory
        self._num_pairs -= dropped
        return dropped

    def holds(self, key: WorkerKey, seq_hash: int) -> bool:
        slot = self._slots.get(key)
        return slot is not None and seq_hash in self._slot_blocks[slot]

    def get_num_blocks(self, key: WorkerKey) -> int:
        slot = self._slots.get(key)
        return 0 if slot is None else len(self._slot_blocks[slot])

    @property
    def num_pairs(self) -> int:
        """(worker, block) pairs indexed: the sum of every worker's cache size."""
        return self._num_pairs

    @property
    def num_unique_blocks(self) -> int:
        """Distinct sequence hashes held by at least one worker."""
        return len(self._owners)

    @property
    def num_workers(self) -> int:
        return len(self._slots)

    # --- the query -----------------------------------------------------------------------------

    def find_matches(self, seq_hashes: Sequence[int]) -> OverlapScores:
        """Leading blocks of ``seq_hashes`` held by each worker (see ``OverlapScores``).

        ``live`` is the bitset of workers that hold every block so far. At block ``i`` the
        workers in ``live`` but not holding block ``i`` score ``i`` and leave ``live``; the
        walk ends when ``live`` is empty, and whoever is still in it at the end scores all.
        Each step is one dict lookup and two int operations; bits are only decoded for
        workers that leave, at most once each.
        """
        num_blocks = len(seq_hashes)
        scores: dict[WorkerKey, int] = {}
        if num_blocks == 0:
            return OverlapScores(scores, 0)
        get = self._owners.get
        live = get(seq_hashes[0], 0)
        if not live:
            return OverlapScores(scores, num_blocks)
        keys = self._slot_keys
        depth = num_blocks
        for i in range(1, num_blocks):
            still = live & get(seq_hashes[i], 0)
            if still != live:
                _score_bits(live ^ still, i, keys, scores)
                if not still:
                    return OverlapScores(scores, num_blocks)
                live = still
        _score_bits(live, depth, keys, scores)
        return OverlapScores(scores, num_blocks)


def _score_bits(
    bits: int, depth: int, keys: list[WorkerKey | None], scores: dict[WorkerKey, int]
) -> None:
    """``scores[key of slot s] = depth`` for every set bit ``s`` of ``bits``."""
    while bits:
        low = bits & -bits
        key = keys[low.bit_length() - 1]
        assert key is not None, "a free slot has a bit set in the index"
        scores[key] = depth
        bits ^= low
