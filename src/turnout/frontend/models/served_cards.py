"""Which card each served model serves, the standby ones, and every transition between them.

A model's instances are grouped by card (``card_groups.CardGroup``); ``ServedCards`` holds
the served models and makes every change of their groups, each switch of card with no await
between its steps (a model is never half-built, never missing):

* an instance of the served card joins or leaves its routing (``add_entry``,
  ``remove_entry``); an instance of another card joins or starts a *standby group*, whose
  pipelines are built at once and left unregistered (``add_standby``);
* the model *switches* card when the served card's last instance leaves discovery
  (``remove_entry``), or, earlier, the moment its endpoint client sees it leave or be set
  aside (``on_instances_changed``): the standby group with the most instances (ties: the
  earliest seen) becomes the served one, its pre-built pipelines replacing the old ones in
  one step, logged once and counted in ``turnout_model_card_switches_total{model}``. The
  instance key and the card key of a leaving worker vanish together, but the client and the
  watcher learn it on separate watches; switching on the first of the two is what lets a
  rolling upgrade (start the new workers, stop the old ones one by one) refuse no new
  request. When no group remains, the model is unregistered, its clients closed, and a
  ``ModelUpdate.Removed`` sent for each request kind that no model serves any more;
* a card switched away from stays the model's *previous* card for the grace period
  (``card_grace_s``), pipelines and view kept even with no instance left: when one of its
  instances is routable again within it (set aside for a moment, or registered again after
  a lost lease), the model switches back, so a transient loss of the served card does not
  hand the model for good to another card, which may be a single odd worker. Past the grace
  period the switch is final.

A request is tokenized by the pipeline of the card served when it arrived and stays on that
card's instances to its end, retries and migrations included: after a switch, requests
already running on the old card finish on the old card's instances (or fail there).

An instance whose record names another request or event plane than this frontend's is
refused (``runtime.plane_refusals``): it is in no view, and one warning line says so, once
per instance. A worker on another plane set would otherwise take requests while its KV
events and load reports go where this frontend does not listen. ``held_back`` lists the
refused instances and the standby ones, with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Coroutine

from turnout.errors import ModelNotFound
from turnout.frontend.admission.limiter import Clock
from turnout.frontend.models.accepted_instances import AcceptedInstances, ModelClient
from turnout.frontend.models.card_groups import (
    Built,
    CardGroup,
    ModelEndpoint,
    ServedModel,
    choose_next,
    close_client,
    held_back_cards,
    routable,
)
from turnout.frontend.models.card_intake import WATCHER_LOGGER
from turnout.frontend.models.manager import ModelKind, ModelManager
from turnout.frontend.models.model_updates import ModelUpdate
from turnout.frontend.models.pairs import TYPE_KINDS, PipelineFactory
from turnout.protocols.frontend import HeldBackCard
from turnout.protocols.model import ModelDeploymentCard, ModelType
from turnout.runtime.plane_refusals import PlaneRefusals

__all__ = ["ServedCards"]

log = logging.getLogger(WATCHER_LOGGER)

#: Sends the updates of a change, in order, to whoever follows the served kinds.
SendUpdates = Callable[[list[ModelUpdate]], Coroutine[object, object, None]]


class ServedCards:
    """The served models of one frontend, by name, and the card groups of each.

    ``send_updates``: where the ``ModelUpdate`` values of a change go; ``model_changed``:
    called whenever a model may have appeared or changed card. ``grace_s``: how long a card
    switched away from may come back (0: never), timed on ``clock``.
    """

    def __init__(
        self,
        manager: ModelManager,
        factory: PipelineFactory,
        planes: PlaneRefusals,
        *,
        clock: Clock,
        grace_s: float,
        send_updates: SendUpdates,
        model_changed: Callable[[], None],
    ) -> None:
        self._manager = manager
        self._factory = factory
        # Instances on other planes than this frontend's: refused. Only ids of entries in
        # ``groups_by_key`` (forgotten when their last entry leaves).
        self._planes = planes
        self._clock = clock
        self._grace = grace_s
        self._send_all = send_updates
        self._notify_model_changed = model_changed
        #: Model name -> its groups of cards; key -> the group holding its entry.
        self.models: dict[str, ServedModel] = {}
        self.groups_by_key: dict[str, CardGroup] = {}
        self._seq = 0
        #: Set whenever what ``held_back`` returns may have changed; its reader clears it.
        self.held_back_changed = asyncio.Event()
        # Background work started where nothing can await: updates of switches made in a
        # client's listener, clients being closed.
        self._pending_sends: set[asyncio.Task[None]] = set()

    def held_back(self) -> list[HeldBackCard]:
        """Every instance with a card of a served model that gets no request, and why
        (``card_groups.held_back_cards``)."""
        return held_back_cards(self.models, self._planes)

    # -- entries --------------------------------------------------------------------------------

    def add_model(
        self,
        key: str,
        card: ModelDeploymentCard,
        view: AcceptedInstances,
        built: list[Built],
        endpoints: dict[str, ModelEndpoint],
    ) -> CardGroup:
        """Serve a model first seen with ``card`` (its pipelines ``built`` registered, its
        clients ``endpoints``), with the entry ``key``; returns its served group."""
        name = card.display_name
        group = self._new_group(card, view, built)
        model = self.models[name] = ServedModel(served=group, endpoints=endpoints)
        self.add_entry(model, group, key, card)
        self._manager.add_model_client(name, view)
        self._factory.serving(card, view)
        return group

    def add_standby(
        self,
        model: ServedModel,
        key: str,
        card: ModelDeploymentCard,
        view: AcceptedInstances,
        built: list[Built],
    ) -> None:
        """Start the standby group of ``card`` (a card the model has not seen), with the
        entry ``key``."""
        group = self._new_group(card, view, built)
        model.standby[group.checksum] = group
        self.add_entry(model, group, key, card)

    def _new_group(
        self, card: ModelDeploymentCard, view: AcceptedInstances, built: list[Built]
    ) -> CardGroup:
        self._seq += 1
        return CardGroup(card.display_name, card.checksum(), card, self._seq, view, built)

    def add_entry(
        self, model: ServedModel, group: CardGroup, key: str, card: ModelDeploymentCard
    ) -> None:
        group.entries[key] = card
        self.groups_by_key[key] = group
        if group is model.served:
            self._manager.save_model_entry(key, card)
        self._accept(model)

    def register(self, name: str, built: list[Built]) -> None:
        """Register every pipeline of ``built`` under ``name``, or none (no await: atomic)."""
        done: list[ModelKind] = []
        try:
            for kind, engine in built:
                self._manager.add_engine(kind, name, engine)
                done.append(kind)
        except BaseException:
            for kind in done:
                self._manager.remove_engine(kind, name)
            raise

    def _unregister(self, name: str, built: list[Built]) -> None:
        for kind, _ in built:
            with contextlib.suppress(ModelNotFound):
                self._manager.remove_engine(kind, name)

    def _accept(self, model: ServedModel) -> None:
        """Make every routing view list its own card's instances (those on this frontend's
        planes)."""
        self._apply_planes(model)
        model.served_live = routable(model.served)

    def _apply_planes(self, model: ServedModel) -> None:
        """Set each view of ``model`` to its card's instances less those refused for their
        planes (see the module docstring)."""
        for group in model.groups():
            ids = group.instance_ids()
            accepted = ids - self._refused_for_planes(group.view.client, ids)
            if accepted != group.view.accepted:
                group.view.accepted = accepted
        self.held_back_changed.set()

    def _refused_for_planes(self, client: ModelClient, ids: set[int]) -> set[int]:
        """Of ``ids``, those whose instance record names other planes than this frontend's
        (each logged once, as a warning, the first time)."""
        return {i for i in ids if self._planes.refuses(client.get_instance(i))}

    # -- switching cards ------------------------------------------------------------------------

    def _switch(self, model: ServedModel, new: CardGroup, why: str) -> list[ModelUpdate]:
        """Serve ``new`` instead of the served group, in one step (no await): no request
        finds the model half-built or missing. The old group stays standby, as the model's
        previous card for the grace period (a switch back ends it). Returns the updates to
        send."""
        m = self._manager
        old = model.served
        name = old.name
        self._unregister(name, old.built)
        self.register(name, new.built)
        for key in old.entries:
            m.remove_model_entry(key)
        for key, card in new.entries.items():
            m.save_model_entry(key, card)
        del model.standby[new.checksum]
        model.served = new
        model.standby[old.checksum] = old
        m.take_model_clients(name)
        m.add_model_client(name, new.view)
        self._factory.serving(new.card, new.view)
        switching_back = model.previous is new
        self._forget_previous(model)
        if not switching_back and self._grace > 0:
            model.previous = old
            model.previous_until = self._clock.now() + self._grace
            model.previous_timer = self._clock.call_later(
                self._grace, functools.partial(self._previous_expired, name)
            )
        elif not old.entries:
            del model.standby[old.checksum]
            self._drop_group(model, old)
        self._accept(model)
        if self._factory.metrics is not None:
            self._factory.metrics.card_switches.labels(name).inc()
        # The expected end of a rolling upgrade (the held-back line was the warning): info.
        log.info(
            "model switched card: model=%s checksum=%s -> %s (%d instances); %s",
            name,
            old.checksum,
            new.checksum,
            len(new.instance_ids()),
            why,
        )
        self._notify_model_changed()
        updates: list[ModelUpdate] = [ModelUpdate.Added(new.card.model_type)]
        for model_type, kind in TYPE_KINDS.items():
            if model_type in old.card.model_type and not m.list_models_of(kind):
                updates.append(ModelUpdate.Removed(model_type))
        return updates

    def switch_back(self, model: ServedModel) -> list[ModelUpdate]:
        """When the model's previous card has a routable instance again within its grace
        period, serve it again; returns the updates to send (none when nothing changed)."""
        previous = model.previous
        if previous is None or not routable(previous):
            return []
        if self._clock.now() >= model.previous_until:
            self._forget_previous(model)
            return []
        return self._switch(
            model, previous, "the previous card's instances are back within the grace period"
        )

    def _forget_previous(self, model: ServedModel) -> None:
        """End the grace period of the model's previous card: it stays as a standby card
        while it has entries, and goes with its pipelines otherwise."""
        previous, model.previous = model.previous, None
        if model.previous_timer is not None:
            model.previous_timer.cancel()
            model.previous_timer = None
        if previous is None or previous is model.served or previous.entries:
            return
        if model.standby.get(previous.checksum) is previous:
            del model.standby[previous.checksum]
        self._drop_group(model, previous)
        log.info(
            "previous card of model forgotten model=%s checksum=%s (its grace period is over)",
            previous.name,
            previous.checksum,
        )

    def _previous_expired(self, name: str) -> None:
        """The grace period's timer: forget the previous card once the clock says it is
        over (checked again later when the clock disagrees)."""
        model = self.models.get(name)
        if model is None or model.previous is None:
            return
        left = model.previous_until - self._clock.now()
        if left > 0:
            model.previous_timer = self._clock.call_later(
                left, functools.partial(self._previous_expired, name)
            )
            return
        model.previous_timer = None
        self._forget_previous(model)

    def on_instances_changed(self, name: str) -> None:
        """A client of ``name`` saw instances come, go, or be set aside.

        When an instance of the previous card is routable again within its grace period, the
        model switches back to it. When the last routable instance of the served card has
        just gone and a standby card has routable instances, it switches now, rather than
        answer 503 while other workers are up:

        * it left discovery: the card's DELETE follows on the model watch, but requests
          arriving meanwhile would find no instance to route to;
        * it is set aside (unreachable): typically a worker that stopped taking requests
          before this frontend's discovery saw it leave (stores that are polled).

        Runs inside the client's update (synchronously), so the next request finds the new
        card registered."""
        model = self.models.get(name)
        if model is None:
            return
        self._apply_planes(model)
        updates = self.switch_back(model)
        if not updates:
            updates = self._switch_if_served_gone(model)
        if updates:
            self._background(self._send_all(updates))

    def _switch_if_served_gone(self, model: ServedModel) -> list[ModelUpdate]:
        served = model.served
        live = routable(served)
        was_live, model.served_live = model.served_live, live
        if live or not was_live or not model.standby:
            return []
        new = choose_next(model, live_only=True)
        if new is None:
            return []
        announced = served.instance_ids() & served.view.announced_ids()
        why = (
            "no instance of the served card is reachable"
            if announced
            else "the last instance of the served card left"
        )
        return self._switch(model, new, why)

    def _drop_group(self, model: ServedModel, group: CardGroup) -> None:
        """``group`` is gone from the model: release what the factory holds for its card,
        and close its endpoint's client unless another group of the model uses it (in the
        background: closing awaits its watch task)."""
        self.release_card(group.card, group.view)
        path = group.card.endpoint.path()
        if any(g.card.endpoint.path() == path for g in model.groups() if g is not group):
            return
        endpoint = model.endpoints.pop(path, None)
        if endpoint is not None:
            endpoint.client.remove_listener(endpoint.listener)
            self._background(close_client(endpoint.client))

    async def drop_endpoint_if_unused(self, model: ServedModel, path: str) -> None:
        """A build on an endpoint new to the model failed: close that endpoint's client."""
        if any(g.card.endpoint.path() == path for g in model.groups()):
            return
        endpoint = model.endpoints.pop(path, None)
        if endpoint is not None:
            endpoint.client.remove_listener(endpoint.listener)
            await close_client(endpoint.client)

    def release_card(self, card: ModelDeploymentCard, view: AcceptedInstances) -> None:
        self._background(self._factory.release(card, view))

    def _background(self, work: Coroutine[object, object, None]) -> None:
        """Run ``work`` beside the event it came from (closing is awaited at ``stop``); its
        failure is logged, never lost with the task."""
        task = asyncio.get_running_loop().create_task(work)
        self._pending_sends.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[None]) -> None:
        self._pending_sends.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("model watcher: background work failed: %r", exc, exc_info=exc)

    # -- leaving ------------------------------------------------------------------------------

    async def remove_entry(self, key: str) -> bool:
        """The entry ``key`` left discovery (its worker left, or its lease expired); False
        when no group holds it.

        An entry of a standby group leaves it (the group goes with its last entry, unless
        it is the model's previous card). When the served card's last entry leaves, the
        model switches to the standby group chosen by ``choose_next``, or goes when there is
        none."""
        group = self.groups_by_key.pop(key, None)
        if group is None:
            return False
        name = group.name
        model = self.models[name]
        card = group.entries.pop(key)
        if card.instance_id not in group.instance_ids():
            self._planes.forget(card.instance_id)
        if group is not model.served:
            if not group.entries and group is not model.previous:
                del model.standby[group.checksum]
                self._drop_group(model, group)
                log.info("standby card of model left model=%s checksum=%s", name, group.checksum)
            self._accept(model)
            return True
        self._manager.remove_model_entry(key)
        if group.entries:
            self._accept(model)
            log.debug("instance of model left, others remain model=%s key=%s", name, key)
            return True
        new = choose_next(model, live_only=False)
        if new is not None:
            await self._send_all(
                self._switch(model, new, "the last instance of the served card left")
            )
            return True
        await self._remove_model(model)
        return True

    async def _remove_model(self, model: ServedModel) -> None:
        """The last instance left: unregister every kind, then report each kind that no
        model serves any more (a kind another model still serves stays enabled)."""
        name = model.served.name
        del self.models[name]
        self.held_back_changed.set()
        if model.previous_timer is not None:
            model.previous_timer.cancel()
        m = self._manager
        emptied: list[ModelType] = []
        for model_type, kind in TYPE_KINDS.items():
            try:
                m.remove_engine(kind, name)
            except ModelNotFound:
                continue  # the model did not serve this kind
            if not m.list_models_of(kind):
                emptied.append(model_type)
        m.take_model_clients(name)
        for endpoint in model.endpoints.values():
            endpoint.client.remove_listener(endpoint.listener)
            await close_client(endpoint.client)
        for group in model.groups():
            try:
                await self._factory.release(group.card, group.view)
            except Exception as exc:  # the model is gone all the same: say so, go on
                log.error(
                    "model %s: releasing the routing state of card %s failed: %r",
                    name, group.card.checksum(), exc, exc_info=exc,
                )  # fmt: skip
        log.info("removed model model=%s", name)
        await self._send_all([ModelUpdate.Removed(model_type) for model_type in emptied])
        if not emptied:
            log.debug("no model update to send for model=%s", name)

    # -- shutdown -------------------------------------------------------------------------------

    def detach(self) -> list[ModelEndpoint]:
        """Stop every grace-period timer and every listener on the models' clients (at
        shutdown); returns the endpoints, whose clients the caller closes."""
        endpoints = [e for m in self.models.values() for e in m.endpoints.values()]
        for model in self.models.values():
            if model.previous_timer is not None:
                model.previous_timer.cancel()
        for endpoint in endpoints:
            endpoint.client.remove_listener(endpoint.listener)
        return endpoints

    async def finish_background(self) -> None:
        """Let the clients being closed and the updates being sent after a switch finish (an
        update into a full, unread queue would wait forever: those are cancelled after a
        second)."""
        pending = list(self._pending_sends)
        if pending:
            _, late = await asyncio.wait(pending, timeout=1.0)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
