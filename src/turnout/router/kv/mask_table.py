"""A numpy hash table from 64-bit sequence hash to a bitset of worker slots.

Why hand-rolled, and why numpy: the index holds about a million hashes, so a request's
lookups miss the CPU caches. A Python dict lookup of a fresh int key touches four cold
places (index table, entry, key object for the equality test, value object), about 1.3 us
each on a busy VM: ~600 us for a 448-block prompt. Here one lookup is one 64-byte bucket of
keys and one mask row, gathered for all the prompt's blocks at once in C, where the misses
overlap: ~50 us.

Layout::

    keys   uint64[num_buckets, 8]          0 = empty slot
    masks  uint64[num_buckets, 8, words]   bit s of the concatenated words = worker slot s
    bucket of hash h = h & (num_buckets - 1)   (sequence hashes are uniform xxh3 values)

Invariants:

* a hash is in at most one place: its bucket, or ``_overflow`` (the bucket was full when it
  came, or the hash is 0, the empty marker);
* a stored key's mask is never all zero: the key is cleared (slot emptied) when it is;
* ``_num_in_buckets`` counts non-empty slots; the table doubles when it passes a quarter of
  the slots, which keeps full buckets (and so the overflow) rare.

Deletion empties the slot in place: with buckets there are no probe chains to repair.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_WAYS = 8
_U64 = np.uint64


class MaskTable:
    """Sequence hash -> bitset of worker slots. Synchronous, not thread-safe."""

    __slots__ = ("_bmask", "_keys", "_masks", "_num_in_buckets", "_overflow", "_words")

    def __init__(self, *, num_buckets: int = 1024, words: int = 1) -> None:
        if num_buckets & (num_buckets - 1):
            raise ValueError(f"num_buckets must be a power of two, got {num_buckets}")
        self._keys = np.zeros((num_buckets, _WAYS), dtype=_U64)
        self._masks = np.zeros((num_buckets, _WAYS, words), dtype=_U64)
        self._bmask = _U64(num_buckets - 1)
        self._words = words
        self._num_in_buckets = 0
        #: hash -> Python int bitset, for hashes that found no room in their bucket (and 0).
        self._overflow: dict[int, int] = {}

    def __len__(self) -> int:
        return self._num_in_buckets + len(self._overflow)

    @property
    def num_buckets(self) -> int:
        return len(self._keys)

    @property
    def num_overflow(self) -> int:
        return len(self._overflow)

    def ensure_slot(self, slot: int) -> None:
        """Widen the masks so that worker slot ``slot`` has a bit."""
        need = slot // 64 + 1
        if need > self._words:
            pad = np.zeros((len(self._keys), _WAYS, need - self._words), dtype=_U64)
            self._masks = np.concatenate([self._masks, pad], axis=2)
            self._words = need

    # --- lookup --------------------------------------------------------------------------------

    def _locate(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each hash: its bucket, its way in the bucket, and whether it is there."""
        buckets = (q & self._bmask).astype(np.intp)
        hit = self._keys[buckets] == q[:, None]
        return buckets, hit.argmax(axis=1), hit.any(axis=1)

    def get(self, seq_hash: int) -> int:
        """The bitset of one hash (0: nobody holds it)."""
        if seq_hash:
            row = self._keys[seq_hash & (len(self._keys) - 1)]
            ways = np.flatnonzero(row == _U64(seq_hash))
            if len(ways):
                return _row_to_int(self._masks[seq_hash & (len(self._keys) - 1), ways[0]])
        return self._overflow.get(seq_hash, 0)

    def get_masks(self, seq_hashes: Sequence[int]) -> np.ndarray:
        """Bitsets of ``seq_hashes`` as a ``uint64[n, words]`` array, vectorised.

        Accurate up to (and including) the first hash that nobody holds; later rows may be
        left 0 for hashes that live in the overflow, which a prefix match never reads.
        """
        q = np.array(seq_hashes, dtype=_U64)
        buckets, ways, found = self._locate(q)
        masks = self._masks[buckets, ways]
        masks[~found] = 0
        if self._overflow:
            overflow = self._overflow
            for i in np.flatnonzero(~found).tolist():
                value = overflow.get(int(seq_hashes[i]), 0)
                if not value:
                    break
                masks[i] = _int_to_row(value, self._words)
        return masks

    # --- updates -------------------------------------------------------------------------------

    def set_bit(self, seq_hashes: Sequence[int], slot: int) -> None:
        """Add worker ``slot`` to the holders of each hash (inserting new hashes)."""
        if not seq_hashes:
            return
        self.ensure_slot(slot)
        word, bit = divmod(slot, 64)
        q = np.array(seq_hashes, dtype=_U64)
        buckets, ways, found = self._locate(q)
        if found.any():
            self._masks[buckets[found], ways[found], word] |= _U64(1 << bit)
        if not found.all():
            new = ~found
            rows = np.zeros((int(new.sum()), self._words), dtype=_U64)
            rows[:, word] = _U64(1 << bit)
            self._insert(q[new], rows)

    def clear_bit(self, seq_hashes: Sequence[int], slot: int) -> None:
        """Remove worker ``slot`` from the holders of each hash; hashes left with no holder
        are deleted. Hashes not in the table are ignored."""
        if not seq_hashes or slot // 64 >= self._words:
            return
        word, bit = divmod(slot, 64)
        q = np.array(seq_hashes, dtype=_U64)
        buckets, ways, found = self._locate(q)
        if found.any():
            b, w = buckets[found], ways[found]
            self._masks[b, w, word] &= ~_U64(1 << bit)
            empty = ~self._masks[b, w].any(axis=1)
            if empty.any():
                eb, ew = b[empty], w[empty]
                # A hash may repeat in seq_hashes: count each emptied way once.
                emptied = np.unique(eb * _WAYS + ew)
                self._keys[emptied // _WAYS, emptied % _WAYS] = 0
                self._num_in_buckets -= len(emptied)
        if self._overflow and not found.all():
            keep = ~(1 << slot)
            for i in np.flatnonzero(~found).tolist():
                h = int(seq_hashes[i])
                value = self._overflow.get(h)
                if value is not None:
                    value &= keep
                    if value:
                        self._overflow[h] = value
                    else:
                        del self._overflow[h]

    def _insert(self, q: np.ndarray, rows: np.ndarray) -> None:
        """Insert hashes not yet present (distinct or not) with their mask rows."""
        if self._num_in_buckets + len(q) > len(self._keys) * _WAYS // 4:
            self._grow(self._num_in_buckets + len(q))
        q, first = np.unique(q, return_index=True)  # a hash repeated in one batch: once
        rows = rows[first]
        zero = q == 0
        if zero.any():
            self._overflow[0] = self._overflow.get(0, 0) | _row_to_int(rows[zero][0])
            q, rows = q[~zero], rows[~zero]
        keys, masks = self._keys, self._masks
        while len(q):
            buckets = (q & self._bmask).astype(np.intp)
            free = keys[buckets] == 0
            has_room = free.any(axis=1)
            ways = free.argmax(axis=1)
            # Two new hashes for one bucket in this round: the first goes now, the other in
            # the next round (it will see the way taken).
            _, first = np.unique(buckets, return_index=True)
            now = np.zeros(len(q), dtype=bool)
            now[first] = True
            now &= has_room
            keys[buckets[now], ways[now]] = q[now]
            masks[buckets[now], ways[now]] = rows[now]
            self._num_in_buckets += int(now.sum())
            for i in np.flatnonzero(~has_room).tolist():
                self._overflow[int(q[i])] = _row_to_int(rows[i])
            later = ~now & has_room
            q, rows = q[later], rows[later]

    def _grow(self, min_entries: int) -> None:
        num_buckets = len(self._keys)
        while min_entries > num_buckets * _WAYS // 4:
            num_buckets *= 2
        present = self._keys != 0
        old_q = self._keys[present]
        old_rows = self._masks[present]
        self._keys = np.zeros((num_buckets, _WAYS), dtype=_U64)
        self._masks = np.zeros((num_buckets, _WAYS, self._words), dtype=_U64)
        self._bmask = _U64(num_buckets - 1)
        self._num_in_buckets = 0
        overflow = self._overflow
        self._overflow = {}
        if len(old_q):
            self._insert(old_q, old_rows)
        # Hashes that overflowed before may fit in the bigger table now.
        zero = overflow.pop(0, None)
        if overflow:
            hashes = np.fromiter(overflow, dtype=_U64, count=len(overflow))
            rows = np.stack([_int_to_row(v, self._words) for v in overflow.values()])
            self._insert(hashes, rows)
        if zero is not None:
            self._overflow[0] = zero


def _row_to_int(row: np.ndarray) -> int:
    value = 0
    for i, word in enumerate(row.tolist()):
        value |= word << (64 * i)
    return value


def _int_to_row(value: int, words: int) -> np.ndarray:
    return np.array([(value >> (64 * i)) & 0xFFFFFFFFFFFFFFFF for i in range(words)], dtype=_U64)
