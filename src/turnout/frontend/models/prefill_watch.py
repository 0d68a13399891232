"""Prefill instances' cards become each model's active prefill side (``PrefillSlot``).

A prefill worker (``turnout worker --role prefill``) publishes a card with ``model_type``
``Prefill`` under the display name of the model it prefills for, on an endpoint of its own.
Such cards are not models: nothing is listed or registered for them. The model watcher hands
them here; as Dynamo's watcher does, the model's prefill router is *activated* when its first
prefill instance appears (a ``PrefillPool`` built by the pipeline factory: the router that
chooses among prefill workers) and *deactivated* with the last one, whether the decode side
of the model is served yet or not.

A prefill card of a model whose prefill side already lives on another endpoint is refused
(logged): one model, one prefill pool.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from turnout.frontend.models.accepted_instances import AcceptedInstances, ModelClient
from turnout.protocols.model import ModelDeploymentCard, ModelType
from turnout.router.prefill_slots import PrefillPool, PrefillSlots

if TYPE_CHECKING:
    from turnout.runtime.component import DistributedRuntime

log = logging.getLogger(__name__)

BuildPool = Callable[[ModelDeploymentCard, ModelClient], Awaitable[PrefillPool]]


def is_prefill_card(card: ModelDeploymentCard) -> bool:
    return bool(card.model_type & ModelType.Prefill)


@dataclass(slots=True, eq=False)
class _PrefillSide:
    card: ModelDeploymentCard
    view: AcceptedInstances
    pool: PrefillPool
    #: Discovery key -> instance id of each prefill entry.
    entries: dict[str, int] = field(default_factory=dict)


class PrefillWatch:
    def __init__(
        self,
        runtime: DistributedRuntime,
        slots: PrefillSlots,
        build_pool: BuildPool,
        view: Callable[[ModelClient], AcceptedInstances],
    ) -> None:
        """``view(client)``: the routing view of an endpoint client (only accepted
        instances); ``build_pool(card, view)``: the factory's pool builder."""
        self._runtime = runtime
        self._slots = slots
        self._build_pool = build_pool
        self._make_view = view
        self._sides: dict[str, _PrefillSide] = {}
        self._names_by_key: dict[str, str] = {}

    def instances(self, name: str) -> list[int] | None:
        """The model's live prefill instances (None: it has no prefill side)."""
        side = self._sides.get(name)
        return None if side is None else list(side.view.instance_ids())

    async def on_put(self, key: str, card: ModelDeploymentCard) -> bool:
        """Take a prefill card; False when it was refused (logged)."""
        name = card.display_name
        side = self._sides.get(name)
        if side is None:
            inner = await self._runtime.endpoint(card.endpoint).client()
            view = self._make_view(inner)
            try:
                pool = await self._build_pool(card, view)
            except Exception as err:
                await inner.close()
                log.error("error activating the prefill router of model %s: %s", name, err)
                return False
            side = self._sides[name] = _PrefillSide(card, view, pool)
            self._add(side, key, card)
            self._slots.slot(name).activate(pool)
            log.info(
                "prefill router activated model=%s endpoint=%s instance=%x",
                name,
                card.endpoint.path(),
                card.instance_id,
            )
            return True
        if card.endpoint != side.card.endpoint:
            log.error(
                "prefill instance refused: model=%s key=%s is on endpoint %s, the model's "
                "prefill workers are on %s",
                name,
                key,
                card.endpoint.path(),
                side.card.endpoint.path(),
            )
            return False
        self._add(side, key, card)
        log.debug("new prefill instance model=%s instance=%x", name, card.instance_id)
        return True

    def _add(self, side: _PrefillSide, key: str, card: ModelDeploymentCard) -> None:
        side.entries[key] = card.instance_id
        self._names_by_key[key] = card.display_name
        side.view.accepted = set(side.entries.values())

    async def on_delete(self, key: str) -> bool:
        """Forget a prefill entry; False when ``key`` is not one."""
        name = self._names_by_key.pop(key, None)
        if name is None:
            return False
        side = self._sides[name]
        del side.entries[key]
        side.view.accepted = set(side.entries.values())
        if side.entries:
            return True
        del self._sides[name]
        self._slots.slot(name).deactivate()
        await side.pool.close()
        await side.view.client.close()
        log.info("prefill router deactivated model=%s (its last prefill instance left)", name)
        return True

    async def close(self) -> None:
        for name, side in list(self._sides.items()):
            self._slots.slot(name).deactivate()
            await side.pool.close()
            await side.view.client.close()
        self._sides.clear()
        self._names_by_key.clear()
