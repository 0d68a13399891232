"""Which instance has which multimodal items (images) cached: an approximate index.

Keys are Dynamo's ``preprocessed_multimodal_cache_keys``: blake3 hex of each image URL of a
request, sorted and de-duplicated (``llm.multimodal_keys``), carried on
``PreprocessedRequest.multimodal_cache_keys``.

Workers do not report their image caches, so the index is approximate, like the KV router's
approximate mode: the ``device-aware-weighted`` selector records, per instance, the keys of
the requests it routed there, and assumes them cached for ``ttl_s`` seconds after the last
use, at most ``keys_per_instance`` keys an instance (least recently used first out). An
instance that leaves is forgotten (``retain``). The clock is injected.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

__all__ = [
    "MM_CACHE_KEYS_PER_INSTANCE",
    "MM_CACHE_TTL_S",
    "MultimodalCacheIndex",
]

#: Seconds a routed image is assumed cached on its instance (as ``--kv-approx-ttl``).
MM_CACHE_TTL_S = 120.0
#: Most keys remembered per instance.
MM_CACHE_KEYS_PER_INSTANCE = 1024


class MultimodalCacheIndex:
    """Instance id -> keys assumed cached there (LRU with a TTL per instance)."""

    __slots__ = ("_clock", "_entries", "_keys_per_instance", "_ttl_s")

    def __init__(
        self,
        *,
        ttl_s: float = MM_CACHE_TTL_S,
        keys_per_instance: int = MM_CACHE_KEYS_PER_INSTANCE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0 or keys_per_instance < 1:
            raise ValueError("ttl_s must be > 0 and keys_per_instance >= 1")
        self._ttl_s = ttl_s
        self._keys_per_instance = keys_per_instance
        self._clock = clock
        # Instance -> key -> expiry, oldest use first.
        self._entries: dict[int, OrderedDict[str, float]] = {}

    def record(self, instance_id: int, keys: Sequence[str]) -> None:
        """``keys`` were routed to ``instance_id`` now."""
        if not keys:
            return
        held = self._entries.setdefault(instance_id, OrderedDict())
        expiry = self._clock() + self._ttl_s
        for key in keys:
            held[key] = expiry
            held.move_to_end(key)
        while len(held) > self._keys_per_instance:
            held.popitem(last=False)

    def hits(self, instance_id: int, keys: Sequence[str]) -> int:
        """How many of ``keys`` ``instance_id`` holds (unexpired)."""
        held = self._entries.get(instance_id)
        if not held:
            return 0
        now = self._clock()
        count = 0
        for key in keys:
            expiry = held.get(key)
            if expiry is None:
                continue
            if expiry <= now:
                del held[key]
                continue
            count += 1
        return count

    def num_keys(self, instance_id: int) -> int:
        return len(self._entries.get(instance_id, ()))

    def instance_ids(self) -> list[int]:
        return sorted(self._entries)

    def retain(self, live_ids: Collection[int]) -> None:
        """Forget every instance not in ``live_ids`` (it left discovery)."""
        for instance_id in [i for i in self._entries if i not in live_ids]:
            del self._entries[instance_id]
