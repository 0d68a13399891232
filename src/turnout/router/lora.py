"""LoRA-aware routing: requests for an adapter go only to instances that hold it.

Dynamo's ``LoraFilteredRouter`` in two stages, fed by the model cards in discovery:

1. **Holders.** An instance that has adapter ``a`` loaded publishes a card for it
   (``v1/mdc/.../{instance_id:x}/a``). A request for ``a`` goes to the live holders only,
   chosen among them by the router mode (round-robin, random, or the KV router's cost, whose
   candidates are restricted to the holders; adapter blocks hash apart from base blocks).
2. **No holder.** Every instance lists in its base card the adapters it *can* load
   (``lora_adapters``). The target is picked by rendezvous hashing (highest random weight of
   ``(adapter, instance)`` over the live instances that can load it): every frontend, with no
   coordination, sends the adapter's first requests to the same instance, which loads it and
   then publishes its card; different adapters spread over the instances; an instance leaving
   only moves the adapters it was the winner for.

``LoraRegistry`` is the data structure (which instance holds and can load which adapter), kept
by the model watcher from card PUTs and DELETEs; ``allowed`` is the policy, used by
``LoraSelector`` (simple modes) and the KV push router (``allow``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import xxhash

from turnout.errors import NoInstanceAvailable
from turnout.protocols.llm import PreprocessedRequest
from turnout.protocols.model import ModelDeploymentCard
from turnout.router.selectors import InstanceSelector

__all__ = ["LoraRegistry", "LoraSelector", "rendezvous_pick"]

log = logging.getLogger("turnout.router.lora")


def rendezvous_pick(adapter: str, instance_ids: Sequence[int]) -> int:
    """The instance of ``instance_ids`` (non-empty) with the highest weight for ``adapter``:
    xxh3_64 of ``adapter NUL instance_id`` (stable across processes and runs)."""
    key = adapter.encode() + b"\0"
    return max(
        instance_ids,
        key=lambda i: (xxhash.xxh3_64_intdigest(key + i.to_bytes(8, "little")), i),
    )


class LoraRegistry:
    """Which live instance holds, and which can load, which adapter (from model cards).

    All of it is fed by discovery (workers' cards), never by clients: its size is bounded by
    the instances and the adapters they declare. Everything runs on the event loop.
    """

    __slots__ = ("_adapter_keys", "_base_keys", "_holders", "_loaders")

    def __init__(self) -> None:
        # Adapter card key -> (adapter, instance); adapter -> instances holding it.
        self._adapter_keys: dict[str, tuple[str, int]] = {}
        self._holders: dict[str, set[int]] = {}
        # Base card key -> the card (when it lists adapters); adapter -> {instance: base}.
        self._base_keys: dict[str, ModelDeploymentCard] = {}
        self._loaders: dict[str, dict[int, str]] = {}

    # -- discovery ------------------------------------------------------------------------------

    def on_card(self, key: str, card: ModelDeploymentCard) -> bool:
        """A card was PUT under ``key``. Returns True for an adapter's card (handled here: it
        is not a model of its own), False for a base card (recorded if it lists adapters)."""
        self.on_delete(key)  # a PUT over an older card replaces it
        if card.lora is not None:
            name = card.lora.name
            self._adapter_keys[key] = (name, card.instance_id)
            self._holders.setdefault(name, set()).add(card.instance_id)
            log.info("LoRA adapter %r loaded on instance %x", name, card.instance_id)
            return True
        if card.lora_adapters:
            self._base_keys[key] = card
            for name in card.lora_adapters:
                self._loaders.setdefault(name, {})[card.instance_id] = card.display_name
        return False

    def on_delete(self, key: str) -> bool:
        """The card under ``key`` is gone. True when it was an adapter's card."""
        held = self._adapter_keys.pop(key, None)
        if held is not None:
            name, instance_id = held
            holders = self._holders.get(name)
            if holders is not None:
                holders.discard(instance_id)
                if not holders:
                    del self._holders[name]
            log.info("LoRA adapter %r unloaded from instance %x", name, instance_id)
            return True
        card = self._base_keys.pop(key, None)
        if card is not None:
            for name in card.lora_adapters:
                loaders = self._loaders.get(name)
                if loaders is not None:
                    loaders.pop(card.instance_id, None)
                    if not loaders:
                        del self._loaders[name]
        return False

    # -- queries --------------------------------------------------------------------------------

    def holders(self, adapter: str) -> set[int]:
        """Instances that have ``adapter`` loaded now (a copy)."""
        return set(self._holders.get(adapter, ()))

    def base_model(self, adapter: str) -> str | None:
        """The base model serving ``adapter`` (None: no instance can load it)."""
        loaders = self._loaders.get(adapter)
        if not loaders:
            return None
        return min(loaders.values())  # one base per adapter is the norm; stable if not

    def loaded_adapters(self) -> list[tuple[str, str]]:
        """``(adapter, base model)`` of every adapter some instance holds, sorted."""
        out = []
        for name in sorted(self._holders):
            base = self.base_model(name)
            if base is not None:
                out.append((name, base))
        return out

    def allowed(self, adapter: str, candidates: Sequence[int]) -> list[int]:
        """The candidates a request for ``adapter`` may go to: the holders among them, else
        the rendezvous winner among those that can load it, else none."""
        holders = self._holders.get(adapter)
        if holders:
            held = [c for c in candidates if c in holders]
            if held:
                return held
        loaders = self._loaders.get(adapter)
        if not loaders:
            return []
        able = [c for c in candidates if c in loaders]
        return [rendezvous_pick(adapter, able)] if able else []


class LoraSelector(InstanceSelector):
    """A simple mode's selector, restricted for adapter requests to ``LoraRegistry.allowed``."""

    def __init__(self, inner: InstanceSelector, registry: LoraRegistry) -> None:
        self._inner = inner
        self._registry = registry
        self.needs_pin = inner.needs_pin

    def select(self, candidates: Sequence[int], request: PreprocessedRequest | None) -> int:
        if request is not None and request.lora_name:
            allowed = self._registry.allowed(request.lora_name, candidates)
            if not allowed:
                raise NoInstanceAvailable(
                    f"no live instance holds or can load LoRA adapter {request.lora_name!r}"
                )
            candidates = allowed
        return self._inner.select(candidates, request)
