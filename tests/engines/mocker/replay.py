"""Test helper: a router's-eye view of one pool, rebuilt from its KV events alone."""

from __future__ import annotations

from turnout.protocols.kv import AllBlocksCleared, BlockRemoved, BlockStored, KvCacheEvent

#: The block size the pool and scheduler tests use.
BS = 4


class ReplayModel:
    """What a router's indexer would know: the resident set rebuilt from events alone."""

    def __init__(self, block_size: int = BS) -> None:
        self.block_size = block_size
        self.resident: set[int] = set()
        self.next_event_id = 0

    def apply(self, events: list[KvCacheEvent]) -> None:
        for ev in events:
            assert ev.event_id == self.next_event_id, "event ids must increase by one"
            self.next_event_id += 1
            data = ev.data
            if isinstance(data, BlockStored):
                if data.parent_hash is not None:
                    assert data.parent_hash in self.resident, "stored under an unknown parent"
                for b in data.blocks:
                    assert b.num_tokens == self.block_size
                    self.resident.add(b.block_hash)
            elif isinstance(data, BlockRemoved):
                for h in data.block_hashes:
                    self.resident.remove(h)
            else:
                assert isinstance(data, AllBlocksCleared)
                self.resident.clear()
