"""The exact KV indexer: every worker's cached blocks, learnt from its KV events.

Each worker (``WorkerKey``: instance and data-parallel rank) numbers its events ``event_id``
0, 1, 2, ... The event plane is at-most-once, so the indexer checks the numbering:

::

    expected   got        outcome
    ---------  ---------  ------------------------------------------------------------------
    n          n          APPLIED; expect n+1
    n          m > n      GAP: events n..m-1 were lost. Applied anyway (best effort), the
                          worker is flagged for resync and ``on_gap(key, n, m)`` is called
    n          m < n      DUPLICATE (already applied, or covered by a snapshot): ignored
    unknown    first_id   APPLIED (a worker seen from its first event)
    unknown    other      GAP: the router joined late and missed the worker's history

``reset_worker`` replaces a worker's state with a snapshot (events without id checks) and
sets the next expected id; live events the snapshot already covered are then duplicates.
The async glue that subscribes to the event plane and fetches snapshots is not here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from turnout.protocols.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    KvEventBatch,
    KvEventData,
)
from turnout.router.kv.base import EventOutcome, OverlapScores, WorkerKey
from turnout.router.kv.block_index import ROOT, UNKNOWN_PARENT, BlockOwnerIndex

GapCallback = Callable[[WorkerKey, int, int], None]


class Gap(NamedTuple):
    """Events ``expected .. got-1`` of ``worker_key`` never arrived."""

    worker_key: WorkerKey
    expected: int
    got: int


class KvIndexerStats(msgspec.Struct, kw_only=True):
    """Counters of an exact indexer, for metrics and logs."""

    events_applied: int
    events_duplicate: int
    gaps: int
    resyncs: int
    blocks_indexed: int  # (worker, block) pairs
    unique_blocks: int
    workers: int
    workers_needing_resync: int


@dataclass(slots=True)
class _EventCursor:
    """Per-worker event numbering; changed only by ``_check_event_id`` and ``reset_worker``."""

    #: The next event id we expect; None = accept whatever comes next (after an empty reset).
    expected: int | None
    needs_resync: bool = False


class KvIndexer:
    """Exact index of worker KV caches fed by ``KvCacheEvent``s. Synchronous, not thread-safe.

    ``first_event_id`` is the id of a worker's very first event (None: accept any id as the
    first one, for publishers that do not start at a fixed number).
    """

    def __init__(self, *, first_event_id: int | None = 0, on_gap: GapCallback | None = None):
        self._index = BlockOwnerIndex()
        self._cursors: dict[WorkerKey, _EventCursor] = {}
        self._first_event_id = first_event_id
        self._on_gap = on_gap
        self._events_applied = 0
        self._events_duplicate = 0
        self._gaps = 0
        self._resyncs = 0

    # --- events --------------------------------------------------------------------------------

    def apply_event(self, event: KvCacheEvent) -> EventOutcome:
        """Apply one event after checking its id (see the module docstring's table)."""
        return self._apply(event)[0]

    def apply_batch(self, batch: KvEventBatch | Iterable[KvCacheEvent]) -> list[Gap]:
        """Apply events in order; returns the gaps found (also reported through ``on_gap``)."""
        events = batch.events if isinstance(batch, KvEventBatch) else batch
        gaps: list[Gap] = []
        for event in events:
            outcome, expected = self._apply(event)
            if outcome is EventOutcome.GAP and expected is not None:
                key = WorkerKey(event.worker_id, event.dp_rank)
                gaps.append(Gap(key, expected, event.event_id))
        return gaps

    def _apply(self, event: KvCacheEvent) -> tuple[EventOutcome, int | None]:
        key = WorkerKey(event.worker_id, event.dp_rank)
        outcome, expected = self._check_event_id(key, event.event_id)
        if outcome is not EventOutcome.DUPLICATE:
            self._apply_data(self._index.ensure_worker(key), key, event.data)
            self._events_applied += 1
        return outcome, expected

    def _check_event_id(self, key: WorkerKey, event_id: int) -> tuple[EventOutcome, int | None]:
        """The one place a worker's event numbering advances; returns (outcome, expected)."""
        cursor = self._cursors.get(key)
        if cursor is None:
            cursor = self._cursors[key] = _EventCursor(expected=self._first_event_id)
        expected = cursor.expected
        if expected is None or event_id == expected:
            cursor.expected = event_id + 1
            return EventOutcome.APPLIED, expected
        if event_id < expected:
            self._events_duplicate += 1
            return EventOutcome.DUPLICATE, expected
        cursor.expected = event_id + 1
        cursor.needs_resync = True
        self._gaps += 1
        if self._on_gap is not None:
            self._on_gap(key, expected, event_id)
        return EventOutcome.GAP, expected

    def _apply_data(self, slot: int, key: WorkerKey, data: KvEventData) -> None:
        index = self._index
        if isinstance(data, BlockStored):
            blocks = data.blocks
            if not blocks:
                return
            parent = data.parent_hash
            if parent is None:
                # A first block's sequence hash is its local hash (hashing.py); any other
                # block stored without a parent has one we do not know.
                first = blocks[0]
                parent = ROOT if first.block_hash == first.tokens_hash else UNKNOWN_PARENT
            index.store_chain(slot, [block.block_hash for block in blocks], parent)
        elif isinstance(data, BlockRemoved):
            index.remove(slot, data.block_hashes)
        elif isinstance(data, AllBlocksCleared):
            index.clear(key)
        else:  # pragma: no cover - the union is closed
            raise TypeError(f"unknown KV event data {type(data).__name__}")

    # --- resync and membership -----------------------------------------------------------------

    def reset_worker(
        self,
        worker_key: WorkerKey,
        snapshot_events: Sequence[KvCacheEvent],
        *,
        next_event_id: int | None = None,
    ) -> None:
        """Replace ``worker_key``'s blocks with a snapshot and clear its resync flag.

        The snapshot's events are applied in order without id checks. Afterwards the next
        expected id is ``next_event_id``, else the last snapshot event's id + 1, else (empty
        snapshot, no id given) whatever arrives next is accepted.
        """
        key = WorkerKey(*worker_key)
        slot = self._index.ensure_worker(key)
        self._index.clear(key)
        for event in snapshot_events:
            self._apply_data(slot, key, event.data)
        if next_event_id is None and snapshot_events:
            next_event_id = snapshot_events[-1].event_id + 1
        self._cursors[key] = _EventCursor(expected=next_event_id)
        self._resyncs += 1

    def remove_worker(self, worker_id: int) -> int:
        """Forget every rank of ``worker_id`` (it left discovery); returns blocks dropped."""
        dropped = 0
        for key in [k for k in self._cursors if k.worker_id == worker_id]:
            del self._cursors[key]
        for key in self._index.iter_workers():
            if key.worker_id == worker_id:
                dropped += self._index.release_worker(key)
        return dropped

    def needs_resync(self, worker_key: WorkerKey) -> bool:
        cursor = self._cursors.get(worker_key)
        return cursor is not None and cursor.needs_resync

    def get_workers_needing_resync(self) -> list[WorkerKey]:
        return [k for k, c in self._cursors.items() if c.needs_resync]

    def get_expected_event_id(self, worker_key: WorkerKey) -> int | None:
        """The id the next event of ``worker_key`` should carry (None: any)."""
        cursor = self._cursors.get(worker_key)
        return self._first_event_id if cursor is None else cursor.expected

    # --- queries -------------------------------------------------------------------------------

    def find_matches(self, seq_hashes: Sequence[int]) -> OverlapScores:
        """Prefix overlap in blocks per worker; see ``OverlapScores``."""
        return self._index.find_matches(seq_hashes)

    def record_routed(self, worker_key: WorkerKey, seq_hashes: Sequence[int], now: float) -> None:
        """No-op: the exact index learns from events, not from routing decisions."""

    def expire(self, now: float) -> int:
        """No-op: blocks leave the exact index only when a worker says so."""
        return 0

    def holds(self, worker_key: WorkerKey, seq_hash: int) -> bool:
        return self._index.holds(worker_key, seq_hash)

    def is_prefix_closed(self, worker_key: WorkerKey) -> bool:
        """True when the worker holds the parent of every block it holds (the fast case)."""
        return self._index.is_prefix_closed(worker_key)

    def get_num_blocks(self, worker_key: WorkerKey) -> int:
        """How many blocks ``worker_key`` caches, as far as the index knows."""
        return self._index.get_num_blocks(worker_key)

    def get_workers(self) -> list[WorkerKey]:
        return list(self._index.iter_workers())

    @property
    def num_blocks(self) -> int:
        return self._index.num_pairs

    def get_stats(self) -> KvIndexerStats:
        return KvIndexerStats(
            events_applied=self._events_applied,
            events_duplicate=self._events_duplicate,
            gaps=self._gaps,
            resyncs=self._resyncs,
            blocks_indexed=self._index.num_pairs,
            unique_blocks=self._index.num_unique_blocks,
            workers=self._index.num_workers,
            workers_needing_resync=sum(1 for c in self._cursors.values() if c.needs_resync),
        )
