"""The records of the model watcher: a served model, its groups of instances by card, and the
endpoint clients their routing views share; with the decisions read off them.

Every instance of a model publishes a card; instances whose cards are the same (same
``checksum()``) form a ``CardGroup``, which holds the pipelines built from that card and the
routing view (``AcceptedInstances``) that lists only those instances, over the one endpoint
client the model's cards on that endpoint share (``ModelEndpoint``); the factory keeps one KV
router (and one load table, one session table) per card. A ``ServedModel`` has one served
group (its pipelines registered) and any number of standby groups (built, not registered).
The transitions between them live in ``frontend.models.served_cards``; what is here only
reads them:

* ``routable``: the instances of a group that can be routed to now;
* ``choose_next``: the standby group to serve when the served one goes;
* ``held_back_cards``: the instances that get no request, and why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from turnout.frontend.admission.limiter import Cancellable
from turnout.frontend.models.accepted_instances import AcceptedInstances, ModelClient
from turnout.frontend.models.card_intake import WATCHER_LOGGER
from turnout.frontend.models.manager import ModelKind
from turnout.protocols.frontend import HeldBackCard, HoldReason
from turnout.protocols.model import ModelDeploymentCard
from turnout.runtime.plane_refusals import PlaneRefusals

__all__ = [
    "Built",
    "CardGroup",
    "ModelEndpoint",
    "ServedModel",
    "choose_next",
    "close_client",
    "close_endpoints",
    "held_back_cards",
    "routable",
]

log = logging.getLogger(WATCHER_LOGGER)

#: One built pipeline: the kind of request it serves, the engine itself.
Built = tuple[ModelKind, object]


@dataclass(slots=True, eq=False)
class CardGroup:
    """The entries of one model that publish the same card (same checksum), and the pipelines
    built from that card, registered or not.

    A model has one served group (its pipelines registered, its instances the only ones
    new requests are routed to) and any number of standby groups (pipelines built, not
    registered): the new workers of a rolling upgrade, until the served card's last instance
    leaves, and the card switched away from during its grace period.
    """

    name: str
    checksum: str
    #: The first card seen of the group: the one its pipelines were built from.
    card: ModelDeploymentCard
    #: Order of first sight among the model's groups (ties in the choice of a new card).
    seq: int
    #: The routing view its pipelines use: this card's instances only.
    view: AcceptedInstances
    built: list[Built]
    #: Discovery key -> card of every entry (instance, or LoRA entry) with this card.
    entries: dict[str, ModelDeploymentCard] = field(default_factory=dict)

    def instance_ids(self) -> set[int]:
        return {card.instance_id for card in self.entries.values()}


@dataclass(slots=True, eq=False)
class ModelEndpoint:
    """The client of one endpoint a model's cards are announced on, shared by their views,
    and the watcher's listener on it."""

    client: ModelClient
    listener: Callable[[], None]


@dataclass(slots=True, eq=False)
class ServedModel:
    """A served model: its served group, its standby groups (by checksum), and the endpoint
    clients their views share (by endpoint path)."""

    served: CardGroup
    endpoints: dict[str, ModelEndpoint]
    standby: dict[str, CardGroup] = field(default_factory=dict)
    #: Instances of the served group that could be routed to at the last look (announced,
    #: not set aside): when the last of them goes while a standby group has routable
    #: instances, the model switches at once.
    served_live: set[int] = field(default_factory=set)
    #: The card served before the last switch, while it may come back (until
    #: ``previous_until`` on the watcher's clock); one of ``standby``.
    previous: CardGroup | None = None
    previous_until: float = 0.0
    #: Forgets ``previous`` once its grace period is over.
    previous_timer: Cancellable | None = None

    def groups(self) -> list[CardGroup]:
        return [self.served, *self.standby.values()]


def routable(group: CardGroup) -> set[int]:
    """The group's instances its view can route to (announced, not set aside, not refused
    for their planes)."""
    return set(group.view.instance_ids())


def choose_next(model: ServedModel, live_only: bool) -> CardGroup | None:
    """The standby group to serve next: the most instances, ties by the earliest seen.
    ``live_only``: only groups with an instance that can be routed to now."""
    candidates = [g for g in model.standby.values() if g.entries and (not live_only or routable(g))]
    if not candidates:
        return None
    return min(candidates, key=lambda g: (-len(g.instance_ids()), g.seq))


def held_back_cards(models: dict[str, ServedModel], planes: PlaneRefusals) -> list[HeldBackCard]:
    """Every instance with a card of a served model that gets no request, and why:
    refused for its planes, or standby (its card differs from the served one). Sorted by
    model, then instance id."""
    held: list[HeldBackCard] = []
    for name, model in models.items():
        served = model.served
        for group in model.groups():
            for instance_id in sorted(group.instance_ids()):
                refused = planes.reason(instance_id)
                if refused is not None:
                    reason, detail = HoldReason.PLANES_DIFFER, refused
                elif group is not served:
                    reason = HoldReason.CARD_DIFFERS
                    detail = f"served card is {served.checksum}"
                else:
                    continue
                held.append(
                    HeldBackCard(
                        model=name,
                        instance_id=f"{instance_id:x}",
                        checksum=group.checksum,
                        reason=reason,
                        detail=detail,
                    )
                )
    held.sort(key=lambda h: (h.model, int(h.instance_id, 16)))
    return held


async def close_endpoints(endpoints: dict[str, ModelEndpoint]) -> None:
    """Stop listening to every client of ``endpoints`` and close it; ``endpoints`` is left
    empty."""
    for endpoint in endpoints.values():
        endpoint.client.remove_listener(endpoint.listener)
        await close_client(endpoint.client)
    endpoints.clear()


async def close_client(client: ModelClient) -> None:
    """Close ``client``; a failure is logged, never raised (the watcher goes on)."""
    try:
        await client.close()
    except Exception:
        log.exception("error closing endpoint client")
