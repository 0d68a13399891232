"""An attached engine's own KV events, translated into turnout's: the translator.

Mental model: turnout's router indexes blocks by turnout's sequence hashes; a stock engine
names them by hashes seeded inside its process, which nobody else can compute. Every
``BlockStored`` carries the blocks' token ids and the parent's engine hash, so the translator
rehashes the tokens the turnout way and chains them from the parent's *turnout* hash, found in
a per-rank map kept from earlier events::

    engine event   BlockStored(parent=E1, hashes=[E2, E3], tokens=[..32..], block_size=16)
    map            E1 -> S1  (turnout sequence hash of the parent's last block)
    rehash         L2, L3 = xxh3(tokens) under the request's seed (LoRA name, cache salt)
                   S2 = h(S1, L2), S3 = h(S2, L3)
    map            E2 -> S2, E3 -> S3           ; BlockRemoved([E2]) -> removed [S2]
    turnout event  BlockStored(parent_hash=S1, blocks=[(S2, L2), (S3, L3)])

The map is bounded (``max_blocks`` engine blocks per rank, least recently stored or used as a
parent first out). A block pushed out of the map is also removed from the router's view,
so the router never credits a block whose removal it could no longer translate; set the bound
at or above the engine's number of GPU blocks and it never happens. The seed a chain hashes
under (LoRA name, cache salt) is kept with each block, since only a chain's first block says
its salt.

What is not indexed, counted in ``TranslatorStats`` and logged once per kind (then at most
once a minute): blocks outside GPU memory (``medium`` other than GPU: a CPU/disk tier does not
serve a prefill); another KV cache group than ``group_idx``; an engine block size that is not
a multiple of the card's (a multiple is mapped exactly: each engine block is several turnout
blocks); token ids that do not fill the blocks; an adapter known only by its int id (an older
vLLM: its name, which turnout hashes, is unknown); blocks whose hash covers multimodal items
or prompt embeddings (turnout cannot rehash them), and the blocks under an unknown parent.
Every one of these loses cache hits; none credits a worker with blocks it does not hold.

A duplicate ``BlockStored`` (vLLM keeps two physical copies of a block when two requests
filled it at once) is one entry; the first ``BlockRemoved`` of the two removes it. The router
then misses a hit it could have had, which is the safe side.

Output: ``KvCacheEvent``s numbered per rank from 0 with no gap (a skipped engine event takes no
id), and ``snapshot(dp_rank)`` answers a router's resync from the same state. Synchronous and
single-threaded: the subscriber (``native_kv_subscriber``) calls it on the event loop.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from turnout.protocols.block_hashing import compute_local_block_hashes, compute_sequence_hashes
from turnout.protocols.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    KvEventData,
    KvSnapshot,
    StoredBlock,
)
from turnout.protocols.native_kv import (
    EngineBlockHash,
    NativeCleared,
    NativeEvent,
    NativeRemoved,
    NativeStored,
    is_gpu_medium,
)

log = logging.getLogger(__name__)

#: Engine blocks mapped per rank by default: above the GPU blocks of any single engine today.
DEFAULT_MAX_BLOCKS = 1 << 20


class LogGate:
    """Logs each kind of trouble at once the first time, then at most once per
    ``interval_s``, saying how many were not logged: a flood of one malformed input costs a
    line a minute, and a new kind still shows at once."""

    __slots__ = ("_clock", "_interval", "_logger", "_state")

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval = interval_s
        self._clock = clock
        #: kind -> [time of the last line, occurrences not logged since]
        self._state: dict[str, list[float]] = {}

    def warning(self, kind: str, msg: str, *args: object) -> None:
        now = self._clock()
        state = self._state.get(kind)
        if state is not None and now - state[0] < self._interval:
            state[1] += 1
            return
        suppressed = int(state[1]) if state is not None else 0
        self._state[kind] = [now, 0]
        if suppressed:
            self._logger.warning(msg + " (%d more since the last line)", *args, suppressed)
        else:
            self._logger.warning(msg, *args)


class TranslatorStats(msgspec.Struct, kw_only=True):
    """What a translator did, for metrics. Counts are of engine events unless named blocks."""

    #: Engine events translated, indexed or not.
    events_translated: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0
    non_gpu_blocks: int = 0
    other_group_events: int = 0
    block_size_refusals: int = 0
    token_mismatches: int = 0
    unnamed_lora_events: int = 0
    opaque_blocks: int = 0
    unknown_parent_events: int = 0
    unknown_removed_blocks: int = 0
    map_evictions: int = 0


@dataclass(slots=True)
class _Block:
    """One engine block as turnout indexes it. Only ``NativeKvTranslator`` creates these."""

    #: Turnout sequence / local hashes of its card-sized blocks, in order.
    seq_hashes: tuple[int, ...]
    local_hashes: tuple[int, ...]
    #: Turnout sequence hash before ``seq_hashes[0]``; None: the first block of a chain.
    parent: int | None
    #: Card blocks before it in its chain (orders a snapshot parents first).
    depth: int
    lora_name: str | None
    cache_salt: str | None


@dataclass(slots=True)
class _Rank:
    """One data-parallel rank's map and event numbering; changed only by the translator."""

    #: Engine hash -> block, least recently stored or used as a parent first.
    blocks: OrderedDict[EngineBlockHash, _Block] = field(default_factory=OrderedDict)
    next_event_id: int = 0


