"""The approximate KV indexer (``--no-kv-events``): the router predicts caches from its decisions.

Without KV events the router assumes that a worker it sent a request to holds that request's
prompt blocks for ``ttl_s`` seconds (engines keep recently used prefixes, then evict them
under pressure; the TTL stands in for that pressure). Routing the same prefix again refreshes
the prediction.

Expiry is a cheap sweep, not a scan: each ``record_routed`` appends one entry to a FIFO
whose deadlines are non-decreasing (time is monotonic and the TTL fixed), so ``expire(now)``
pops only entries that are due. A popped entry drops a block only if that block was not
refreshed since (its deadline in ``_deadlines`` is still due), so every (worker, block) pair
expires ``ttl_s`` after its *last* routing. ``now`` must come from one monotonic clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from turnout.errors import ConfigError
from turnout.protocols.kv import KvCacheEvent
from turnout.router.kv.base import EventOutcome, OverlapScores, WorkerKey
from turnout.router.kv.block_index import ROOT, BlockOwnerIndex

DEFAULT_APPROX_TTL_S = 120.0


class ApproxIndexer:
    """Predicted worker caches with a TTL. Synchronous, not thread-safe."""

    def __init__(self, *, ttl_s: float = DEFAULT_APPROX_TTL_S) -> None:
        if not ttl_s > 0:
            raise ConfigError(f"approximate KV index TTL must be positive, got {ttl_s}")
        self._ttl_s = ttl_s
        self._index = BlockOwnerIndex()
        #: worker -> {seq hash -> deadline}; the latest deadline of each predicted block.
        self._deadlines: dict[WorkerKey, dict[int, float]] = {}
        #: (deadline, worker, hashes) in routing order, so deadlines are non-decreasing.
        self._queue: deque[tuple[float, WorkerKey, Sequence[int]]] = deque()
        self._num_expired = 0
        self._num_recorded = 0

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    def record_routed(self, worker_key: WorkerKey, seq_hashes: Sequence[int], now: float) -> None:
        """Predict that ``worker_key`` holds ``seq_hashes`` until ``now + ttl_s``."""
        if not seq_hashes:
            return
        key = WorkerKey(*worker_key)
        deadline = now + self._ttl_s
        deadlines = self._deadlines.get(key)
        if deadlines is None:
            deadlines = self._deadlines[key] = {}
        deadlines.update(dict.fromkeys(seq_hashes, deadline))
        # A request's hashes are a chain from the root.
        self._index.store_chain(self._index.ensure_worker(key), seq_hashes, ROOT)
        self._queue.append((deadline, key, tuple(seq_hashes)))
        self._num_recorded += 1

    def expire(self, now: float) -> int:
        """Drop predictions whose deadline is ``<= now``; returns the blocks dropped."""
        queue = self._queue
        dropped = 0
        while queue and queue[0][0] <= now:
            _, key, seq_hashes = queue.popleft()
            deadlines = self._deadlines.get(key)
            slot = self._index.get_slot(key)
            if deadlines is None or slot is None:  # the worker was removed meanwhile
                continue
            due = [h for h in seq_hashes if (d := deadlines.get(h)) is not None and d <= now]
            for h in due:
                deadlines.pop(h, None)  # pop: a hash may repeat within one request
            dropped += self._index.remove(slot, due)
        self._num_expired += dropped
        return dropped

    def find_matches(self, seq_hashes: Sequence[int]) -> OverlapScores:
        """Predicted prefix overlap per worker; call ``expire(now)`` first to drop stale ones."""
        return self._index.find_matches(seq_hashes)

    def apply_event(self, event: KvCacheEvent) -> EventOutcome:
        """Ignored: this index does not use KV events."""
        return EventOutcome.IGNORED

    def remove_worker(self, worker_id: int) -> int:
        """Forget every rank of ``worker_id``; returns the blocks dropped."""
        dropped = 0
        for key in self._index.iter_workers():
            if key.worker_id == worker_id:
                dropped += self._index.release_worker(key)
                self._deadlines.pop(key, None)
        return dropped

    def holds(self, worker_key: WorkerKey, seq_hash: int) -> bool:
        return self._index.holds(worker_key, seq_hash)

    def get_num_blocks(self, worker_key: WorkerKey) -> int:
        return self._index.get_num_blocks(worker_key)

    @property
    def num_blocks(self) -> int:
        """Predicted (worker, block) pairs."""
        return self._index.num_pairs

    @property
    def num_expired(self) -> int:
        return self._num_expired
