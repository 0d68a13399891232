"""A worker's LoRA adapter cards: one model card per *loaded* adapter, as Dynamo publishes them.

What a worker publishes, and when:

* its base card (``v1/mdc/{endpoint}/{instance_id:x}``) lists every adapter it *can* load in
  ``lora_adapters`` (fixed for the worker's life), so a frontend can send an adapter's first
  request to an instance that will load it;
* while an adapter is loaded, a card of its own at ``v1/mdc/{endpoint}/{instance_id:x}/{lora}``:
  the base card with ``display_name`` = the adapter's name (what clients put in ``"model"``),
  ``lora = LoraInfo(name=...)`` and no ``lora_adapters``;
* the card is deleted when the engine evicts the adapter. Every card is written under the
  instance's lease, so all of them vanish with the worker (or its lease).

The engine reports loads and evictions synchronously (``set_lora_listener``); the store is
async, so one task reconciles the published set with the engine's loaded set: changes are
applied in order, a burst of them costs one pass, and nothing grows without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec

from turnout.protocols.model import LoraInfo, ModelDeploymentCard, mdc_key
from turnout.runtime.discovery.base import DiscoveryStore

__all__ = ["LoraCardPublisher", "adapter_card"]

log = logging.getLogger("turnout.worker")

_json = msgspec.json.Encoder()


def adapter_card(base: ModelDeploymentCard, name: str) -> ModelDeploymentCard:
    """The card of adapter ``name`` loaded on ``base``'s instance."""
    return msgspec.structs.replace(
        base, display_name=name, lora=LoraInfo(name=name), lora_adapters=[]
    )


class LoraCardPublisher:
    """Keeps ``{lora}`` cards in the store equal to the engine's loaded adapters."""

    def __init__(self, store: DiscoveryStore, loaded: Callable[[], list[str]]) -> None:
        self._store = store
        self._loaded = loaded
        #: The base card and lease the adapter cards are written with (set by ``records``).
        self._base: ModelDeploymentCard | None = None
        self._published: set[str] = set()
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def records(self, base: ModelDeploymentCard) -> list[tuple[str, bytes]]:
        """The adapter cards to write with a (new) registration of ``base``'s instance."""
        self._base = base
        names = self._loaded()
        self._published = set(names)
        return [
            (mdc_key(base.endpoint, base.instance_id, n), _json.encode(adapter_card(base, n)))
            for n in names
        ]

    def on_lora(self, name: str, loaded: bool) -> None:
        """The engine's listener: an adapter was loaded or evicted."""
        self._dirty.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="lora-card-publisher"
            )

    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            base = self._base
            if base is None:
                continue
            want = set(self._loaded())
            for name in sorted(self._published - want):
                try:
                    await self._store.delete(mdc_key(base.endpoint, base.instance_id, name))
                    self._published.discard(name)
                    log.info("worker %x: LoRA adapter %r unloaded", base.instance_id, name)
                except Exception as exc:  # the lease's end removes it anyway
                    log.warning("removing the card of LoRA adapter %r failed: %s", name, exc)
            for name in sorted(want - self._published):
                key = mdc_key(base.endpoint, base.instance_id, name)
                try:
                    value = _json.encode(adapter_card(base, name))
                    # An instance's id is its lease's id (``runtime.serving``).
                    await self._store.put(key, value, lease_id=base.instance_id)
                    self._published.add(name)
                    log.info("worker %x: LoRA adapter %r loaded", base.instance_id, name)
                except Exception as exc:  # re-registration publishes what is loaded then
                    log.warning("publishing the card of LoRA adapter %r failed: %s", name, exc)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