class NativeKvTranslator:
    """Engine KV events of one attached worker (all its DP ranks) -> turnout ``KvCacheEvent``s.

    ``block_size`` is the card's ``kv_cache_block_size`` (what the router hashes prompts
    with); ``group_idx`` the KV cache group indexed when events name one (vLLM hybrid models).
    """

    def __init__(
        self,
        *,
        block_size: int,
        worker_id: int = 0,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        group_idx: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self._block_size = block_size
        self._max_blocks = max_blocks
        self._group_idx = group_idx
        self._ranks: dict[int, _Rank] = {}
        self._log = LogGate(log, clock=clock)
        self.stats = TranslatorStats()
        #: Stamped on every event; settable because an attached worker learns its id late.
        self.worker_id = worker_id

    @property
    def block_size(self) -> int:
        return self._block_size

    def num_blocks(self, dp_rank: int = 0) -> int:
        """Engine blocks mapped for ``dp_rank``."""
        rank = self._ranks.get(dp_rank)
        return 0 if rank is None else len(rank.blocks)

    def next_event_id(self, dp_rank: int = 0) -> int:
        rank = self._ranks.get(dp_rank)
        return 0 if rank is None else rank.next_event_id

    # ---- events ------------------------------------------------------------------------------

    def translate(self, events: Sequence[NativeEvent], dp_rank: int = 0) -> list[KvCacheEvent]:
        """Turnout events for one engine batch of ``dp_rank``, numbered after the last ones."""
        rank = self._rank(dp_rank)
        out: list[KvEventData] = []
        for event in events:
            if isinstance(event, NativeStored):
                self._stored(rank, dp_rank, event, out)
            elif isinstance(event, NativeRemoved):
                self._removed(rank, event, out)
            elif isinstance(event, NativeCleared):
                rank.blocks.clear()
                self.stats.clears += 1
                out.append(AllBlocksCleared())
            self.stats.events_translated += 1
        return self._number(rank, dp_rank, out)

    def clear(self, dp_rank: int = 0) -> list[KvCacheEvent]:
        """Forget ``dp_rank``'s blocks and tell the router so (an ``AllBlocksCleared``): the
        engine restarted, or events were lost beyond repair."""
        rank = self._rank(dp_rank)
        rank.blocks.clear()
        self.stats.clears += 1
        return self._number(rank, dp_rank, [AllBlocksCleared()])

    def snapshot(self, dp_rank: int = 0) -> KvSnapshot:
        """``dp_rank``'s resident blocks as ``BlockStored`` events, parents before children,
        and the id of the next live event (for a router's ``kv_snapshot`` resync)."""
        rank = self._rank(dp_rank)
        bs = self._block_size
        events = [
            KvCacheEvent(
                worker_id=self.worker_id,
                event_id=-1,
                dp_rank=dp_rank,
                data=BlockStored(
                    parent_hash=block.parent,
                    blocks=[
                        StoredBlock(s, loc, bs)
                        for s, loc in zip(block.seq_hashes, block.local_hashes, strict=True)
                    ],
                    lora_name=block.lora_name,
                ),
            )
            for block in sorted(rank.blocks.values(), key=_depth)
        ]
        return KvSnapshot(
            worker_id=self.worker_id,
            dp_rank=dp_rank,
            next_event_id=rank.next_event_id,
            events=events,
        )

    # ---- internals -----------------------------------------------------------------------------

    def _rank(self, dp_rank: int) -> _Rank:
        rank = self._ranks.get(dp_rank)
        if rank is None:
            rank = self._ranks[dp_rank] = _Rank()
        return rank

    def _number(self, rank: _Rank, dp_rank: int, data: list[KvEventData]) -> list[KvCacheEvent]:
        first = rank.next_event_id
        rank.next_event_id = first + len(data)
        wid = self.worker_id
        return [
            KvCacheEvent(worker_id=wid, event_id=first + i, data=d, dp_rank=dp_rank)
            for i, d in enumerate(data)
        ]

    def _indexed(self, medium: str | None, group_idx: int | None, num_blocks: int) -> bool:
        """Whether an event's blocks are the indexed kind (GPU, the indexed group)."""
        stats = self.stats
        if not is_gpu_medium(medium):
            stats.non_gpu_blocks += num_blocks
            return False
        if group_idx is not None and group_idx != self._group_idx:
            stats.other_group_events += 1
            return False
        return True

    def _stored(
        self, rank: _Rank, dp_rank: int, event: NativeStored, out: list[KvEventData]
    ) -> None:
        stats = self.stats
        hashes = event.block_hashes
        if not hashes or not self._indexed(event.medium, event.group_idx, len(hashes)):
            return
        card = self._block_size
        engine_bs = event.block_size
        if engine_bs % card:
            stats.block_size_refusals += 1
            self._log.warning(
                "block_size",
                "native KV: engine block size %d is not a multiple of the card's %d: its "
                "events are not indexed (set the card's block size to the engine's) "
                "(worker %s, dp_rank %s)",
                engine_bs, card, self.worker_id, dp_rank,
            )  # fmt: skip
            return
        if len(event.token_ids) != len(hashes) * engine_bs:
            stats.token_mismatches += 1
            self._log.warning(
                "tokens",
                "native KV: BlockStored with %d tokens for %d blocks of %d: skipped "
                "(worker %s, dp_rank %s)",
                len(event.token_ids), len(hashes), engine_bs, self.worker_id, dp_rank,
            )  # fmt: skip
            return
        if event.lora_id is not None and not event.lora_name:
            stats.unnamed_lora_events += 1
            self._log.warning(
                "lora",
                "native KV: LoRA blocks named only by int id %s (an engine too old to send "
                "lora_name): not indexed (worker %s, dp_rank %s)",
                event.lora_id, self.worker_id, dp_rank,
            )  # fmt: skip
            return
        num = len(hashes)
        if event.first_opaque_block is not None:
            stats.opaque_blocks += num - event.first_opaque_block
            num = event.first_opaque_block
            if num == 0:
                return
        blocks = rank.blocks
        parent_seq: int | None = None
        depth = 0
        salt = event.cache_salt
        if event.parent_hash is not None:
            parent = blocks.get(event.parent_hash)
            if parent is None:
                stats.unknown_parent_events += 1
                self._log.warning(
                    "parent",
                    "native KV: BlockStored under a parent never stored (or no longer "
                    "mapped): not indexed (worker %s, dp_rank %s)",
                    self.worker_id, dp_rank,
                )  # fmt: skip
                return
            blocks.move_to_end(event.parent_hash)
            parent_seq = parent.seq_hashes[-1]
            depth = parent.depth + len(parent.seq_hashes)
            salt = parent.cache_salt
        lora = event.lora_name or None
        try:
            local = compute_local_block_hashes(
                event.token_ids[: num * engine_bs], card, lora_name=lora, cache_salt=salt
            )
        except (OverflowError, ValueError):  # a token id outside u32
            stats.token_mismatches += 1
            self._log.warning(
                "token_range",
                "native KV: BlockStored with a token id outside u32: skipped "
                "(worker %s, dp_rank %s)",
                self.worker_id, dp_rank,
            )  # fmt: skip
            return
        seq = compute_sequence_hashes(local, parent_seq)
        k = engine_bs // card
        for i in range(num):
            entry = _Block(
                seq_hashes=tuple(seq[i * k : (i + 1) * k]),
                local_hashes=tuple(local[i * k : (i + 1) * k]),
                parent=parent_seq if i == 0 else seq[i * k - 1],
                depth=depth + i * k,
                lora_name=lora,
                cache_salt=salt,
            )
            blocks[hashes[i]] = entry
            blocks.move_to_end(hashes[i])
        stats.stored_blocks += num
        out.append(
            BlockStored(
                parent_hash=parent_seq,
                blocks=[StoredBlock(s, loc, card) for s, loc in zip(seq, local, strict=True)],
                lora_name=lora,
            )
        )
        if len(blocks) > self._max_blocks:
            self._evict(blocks, dp_rank, out)

    def _evict(
        self, blocks: OrderedDict[EngineBlockHash, _Block], dp_rank: int, out: list[KvEventData]
    ) -> None:
        """Push the least recent entries out of the map, and out of the router's view."""
        removed: list[int] = []
        while len(blocks) > self._max_blocks:
            _h, block = blocks.popitem(last=False)
            removed.extend(block.seq_hashes)
            self.stats.map_evictions += 1
        out.append(BlockRemoved(block_hashes=removed))
        self._log.warning(
            "map_full",
            "native KV: more than %d engine blocks mapped: the least recent leave the index "
            "(raise max_blocks to the engine's GPU blocks) (worker %s, dp_rank %s)",
            self._max_blocks, self.worker_id, dp_rank,
        )  # fmt: skip

    def _removed(self, rank: _Rank, event: NativeRemoved, out: list[KvEventData]) -> None:
        if not event.block_hashes or not self._indexed(
            event.medium, event.group_idx, len(event.block_hashes)
        ):
            return
        blocks = rank.blocks
        removed: list[int] = []
        for h in event.block_hashes:
            block = blocks.pop(h, None)
            if block is None:
                self.stats.unknown_removed_blocks += 1  # one we never indexed: nothing to do
                continue
            removed.extend(block.seq_hashes)
            self.stats.removed_blocks += 1
        if removed:
            out.append(BlockRemoved(block_hashes=removed))


def _depth(block: _Block) -> int:
    return block.depth
