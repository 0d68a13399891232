"""The prefill side of each model in disaggregated serving: a ``PrefillSlot`` per model,
holding a ``PrefillPool`` while the model has prefill instances.

The frontend's model watcher activates a model's slot with a pool when its first prefill
instance appears and deactivates it with the last; the prefill router
(``router.prefill_router``) reads the slot on every request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from turnout.protocols.llm import LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import EndpointId
from turnout.router.kv.router import KvRouter
from turnout.router.push_router import InstanceSource
from turnout.runtime.context import RequestContext

__all__ = ["EngineFn", "PrefillClient", "PrefillPool", "PrefillSlot", "PrefillSlots"]

EngineFn = Callable[[PreprocessedRequest, RequestContext], AsyncIterator[LLMEngineOutput]]


class PrefillClient(InstanceSource, Protocol):
    """What the prefill side needs of the prefill endpoint's client
    (``runtime.endpoint_client.EndpointClient``): a router's view, side-handler calls and
    set-asides."""

    def call(
        self, instance_id: int, name: str, payload: bytes, ctx: RequestContext
    ) -> AsyncIterator[bytes]:
        """Call the side handler ``name`` of an instance (KV handle releases)."""
        ...

    def report_instance_down(self, instance_id: int) -> None:
        """Set an instance aside (it died under a prefill)."""
        ...


@dataclass(slots=True, eq=False)
class PrefillPool:
    """The prefill side of one model while it has prefill instances."""

    endpoint: EndpointId
    #: The prefill endpoint's client (live instances, side-handler calls, set-asides).
    client: PrefillClient
    #: Routes a prefill-stage request to a prefill worker and streams its answer.
    generate: EngineFn
    #: ``card.checksum()`` of the prefill instances: must match the model's.
    checksum: str
    #: The KV router of the prefill endpoint (KV mode), closed on deactivation.
    kv_router: KvRouter | None = None

    async def close(self) -> None:
        if self.kv_router is not None:
            await self.kv_router.close()


class PrefillSlot:
    """One model's prefill side: a ``PrefillPool`` while prefill instances exist, else None.
    Pipelines hold the slot; the model watcher activates and deactivates it."""

    __slots__ = ("_changed", "name", "pool")

    def __init__(self, name: str) -> None:
        self.name = name
        self.pool: PrefillPool | None = None
        self._changed = asyncio.Event()

    def activate(self, pool: PrefillPool) -> None:
        self.pool = pool
        self._changed.set()
        self._changed = asyncio.Event()

    def deactivate(self) -> PrefillPool | None:
        pool, self.pool = self.pool, None
        return pool

    async def wait_active(self, timeout: float) -> PrefillPool | None:
        """The pool, waiting up to ``timeout`` seconds for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.pool is None:
            left = deadline - loop.time()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return self.pool


class PrefillSlots:
    """Every model's slot, by model name (fed by discovery, one per model)."""

    def __init__(self) -> None:
        self._slots: dict[str, PrefillSlot] = {}

    def slot(self, name: str) -> PrefillSlot:
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = PrefillSlot(name)
        return slot

    def active(self, name: str) -> PrefillPool | None:
        slot = self._slots.get(name)
        return slot.pool if slot is not None else None

    def deactivate_all(self) -> list[PrefillPool]:
        """Deactivate every slot (shutdown); the pools, for the caller to close."""
        pools = [slot.deactivate() for slot in self._slots.values()]
        return [pool for pool in pools if pool is not None]
