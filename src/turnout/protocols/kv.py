"""KV cache events and load reports: what workers publish on the event plane for the router.

The event shapes follow vLLM's KV events (``BlockStored`` with the parent hash, the blocks'
hashes and token ids; ``BlockRemoved``; ``AllBlocksCleared``), wrapped with a per-worker,
strictly increasing ``event_id`` so a subscriber can detect a gap and resynchronise.

Hashes: ``LocalBlockHash`` is the hash of one block's tokens alone; ``SequenceHash`` chains
the parent's sequence hash, so it names a whole prefix. They are different types on purpose.
"""

from __future__ import annotations

from typing import NewType

import msgspec

WorkerId = NewType("WorkerId", int)
LocalBlockHash = NewType("LocalBlockHash", int)
SequenceHash = NewType("SequenceHash", int)

KV_EVENTS_TOPIC = "kv_events"
LOAD_TOPIC = "load"


class StoredBlock(msgspec.Struct, frozen=True, array_like=True):
    block_hash: int  # SequenceHash
    tokens_hash: int  # LocalBlockHash
    num_tokens: int


class BlockStored(msgspec.Struct, tag="stored", kw_only=True):
    """Blocks became resident, in prefix order; the first one's parent is ``parent_hash``."""

    parent_hash: int | None
    blocks: list[StoredBlock]
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag="removed", kw_only=True):
    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag="cleared", kw_only=True):
    pass


KvEventData = BlockStored | BlockRemoved | AllBlocksCleared


class KvCacheEvent(msgspec.Struct, kw_only=True):
    """One change of one worker's cache."""

    worker_id: int
    event_id: int
    data: KvEventData
    dp_rank: int = 0


class KvEventBatch(msgspec.Struct, kw_only=True):
    """Events in the order they happened; ``event_id`` increases by one from each to the next."""

    events: list[KvCacheEvent]


class StepSample(msgspec.Struct, frozen=True, array_like=True):
    """How long one engine step took (wall seconds) and what it computed: routers fit each
    worker's step-time model from these, so predicted times to first token track the real
    hardware (and its load) rather than a guess."""

    #: Prompt tokens computed in the step (prefill chunks; cached tokens are not computed).
    prefill_tokens: int
    #: Requests that decoded one token in the step.
    num_decodes: int
    seconds: float
    #: Share of the KV cache in use during the step (decode steps read all of it).
    kv_usage: float = 0.0


class LoadReport(msgspec.Struct, kw_only=True):
    """A worker's load, published at a steady rate and on change."""

    worker_id: int
    dp_rank: int = 0
    active_prefill_tokens: int = 0
    active_decode_blocks: int = 0
    kv_usage: float = 0.0
    num_waiting: int = 0
    num_running: int = 0
    total_kv_blocks: int = 0
    #: The worker refuses new requests now (its waiting queue is at its bound): routers
    #: leave it out, whatever their thresholds, until a report says otherwise.
    busy: bool = False
    #: A sample of the steps since the previous report (bounded; an engine that cannot time
    #: its steps sends none, and routers keep their prior).
    steps: list[StepSample] = msgspec.field(default_factory=list)
    #: The engine's per-step token budget (vLLM's ``max_num_batched_tokens``; 0: unknown):
    #: a long prefill takes ``ceil(tokens / budget)`` steps.
    max_num_batched_tokens: int = 0


KV_SNAPSHOT_HANDLER = "kv_snapshot"


class KvSnapshotRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    dp_rank: int = 0


class KvSnapshot(msgspec.Struct, kw_only=True):
    """A worker's whole resident cache, for a router that lost events (a gap) or joined late.

    ``events`` rebuild the cache when applied in order to an empty worker; ``next_event_id``
    is the id of the first live event not already reflected in them.
    """

    worker_id: int
    dp_rank: int
    next_event_id: int
    events: list[KvCacheEvent]
