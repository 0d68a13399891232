"""The mocker's KV activity as an engine's own KV events: token ids, engine-seeded hashes.

The mocker's pool buffers turnout's events (``protocols.kv``: blocks named by turnout's
sequence hashes, no tokens). A stock engine publishes blocks named by *its* hashes, seeded
per process so nobody else can recompute them, with the blocks' token ids. ``KvEventBridge``
is the engine's ``KvEventSink`` that turns one into the other, per data-parallel rank:

* each rank's scheduler tells it the tokens of every block about to become resident
  (``Scheduler.on_block_stored``), held until that block's ``BlockStored`` arrives (the same
  step: the loop publishes after every step);
* a ``BlockStored`` chain gets engine hashes from ``EngineBlockHasher`` (chained from the
  parent's engine hash; the cache salt joins the first block of a request's chain), and the
  rank remembers turnout hash -> engine hash while the block is resident, to name its parent
  and its eviction (``BlockRemoved``) later; ``AllBlocksCleared`` forgets everything;
* the translated batch goes to the rank's ``NativeKvPublisher``, which sends it in the
  engine's encoding and keeps it for replay.

What it holds is bounded by the pool: one engine hash per resident block, and the tokens of
one step's new blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

from turnout.engines.mocker import MockerEngine
from turnout.engines.mocker_server.native_kv import EngineBlockHasher, NativeKvPublisher
from turnout.protocols.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    LoadReport,
)
from turnout.protocols.native_kv import (
    EngineBlockHash,
    NativeCleared,
    NativeEvent,
    NativeRemoved,
    NativeStored,
)

log = logging.getLogger(__name__)

#: Where the simulated blocks live, as vLLM names it.
MEDIUM = "GPU"


class _RankTranslator:
    """One rank's turnout-hash -> engine-hash map and the tokens of its new blocks."""

    __slots__ = ("block_size", "hasher", "num_skipped", "pending", "resident")

    def __init__(self, hasher: EngineBlockHasher, block_size: int) -> None:
        self.hasher = hasher
        self.block_size = block_size
        #: Resident blocks: turnout sequence hash -> engine hash.
        self.resident: dict[int, EngineBlockHash] = {}
        #: Blocks stored this step, before their event: turnout hash -> (tokens, cache salt).
        self.pending: dict[int, tuple[list[int], str | None]] = {}
        #: Stored blocks whose tokens never came (not expected: logged once, counted).
        self.num_skipped = 0

    def on_block_stored(self, seq_hash: int, token_ids: list[int], salt: str | None) -> None:
        self.pending[seq_hash] = (token_ids, salt)

    def translate(self, data: BlockStored | BlockRemoved | AllBlocksCleared) -> NativeEvent | None:
        if isinstance(data, BlockStored):
            return self._stored(data)
        if isinstance(data, BlockRemoved):
            hashes = [self.resident.pop(h) for h in data.block_hashes if h in self.resident]
            return NativeRemoved(block_hashes=hashes, medium=MEDIUM) if hashes else None
        self.resident.clear()
        self.pending.clear()
        return NativeCleared()

    def _stored(self, data: BlockStored) -> NativeStored | None:
        parent = None
        if data.parent_hash is not None:
            parent = self.resident.get(data.parent_hash)
            if parent is None:
                self._skip(data, "its parent is unknown")
                return None
        tokens: list[int] = []
        salt: str | None = None
        for i, block in enumerate(data.blocks):
            entry = self.pending.pop(block.block_hash, None)
            if entry is None:
                self._skip(data, "its tokens were not reported")
                return None
            tokens.extend(entry[0])
            if i == 0:
                salt = entry[1]
        chain_start = parent is None
        hashes = self.hasher.block_hashes(
            tokens,
            self.block_size,
            parent=parent,
            lora_name=data.lora_name,
            cache_salt=salt if chain_start else None,
        )
        for block, engine_hash in zip(data.blocks, hashes, strict=True):
            self.resident[block.block_hash] = engine_hash
        return NativeStored(
            block_hashes=hashes,
            parent_hash=parent,
            token_ids=tokens,
            block_size=self.block_size,
            lora_name=data.lora_name,
            medium=MEDIUM,
            cache_salt=salt if chain_start else None,
        )

    def _skip(self, data: BlockStored, why: str) -> None:
        if not self.num_skipped:
            log.warning("KV event bridge: a BlockStored was not published: %s", why)
        self.num_skipped += 1
        for block in data.blocks:
            self.pending.pop(block.block_hash, None)


class KvEventBridge:
    """A ``KvEventSink`` for a ``MockerEngine`` that publishes its KV events through one
    ``NativeKvPublisher`` per data-parallel rank (see the module docstring). Load reports
    are dropped: a stock engine's load is read from its ``/metrics``."""

    def __init__(
        self,
        engine: MockerEngine,
        publishers: Sequence[NativeKvPublisher],
        hasher: EngineBlockHasher,
    ) -> None:
        schedulers = engine.get_schedulers()
        if len(publishers) != len(schedulers):
            raise ValueError(
                f"{len(schedulers)} ranks need as many publishers, got {len(publishers)}"
            )
        self._publishers = list(publishers)
        self._ranks = [_RankTranslator(hasher, engine.config.block_size) for _ in schedulers]
        for scheduler, rank in zip(schedulers, self._ranks, strict=True):
            scheduler.on_block_stored = rank.on_block_stored
        engine.set_event_sink(self)

    def publish_kv(self, batch: KvEventBatch) -> None:
        by_rank: dict[int, list[NativeEvent]] = {}
        for event in batch.events:
            native = self._ranks[event.dp_rank].translate(event.data)
            if native is not None:
                by_rank.setdefault(event.dp_rank, []).append(native)
        for rank, events in by_rank.items():
            self._publishers[rank].publish(events, dp_rank=rank)

    def publish_load(self, report: LoadReport) -> None:
        pass

    @property
    def num_skipped(self) -> int:
        return sum(rank.num_skipped for rank in self._ranks)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of DP rank ``rank``: the port plus the rank, as vLLM offsets each engine
    core's publisher (port 0 stays 0: each rank gets its own free port)."""
    if rank == 0:
        return endpoint
    parts = urlsplit(endpoint)
    if parts.port is None or parts.port == 0:
        return endpoint
    host = parts.hostname or "*"
    if ":" in host:
        host = f"[{host}]"
    return urlunsplit((parts.scheme, f"{host}:{parts.port + rank}", parts.path, "", ""))
