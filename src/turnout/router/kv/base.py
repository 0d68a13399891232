"""Names shared by the KV router's parts: the worker key, overlap scores, the index contract.

A *worker* here is one data-parallel rank of one instance: engines with ``dp_size > 1`` keep a
KV cache per rank, so the router indexes and loads them apart. ``WorkerKey`` is that pair.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from turnout.protocols.kv import KvCacheEvent

#: Workers a ``take_changed`` source lists at most between two reads; past it (or with no
#: reader at all) it answers ``None``, "reload every worker", instead of growing.
MAX_CHANGED_WORKERS = 4096


class WorkerKey(NamedTuple):
    """One KV cache: an instance and its data-parallel rank. Hashes equal to the plain tuple."""

    worker_id: int
    dp_rank: int = 0


@dataclass(slots=True)
class OverlapScores:
    """How much of a request each worker already caches.

    ``scores[w]`` is the number of *leading* blocks of the request that worker ``w`` holds: the
    count stops at the worker's first missing block. Workers that hold no leading block are
    absent (read them through ``get``, which answers 0).
    """

    scores: dict[WorkerKey, int]
    #: Number of full blocks in the request (the most any worker can score).
    num_blocks: int

    def get(self, worker_key: WorkerKey) -> int:
        return self.scores.get(worker_key, 0)


class EventOutcome(enum.StrEnum):
    """What an index did with one ``KvCacheEvent``."""

    APPLIED = "applied"
    #: Event ids jumped: events were lost. The event was applied anyway (best effort) and the
    #: worker is flagged for a resync until ``reset_worker``.
    GAP = "gap"
    #: An event id already seen (redelivery, or a live event overlapping a snapshot): ignored.
    DUPLICATE = "duplicate"
    #: The index does not use events (approximate mode).
    IGNORED = "ignored"


class KvIndex(Protocol):
    """What the router core needs from an index, exact (events) or approximate (its decisions).

    Implementations are synchronous and not thread-safe: one owner calls them.
    """

    def find_matches(self, seq_hashes: Sequence[int]) -> OverlapScores:
        """Prefix overlap, in blocks, of every worker with the request's sequence hashes.

        ``seq_hashes`` must be a chain (each hash's parent is the one before it, as
        ``hashing.compute_sequence_hashes`` makes them): the index relies on it to skip
        ahead along prefixes that workers hold whole.
        """
        ...

    def apply_event(self, event: KvCacheEvent) -> EventOutcome:
        """Learn from one worker's cache change."""
        ...

    def record_routed(self, worker_key: WorkerKey, seq_hashes: Sequence[int], now: float) -> None:
        """Learn from a routing decision: the request's blocks go to ``worker_key``."""
        ...

    def expire(self, now: float) -> int:
        """Drop what is older than the index's TTL; returns the number of blocks dropped."""
        ...

    def remove_worker(self, worker_id: int) -> int:
        """Forget every rank of ``worker_id``; returns the number of blocks dropped."""
        ...
