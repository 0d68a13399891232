"""The simulated KV cache: a fixed number of blocks, shared by content, cached after use.

Mental model (vLLM's prefix-caching block pool, without the memory)::

    capacity = num_gpu_blocks
             = never-used/released slots  (num_free_slots)
             + private blocks             (a request's partial tail block; no hash yet)
             + resident full blocks       (keyed by SequenceHash)
                 ├── in use   (ref_count > 0, shared by every request whose prefix has it)
                 └── cached   (ref_count == 0, in the LRU, reusable until evicted)

* A request first *allocates* anonymous private blocks for the tokens it is about to
  compute. When a block fills up, the scheduler *commits* it under its sequence hash: it
  becomes resident (``BlockStored``) or, when that content is already resident, the request
  shares the existing block and the private one goes back to the free slots.
* ``free`` drops a request's references, tail first; a block whose count reaches zero goes to
  the most-recent end of the LRU, still resident and still matchable.
* ``allocate`` takes free slots first, then evicts from the least-recent end of the LRU
  (``BlockRemoved``).

Invariants (checked by ``check_invariants``, which tests call):

1. ``ref_count >= 0``; a block is in the LRU iff it is resident with ``ref_count == 0``.
2. Prefix closure: a resident block's parent is resident. A request holds its whole prefix,
   and ``free`` releases it tail first, so a parent always enters the LRU after (more recently
   than) its children: popping the least-recent entry evicts a leaf first, never a block
   whose child is still cached. The tree needs no child counters for this.
3. ``num_used == in-use full blocks + private blocks`` and
   ``num_free_slots + len(resident) + private == capacity``; the counters move at each
   transition, never by scanning.

Events are buffered and drained by ``take_events``, which numbers them per pool (a worker's
DP rank) with ids increasing by one. Replaying them reproduces ``get_resident_hashes()``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from turnout.protocols.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    KvEventData,
    StoredBlock,
)


@dataclass(slots=True)
class _Block:
    """One resident full block. Only ``KvBlockPool`` changes its fields."""

    seq_hash: int
    local_hash: int
    parent: int | None
    ref_count: int


class KvBlockPool:
    """Reference-counted, content-addressed KV blocks with an LRU of cached ones (sync)."""

    __slots__ = (
        "_block_size",
        "_blocks",
        "_capacity",
        "_lru",
        "_next_event_id",
        "_num_in_use_full",
        "_num_private",
        "_pending",
        "dp_rank",
        "worker_id",
    )

    def __init__(
        self, num_blocks: int, block_size: int, *, worker_id: int = 0, dp_rank: int = 0
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}"
            )
        self._capacity = num_blocks
        self._block_size = block_size
        self._blocks: dict[int, _Block] = {}
        # Resident blocks with ref_count 0, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._num_private = 0
        self._num_in_use_full = 0
        self._pending: list[KvEventData] = []
        self._next_event_id = 0
        #: Stamped on drained events; settable because a worker learns its id late.
        self.worker_id = worker_id
        self.dp_rank = dp_rank

    # ---- counters -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request (private ones included)."""
        return self._num_in_use_full + self._num_private

    @property
    def num_resident(self) -> int:
        """Full blocks with a hash: in use or cached."""
        return len(self._blocks)

    @property
    def num_cached_free(self) -> int:
        """Resident blocks nobody holds (evictable)."""
        return len(self._lru)

    @property
    def num_free_slots(self) -> int:
        return self._capacity - len(self._blocks) - self._num_private

    @property
    def num_available(self) -> int:
        """Blocks ``allocate`` can hand out now (free slots plus evictable cached blocks)."""
        return self._capacity - self.num_used

    @property
    def usage(self) -> float:
        return self.num_used / self._capacity

    # ---- lookups --------------------------------------------------------------------------

    def num_cached_prefix(self, seq_hashes: Sequence[int]) -> int:
        """How many leading blocks of ``seq_hashes`` are resident (in use or cached)."""
        blocks = self._blocks
        n = 0
        for h in seq_hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def is_resident(self, seq_hash: int) -> bool:
        """Whether ``seq_hash`` names a resident block (in use or cached)."""
        return seq_hash in self._blocks

    def get_ref_count(self, seq_hash: int) -> int:
        """0 for a cached or absent block."""
        block = self._blocks.get(seq_hash)
        return block.ref_count if block is not None else 0

    def get_resident_hashes(self) -> set[int]:
        """A copy of the resident set (a scan: for tests and resyncs, not the hot path)."""
        return set(self._blocks)

    # ---- transitions ----------------------------------------------------------------------

    def acquire_cached(self, seq_hashes: Iterable[int]) -> None:
        """Take a reference on resident blocks (a prefix hit); each must be resident."""
        blocks = self._blocks
        for h in seq_hashes:
            block = blocks[h]
            if block.ref_count == 0:
                del self._lru[h]
                self._num_in_use_full += 1
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> bool:
        """Reserve ``num_blocks`` private blocks, evicting cached ones as needed.

        Returns False, changing nothing, when there is no room: the caller preempts.
        """
        if num_blocks <= 0:
            return True
        if num_blocks > self._capacity - self.num_used:
            return False
        shortfall = num_blocks - self.num_free_slots
        if shortfall > 0:
            self._evict(shortfall)
        self._num_private += num_blocks
        return True

    def commit(
        self,
        seq_hash: int,
        local_hash: int,
        parent: int | None,
        *,
        lora_name: str | None = None,
    ) -> None:
        """Turn one private block, now full, into the resident block ``seq_hash``.

        When that content is already resident, the caller shares it instead and the private
        block returns to the free slots (no event: the cache did not change).
        """
        assert self._num_private > 0, "commit without a private block"
        self._num_private -= 1
        block = self._blocks.get(seq_hash)
        if block is not None:
            if block.ref_count == 0:
                del self._lru[seq_hash]
                self._num_in_use_full += 1
            block.ref_count += 1
            return
        self._blocks[seq_hash] = _Block(seq_hash, local_hash, parent, 1)
        self._num_in_use_full += 1
        self._record_stored(parent, StoredBlock(seq_hash, local_hash, self._block_size), lora_name)

    def free(self, seq_hashes: Sequence[int], num_private: int = 0) -> None:
        """Drop one reference on each of ``seq_hashes`` (tail first) and release
        ``num_private`` private blocks."""
        assert 0 <= num_private <= self._num_private, "freeing private blocks never allocated"
        self._num_private -= num_private
        blocks = self._blocks
        lru = self._lru
        for h in reversed(seq_hashes):
            block = blocks[h]
            assert block.ref_count > 0, f"block {h:x} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._num_in_use_full -= 1
                lru[h] = None  # most recently used end

    def reset(self) -> bool:
        """Drop every cached block (``AllBlocksCleared``). Refused (False) while any block
        is in use, as vLLM's ``reset_prefix_cache`` is."""
        if self.num_used:
            return False
        self._blocks.clear()
        self._lru.clear()
        self._pending.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvCacheEvent]:
        """Drain the events since the last call, numbered with consecutive ids."""
        if not self._pending:
            return []
        out: list[KvCacheEvent] = []
        event_id = self._next_event_id
        for data in self._pending:
            out.append(
                KvCacheEvent(
                    worker_id=self.worker_id, event_id=event_id, data=data, dp_rank=self.dp_rank
                )
            )
            event_id += 1
        self._next_event_id = event_id
        self._pending = []
        return out

    def snapshot(self) -> tuple[list[KvCacheEvent], int]:
        """The resident cache as ``BlockStored`` events, and the id of the first event not
        reflected in them (pending events describe changes already in the snapshot).

        A scan, for a router's resync, never on the hot path. Parents come before children:
        a child is committed after its parent, and a parent is never evicted while a child
        is resident, so the dict's insertion order is a topological order.
        """
        events = [
            KvCacheEvent(
                worker_id=self.worker_id,
                event_id=-1,
                dp_rank=self.dp_rank,
                data=BlockStored(
                    parent_hash=block.parent,
                    blocks=[StoredBlock(block.seq_hash, block.local_hash, self._block_size)],
                ),
            )
            for block in self._blocks.values()
        ]
        return events, self._next_event_id + len(self._pending)

    # ---- internals ------------------------------------------------------------------------

    def _evict(self, count: int) -> None:
        """Evict ``count`` least recently used cached blocks (leaves first, see invariant 2)."""
        removed: list[int] = []
        blocks = self._blocks
        lru = self._lru
        for _ in range(count):
            h, _none = lru.popitem(last=False)
            del blocks[h]
            removed.append(h)
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.extend(removed)
        else:
            self._pending.append(BlockRemoved(block_hashes=removed))

    def _record_stored(self, parent: int | None, block: StoredBlock, lora: str | None) -> None:
        """Buffer a ``BlockStored``, extending the previous one when this block continues
        its chain (a prefill that fills several blocks is one event)."""
        last = self._pending[-1] if self._pending else None
        if (
            isinstance(last, BlockStored)
            and parent is not None
            and last.lora_name == lora
            and last.blocks[-1].block_hash == parent
        ):
            last.blocks.append(block)
            return
        self._pending.append(BlockStored(parent_hash=parent, blocks=[block], lora_name=lora))

    def check_invariants(self) -> None:
        """Verify the module docstring's invariants by scanning (tests only; raises
        AssertionError naming the broken one)."""
        in_use = 0
        for h, block in self._blocks.items():
            if block.ref_count < 0:
                raise AssertionError(f"block {h:x} has ref_count {block.ref_count}")
            if (block.ref_count == 0) != (h in self._lru):
                raise AssertionError(
                    f"block {h:x}: ref_count {block.ref_count}, in LRU: {h in self._lru}"
                )
            if block.parent is not None and block.parent not in self._blocks:
                raise AssertionError(f"block {h:x} resident without its parent")
            in_use += block.ref_count > 0
        for h in self._lru:
            if h not in self._blocks:
                raise AssertionError(f"LRU holds {h:x}, which is not resident")
        if in_use != self._num_in_use_full:
            raise AssertionError(f"in-use counter {self._num_in_use_full} != {in_use}")
        if self.num_free_slots < 0 or self._num_private < 0:
            raise AssertionError("more blocks in use than capacity")
