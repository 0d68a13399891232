"""The data structure under both KV indexers: which workers hold which sequence hashes.

Mental model: a sequence hash names a whole prefix (it chains its parent's), so "worker ``w``
holds the first ``k`` blocks of a request" is just "``w`` holds each of the request's first
``k`` sequence hashes". No tree of node objects is needed; a flat map from hash to holders
(an int used as a bitset over worker slots) answers it, fast in Python.

::

    _owners:   SequenceHash -> int bitset over worker slots       (bit s = slot s holds it)
    _held[s]:  SequenceHash -> its parent (ROOT / UNKNOWN_PARENT)  the blocks slot s holds
    _kids[s]:  parent hash  -> how many blocks slot s holds under that parent
    _orphans[s]: blocks slot s holds whose parent it does not hold (UNKNOWN counts as such)
    _dirty:    bitset of slots with _orphans > 0
    _slot_keys: slot -> WorkerKey | None (free)                    _slots: WorkerKey -> slot

Invariants (kept by every method here; nothing else touches these fields):

* bit ``s`` of ``_owners[h]`` is set  <=>  ``h in _held[s]``; no ``_owners`` value is 0;
* ``_kids[s][p] == #{h in _held[s] : _held[s][h] == p}``, entries > 0 only;
* ``_orphans[s] == sum(c for p, c in _kids[s].items() if p != ROOT and p not in _held[s])``;
* bit ``s`` of ``_dirty`` is set  <=>  ``_orphans[s] > 0``;
* ``_slot_keys[s]`` is ``None`` exactly for the free slots, which are in ``_free`` (a heap,
  so the lowest slot is reused first and bitsets stay narrow);
* ``_num_pairs == sum(len(h) for h in _held)``.

Why the parent bookkeeping: ``find_matches`` is bound by memory latency, not by Python. With
a million hashes indexed, a lookup of a block not touched lately costs ~1 us (four cold cache
lines: dict index, entry, key object, value object), so walking all 512 blocks of an 8K
prompt costs ~0.5 ms. A worker without orphans ("clean") holds every ancestor of every
block it holds, so along a request's chain the set of clean holders only shrinks: the depths
where it shrinks can be found by galloping + binary search, ~2 log2(gap) lookups per
distinct depth instead of one per block. Workers with orphans (a block evicted before its
child, a stored block whose parent is unknown) are rare; when one of them holds the first
block, the plain block-by-block walk runs instead. Both give the same, exact answer.

A numpy bucketed hash table with vectorised gathers was also tried: no faster when cold
(TLB misses serialise the gathers too), slower for shared prefixes and to update.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

from turnout.router.kv.base import OverlapScores, WorkerKey

#: Parent of a first block (its sequence hash is its local hash). Never a real hash key
#: of ``_held`` (hashes are unsigned), so it is never "held".
ROOT = -1
#: Parent not known (stored without a parent hash, yet not a first block): always an orphan.
UNKNOWN_PARENT = -2


class BlockOwnerIndex:
    """Map from sequence hash to the set (bitset) of workers holding it. Not thread-safe."""

    __slots__ = (
        "_dirty",
        "_free",
        "_held",
        "_kids",
        "_num_pairs",
        "_orphans",
        "_owners",
        "_slot_keys",
        "_slots",
    )

    def __init__(self) -> None:
        self._owners: dict[int, int] = {}
        self._slots: dict[WorkerKey, int] = {}
        self._slot_keys: list[WorkerKey | None] = []
        self._held: list[dict[int, int]] = []
        self._kids: list[dict[int, int]] = []
        self._orphans: list[int] = []
        self._dirty = 0
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
            self._held.append({})
            self._kids.append({})
            self._orphans.append(0)
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

    def store_chain(self, slot: int, seq_hashes: Sequence[int], parent: int) -> int:
        """Mark a chain held by ``slot``: ``seq_hashes[0]``'s parent is ``parent`` (a hash,
        ``ROOT`` or ``UNKNOWN_PARENT``), each later block's is the block before it. Blocks
        already held keep their recorded parent. Returns how many were new to the slot."""
        owners = self._owners
        get = owners.get
        held = self._held[slot]
        kids = self._kids[slot]
        bit = 1 << slot
        orphans = self._orphans[slot]
        added = 0
        for h in seq_hashes:
            if h not in held:
                if parent != ROOT and parent not in held:
                    orphans += 1  # (UNKNOWN_PARENT is never held)
                orphans -= kids.get(h, 0)  # its children held before it are orphans no more
                owners[h] = get(h, 0) | bit
                held[h] = parent
                kids[parent] = kids.get(parent, 0) + 1
                added += 1
            parent = h
        self._set_orphans(slot, orphans)
        self._num_pairs += added
        return added

    def remove(self, slot: int, seq_hashes: Sequence[int]) -> int:
        """Mark ``seq_hashes`` no longer held by ``slot``; returns how many it held."""
        owners = self._owners
        held = self._held[slot]
        kids = self._kids[slot]
        keep = ~(1 << slot)
        orphans = self._orphans[slot]
        removed = 0
        for h in seq_hashes:
            parent = held.pop(h, None)
            if parent is None:
                continue
            removed += 1
            mask = owners[h] & keep
            if mask:
                owners[h] = mask
            else:
                del owners[h]
            count = kids[parent] - 1
            if count:
                kids[parent] = count
            else:
                del kids[parent]
            if parent != ROOT and parent not in held:
                orphans -= 1  # it was an orphan itself
            orphans += kids.get(h, 0)  # its held children lose their parent
        self._set_orphans(slot, orphans)
        self._num_pairs -= removed
        return removed

    def _set_orphans(self, slot: int, orphans: int) -> None:
        self._orphans[slot] = orphans
        if orphans:
            self._dirty |= 1 << slot
        else:
            self._dirty &= ~(1 << slot)

    def clear(self, key: WorkerKey) -> int:
        """Drop every block of ``key`` but keep its slot; returns the number dropped."""
        slot = self._slots.get(key)
        return 0 if slot is None else self._clear_slot(slot)

    def _clear_slot(self, slot: int) -> int:
        held = self._held[slot]
        owners = self._owners
        keep = ~(1 << slot)
        for h in held:
            mask = owners[h] & keep
            if mask:
                owners[h] = mask
            else:
                del owners[h]
        dropped = len(held)
        self._held[slot] = {}  # fresh tables release the old ones' memory
        self._kids[slot] = {}
        self._set_orphans(slot, 0)
        self._num_pairs -= dropped
        return dropped

    def holds(self, key: WorkerKey, seq_hash: int) -> bool:
        slot = self._slots.get(key)
        return slot is not None and seq_hash in self._held[slot]

    def get_num_blocks(self, key: WorkerKey) -> int:
        slot = self._slots.get(key)
        return 0 if slot is None else len(self._held[slot])

    def is_prefix_closed(self, key: WorkerKey) -> bool:
        """True when the worker holds the parent of every block it holds (no orphans)."""
        slot = self._slots.get(key)
        return slot is None or self._orphans[slot] == 0

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

        ``seq_hashes`` must be a chain of sequence hashes (block ``i``'s parent is block
        ``i - 1``): galloping over clean workers relies on it. An arbitrary list (say, with
        a hash repeated) can be over-counted for clean workers.
        """
        num_blocks = len(seq_hashes)
        scores: dict[WorkerKey, int] = {}
        if num_blocks == 0:
            return OverlapScores(scores, 0)
        live = self._owners.get(seq_hashes[0], 0)
        if live:
            if live & self._dirty:
                self._walk(seq_hashes, live, scores)
            else:
                self._gallop(seq_hashes, live, scores)
        return OverlapScores(scores, num_blocks)

    def _walk(self, seq_hashes: Sequence[int], live: int, scores: dict[WorkerKey, int]) -> None:
        """Block by block. ``live`` = workers holding every block so far; at block ``i``
        those not holding it score ``i`` and leave; stop when none is left."""
        get = self._owners.get
        keys = self._slot_keys
        num_blocks = len(seq_hashes)
        for i in range(1, num_blocks):
            still = live & get(seq_hashes[i], 0)
            if still != live:
                _score_bits(live ^ still, i, keys, scores)
                if not still:
                    return
                live = still
        _score_bits(live, num_blocks, keys, scores)

    def _gallop(self, seq_hashes: Sequence[int], live: int, scores: dict[WorkerKey, int]) -> None:
        """For clean workers only: ``holders(i) & live`` only shrinks with ``i``.

        ::

            ok = last index known to have holders == live, bad = first known not to
            gallop:  ok+1, ok+2, ok+4, ...  until a probe differs (or the end)
            bisect:  (ok, bad) down to bad = ok + 1: workers in live but not in
                     holders(bad) score bad; continue from bad with the survivors
        """
        get = self._owners.get
        keys = self._slot_keys
        num_blocks = len(seq_hashes)
        ok = 0
        while True:
            step = 1
            bad = num_blocks  # sentinel: past the end
            after = 0
            while ok + step < num_blocks:
                probe = ok + step
                value = get(seq_hashes[probe], 0) & live
                if value != live:
                    bad, after = probe, value
                    break
                ok = probe
                step <<= 1
            while bad - ok > 1:
                mid = (ok + bad) >> 1
                value = get(seq_hashes[mid], 0) & live
                if value == live:
                    ok = mid
                else:
                    bad, after = mid, value
            if bad >= num_blocks:
                _score_bits(live, num_blocks, keys, scores)
                return
            _score_bits(live ^ after, bad, keys, scores)
            if not after:
                return
            live = after
            ok = bad


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
