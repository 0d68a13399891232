"""Turn model-card events from the discovery store into served models.

Workers publish one ``ModelDeploymentCard`` per instance under their lease::

    v1/mdc/{namespace}/{component}/{endpoint}/{instance_id:x}[/{lora}]  -> card (JSON)

The ``ModelWatcher`` follows that prefix and keeps the ``ModelManager`` in step with it:

* PUT of a card for a model nobody serves yet: build its pipelines (through the
  ``PipelineFactory``, chosen by the card's ``ModelInput`` x ``ModelType``), register them,
  remember the entry, send ``ModelUpdate.Added``.
* PUT for a model already served, with the served card (same ``checksum()``): another
  instance joined; remember the entry, send ``Added``. Nothing is rebuilt: the card's
  routing view already sees the new instance.
* PUT for a model already served, with another card: the instance would be served with the
  wrong tokenizer, template or limits, so it gets none of the served card's requests. Its
  entry joins a *standby group* (one per checksum); the first instance of a new card builds
  that group's pipelines at once, unregistered (logged once, as a warning: a rolling upgrade
  looks like this). A card whose pipelines cannot be built is refused.
* DELETE (the worker left, or its lease expired): forget the entry; the model may switch to
  a standby card, or go.

The modules it is made of:

* ``card_intake``: reading a card record, and logging each refusal once;
* ``model_lanes``: one model's events are handled one at a time, in store order; different
  models' concurrently (at most ``max_concurrent_models`` at once), so that a model whose
  build waits on a slow artifact fetch never holds up the others;
* ``card_groups`` and ``served_cards``: the served models, their cards' groups of
  instances, the switches between cards (and the grace period of the card switched away
  from), the instances refused for their planes;
* ``prefill_watch``: cards of prefill instances (``ModelType.Prefill``, disaggregated
  serving) are not models: they activate the model's prefill router with its first prefill
  instance and deactivate it with the last.

An instance announced in discovery whose card was refused (artifacts that could not be
fetched, invalid card) is in no routing view.

A bad event (invalid card, unsupported pair, failing factory) is logged and skipped; the
watcher never stops for one. Nothing in a card is trusted: whoever can write the store can
write one. A card whose numbers are out of range (a context of 2^62 tokens, a KV block of 0
tokens, a tokenizer announced at 20 GB: ``protocols.card_bounds``, with this frontend's
``--max-artifact-bytes``) or whose chat template spins on a probe conversation is refused
before anything is built from it, with one error line naming the model, the instance and
the field (once per model and reason), and no traceback. A key that held a served card and
now holds a refused one leaves its model first.

Building a Tokens model fetches the artifacts its card names (the tokenizer) by content from
the model's instances (``frontend.models.artifacts``, called by the factory). When no
instance delivers them (worker gone, checksum mismatch, deadline passed), the build fails
like any other: nothing of the model is registered, the instance is left out, the reason is
logged once (as an error, without a traceback), and the next instance's card builds the model
afresh.

This is a re-design of Dynamo's ``discovery/watcher.rs`` for asyncio.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from typing import TYPE_CHECKING

from turnout.frontend.admission.limiter import Clock, LoopClock
from turnout.frontend.models.accepted_instances import AcceptedInstances
from turnout.frontend.models.card_groups import (
    Built,
    ModelEndpoint,
    ServedModel,
    close_client,
    close_endpoints,
)
from turnout.frontend.models.card_intake import RefusalLog, decode_card
from turnout.frontend.models.manager import ModelKind, ModelManager
from turnout.frontend.models.model_lanes import ModelLanes
from turnout.frontend.models.model_updates import ModelUpdate
from turnout.frontend.models.pairs import (
    InvalidCard,
    PipelineFactory,
    UnsupportedModel,
    pipelines_for,
)
from turnout.frontend.models.prefill_watch import PrefillWatch, is_prefill_card
from turnout.frontend.models.served_cards import ServedCards
from turnout.llm.artifacts import ArtifactError
from turnout.protocols.card_bounds import CardBounds, card_problem
from turnout.protocols.frontend import HeldBackCard, is_global_namespace
from turnout.protocols.model import MDC_ROOT, ModelDeploymentCard
from turnout.runtime.discovery.base import WatchEvent, WatchEventKind
from turnout.runtime.plane_refusals import PlaneRefusals

if TYPE_CHECKING:
    from turnout.router.lora import LoraRegistry
    from turnout.runtime.component import DistributedRuntime

__all__ = ["ModelWatcher"]

# The name every module of the watcher logs under (``card_intake.WATCHER_LOGGER``).
log = logging.getLogger(__name__)

#: The prefix the watcher follows (with the trailing slash, so ``v1/mdcx`` is not matched).
MDC_PREFIX = f"{MDC_ROOT}/"
#: Backoff between attempts to re-open a failed model watch.
WATCH_RETRY_MIN_SECONDS = 0.5
WATCH_RETRY_MAX_SECONDS = 10.0
#: How long a card switched away from may come back and be served again (``served_cards``).
#: Shorter than the endpoint client's first set-aside
#: (``runtime.endpoint_client.DOWN_RETRY_SECONDS``): an instance that merely ends its
#: set-aside, unproven, does not take the model back; one announced again, or whose
#: connection answers again, does.
CARD_GRACE_SECONDS = 3.0
#: Models whose events are handled at once (each may be waiting on an artifact fetch).
MAX_CONCURRENT_MODELS = 8
#: Events read from the store and not yet handled; past it the watch waits (a model whose
#: build is stalled cannot make the watcher hold an unbounded backlog).
MAX_QUEUED_EVENTS = 4096


class _Outcome(enum.Enum):
    """What became of a PUT; the watcher's only state transition per key."""

    ADDED = "added"  # a new model was built and registered
    JOINED = "joined"  # another instance of the served card of a model
    STANDBY = "standby"  # an instance of another card of a served model, held back
    REJECTED = "rejected"  # logged and skipped


class ModelWatcher:
    """Follows ``v1/mdc/`` in the runtime's store and keeps a ``ModelManager`` up to date.

    ``namespace``: serve only that namespace's models, unless it is global (see
    ``is_global_namespace``). ``updates``: where ``ModelUpdate`` values are put (awaiting
    space if the queue is bounded, so a slow reader slows the watcher instead of losing
    updates). ``card_grace_s``: how long a card switched away from may come back and be
    served again (0: never); ``clock``: where that grace period is measured and timed (the
    event loop's by default).
    ``max_concurrent_models``: how many models' events are handled at once.
    """

    def __init__(
        self,
        runtime: DistributedRuntime,
        manager: ModelManager,
        pipeline_factory: PipelineFactory,
        *,
        namespace: str | None = None,
        updates: asyncio.Queue[ModelUpdate] | None = None,
        lora: LoraRegistry | None = None,
        card_grace_s: float = CARD_GRACE_SECONDS,
        clock: Clock | None = None,
        max_concurrent_models: int = MAX_CONCURRENT_MODELS,
    ) -> None:
        if not card_grace_s >= 0:
            raise ValueError(f"card_grace_s must be >= 0, got {card_grace_s}")
        if max_concurrent_models < 1:
            raise ValueError(f"max_concurrent_models must be >= 1, got {max_concurrent_models}")
        self._runtime = runtime
        # ``--enable-lora``: adapter cards feed this registry instead of becoming models.
        self._lora = lora
        self._manager = manager
        self._factory = pipeline_factory
        self._namespace = namespace
        self._global = is_global_namespace(namespace)
        self._updates = updates
        # Set, then replaced, whenever a chat-capable model may have appeared: every task
        # waiting on the old event wakes together (a broadcast, not a hand-off to one).
        self._model_changed = asyncio.Event()
        # Keys whose PUT was refused: their DELETE is expected and logged at debug only.
        self._rejected_keys: set[str] = set()
        self._refusals = RefusalLog()
        # What a card may announce; artifacts as large as the factory's fetcher takes.
        self._bounds = CardBounds(max_artifact_bytes=pipeline_factory.max_artifact_bytes)
        self._cards = ServedCards(
            manager,
            pipeline_factory,
            PlaneRefusals(runtime.request_plane, runtime.event_plane.kind, "frontend"),
            clock=clock or LoopClock(),
            grace_s=card_grace_s,
            send_updates=self._send_all,
            model_changed=self._notify_model_changed,
        )
        # Model name -> the model served under it (``ServedCards.models``, the same dict).
        self._models = self._cards.models
        self._lanes = ModelLanes(
            self.handle_event,
            max_concurrent=max_concurrent_models,
            max_queued=MAX_QUEUED_EVENTS,
        )
        # Prefill instances' cards activate their model's prefill router (disaggregated
        # serving), with a factory that builds prefill pools.
        slots = pipeline_factory.prefill_slots
        self.prefill: PrefillWatch | None = None
        if slots is not None:
            self.prefill = PrefillWatch(
                runtime, slots, pipeline_factory.build_prefill_pool, AcceptedInstances
            )

    @property
    def manager(self) -> ModelManager:
        return self._manager

    @property
    def held_back_changed(self) -> asyncio.Event:
        """Set whenever what ``held_back`` returns may have changed; its reader clears it."""
        return self._cards.held_back_changed

    def held_back(self) -> list[HeldBackCard]:
        """Every instance with a card of a served model that gets no request, and why:
        refused for its planes, or standby (its card differs from the served one). Sorted by
        model, then instance id."""
        return self._cards.held_back()

    async def wait_for_chat_model(self) -> str:
        """The name of a served chat model (first by name), waiting until there is one."""
        while True:
            names = self._manager.list_models_of(ModelKind.CHAT)
            if names:
                return names[0]
            await self._model_changed.wait()

    async def settled(self) -> None:
        """Return once every event read from the store so far has been handled."""
        await self._lanes.settled()

    def _notify_model_changed(self) -> None:
        self._model_changed.set()
        self._model_changed = asyncio.Event()

    async def watch(self) -> None:
        """Handle model-card events until the store is closed or this task is cancelled.

        A watch that fails (the store is unreachable) is opened again with backoff, resuming
        after the last revision it delivered, so nothing is missed and the models served
        meanwhile stay served: replaying a change already applied is harmless (a PUT of a
        known card is a no-op, a DELETE of an unknown key too), and a store that compacted
        past that revision re-lists and reports what vanished as DELETEs. Events still being
        handled when it ends are cancelled (a build in progress rolls back).
        """
        try:
            await self._watch()
        finally:
            await self._lanes.cancel()

    async def _watch(self) -> None:
        revision: int | None = None
        delay = WATCH_RETRY_MIN_SECONDS
        while True:
            events = self._runtime.store.watch_prefix(MDC_PREFIX, start_revision=revision)
            try:
                async for event in events:
                    revision = max(revision or 0, event.kv.revision)
                    delay = WATCH_RETRY_MIN_SECONDS
                    await self._lanes.dispatch(event)
                return  # the store was closed
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "model watch failed (%s: %s); serving what is known, retrying in %.1fs",
                    type(exc).__name__,
                    exc,
                    delay,
                )
            finally:
                await events.aclose()  # stop the store's watch now
            await asyncio.sleep(delay)
            delay = min(2 * delay, WATCH_RETRY_MAX_SECONDS)

    async def close(self) -> None:
        """Close every endpoint client the watcher opened (at frontend shutdown)."""
        endpoints = self._cards.detach()
        if self.prefill is not None:
            await self.prefill.close()
        await self._manager.close()
        for endpoint in endpoints:  # those of standby views (closing twice is harmless)
            await close_client(endpoint.client)
        await self._cards.finish_background()

    async def handle_event(self, event: WatchEvent) -> None:
        """Apply one store event; errors are logged, never raised (cancellation excepted)."""
        key = event.kv.key
        try:
            if event.kind is WatchEventKind.PUT:
                outcome = await self._handle_put(key, event.kv.value)
                if outcome is _Outcome.REJECTED:
                    self._rejected_keys.add(key)
                else:
                    self._rejected_keys.discard(key)
            else:
                await self._handle_delete(key)
        except Exception:
            log.exception("error handling model event kind=%s key=%s", event.kind.value, key)

    # -- PUT ------------------------------------------------------------------------------------

    async def _handle_put(self, key: str, value: bytes) -> _Outcome:
        card = decode_card(key, value)
        if card is None:
            return _Outcome.REJECTED

        namespace = card.endpoint.namespace
        if not self._global and namespace != self._namespace:
            log.debug(
                "skipping model from another namespace model=%s namespace=%s target=%s",
                card.display_name,
                namespace,
                self._namespace,
            )
            return _Outcome.REJECTED
        problem = card_problem(card, self._bounds)
        if problem is not None:
            await self._drop_replaced(key)
            return self._refuse(key, card, InvalidCard(problem.field, problem.reason))
        if self._lora is not None and self._lora.on_card(key, card):
            return _Outcome.JOINED  # a loaded adapter: served on its base model's pipelines
        if is_prefill_card(card) and self.prefill is not None:
            accepted = await self.prefill.on_put(key, card)
            return _Outcome.JOINED if accepted else _Outcome.REJECTED

        name = card.display_name
        old = self._cards.groups_by_key.get(key)
        if old is not None and (old.name != name or old.checksum != card.checksum()):
            # The key now holds another card: its old entry leaves first.
            await self._handle_delete(key)
        model = self._models.get(name)
        if model is not None:
            return await self._join(model, key, card)

        endpoints: dict[str, ModelEndpoint] = {}
        try:
            view = await self._view(name, endpoints, card)
            try:
                built = await self._build(card, view)
            except BaseException:
                await close_endpoints(endpoints)
                raise
            self._cards.register(name, built)
        except Exception as err:
            if isinstance(err, InvalidCard):
                return self._refuse(key, card, err)
            if isinstance(err, UnsupportedModel) and not self._refusals.first_sight(name, err):
                log.debug("unsupported model card again model=%s key=%s", name, key)
                return _Outcome.REJECTED
            log.error(
                "error adding model %s from namespace %s: %s",
                name,
                namespace,
                err,
                # Expected, operational failures carry their whole story in the message.
                exc_info=not isinstance(err, (UnsupportedModel, ArtifactError)),
            )
            return _Outcome.REJECTED
        group = self._cards.add_model(key, card, view, built, endpoints)
        log.info(
            "added model model=%s namespace=%s type=%s input=%s instance=%x checksum=%s",
            name,
            namespace,
            card.model_type.names(),
            card.model_input.value,
            card.instance_id,
            group.checksum,
        )
        await self._send(ModelUpdate.Added(card.model_type))
        self._notify_model_changed()
        return _Outcome.ADDED

    async def _join(self, model: ServedModel, key: str, card: ModelDeploymentCard) -> _Outcome:
        """Another instance (or LoRA entry) of a served model: an instance of the served card
        joins its routing; one of another card joins (or starts) a standby group."""
        name = card.display_name
        checksum = card.checksum()
        served = model.served
        if checksum == served.checksum:
            self._cards.add_entry(model, served, key, card)
            log.debug(
                "new instance of existing model model=%s namespace=%s instance=%x",
                name,
                card.endpoint.namespace,
                card.instance_id,
            )
            await self._send(ModelUpdate.Added(card.model_type))
            self._notify_model_changed()
            return _Outcome.JOINED

        group = model.standby.get(checksum)
        if group is not None:
            self._cards.add_entry(model, group, key, card)
            log.debug(
                "new instance of a standby card model=%s instance=%x checksum=%s",
                name,
                card.instance_id,
                checksum,
            )
            back = self._cards.switch_back(model)
            if back:
                await self._send_all(back)
            return _Outcome.STANDBY

        # A card never seen for this model: build its pipelines now (nothing is registered),
        # so that the switch, when it comes, is instant and cannot fail half-way.
        fresh = card.endpoint.path() not in model.endpoints
        try:
            view = await self._view(name, model.endpoints, card)
            try:
                built = await self._build(card, view)
            except BaseException:
                if fresh:
                    await self._cards.drop_endpoint_if_unused(model, card.endpoint.path())
                raise
        except Exception as err:
            if isinstance(err, InvalidCard):
                return self._refuse(key, card, err)
            if isinstance(err, UnsupportedModel) and not self._refusals.first_sight(name, err):
                log.debug("unsupported model card again model=%s key=%s", name, key)
                return _Outcome.REJECTED
            log.error(
                "model card mismatch, instance not added: model=%s key=%s checksum=%s differs "
                "from instance=%x checksum=%s, and its pipelines could not be built: %s",
                name,
                key,
                checksum,
                served.card.instance_id,
                served.checksum,
                err,
                exc_info=not isinstance(err, (UnsupportedModel, ArtifactError)),
            )
            return _Outcome.REJECTED
        if self._models.get(name) is not model:
            # The model was removed while we built (a key moved to it from another model
            # left it empty): what was built goes.
            self._cards.release_card(card, view)
            return _Outcome.REJECTED
        self._cards.add_standby(model, key, card, view, built)
        log.warning(
            "model card differs from the served one, instance held back: model=%s key=%s "
            "checksum=%s differs from instance=%x checksum=%s; it gets no request until the "
            "served card's instances are gone (a rolling upgrade?)",
            name,
            key,
            checksum,
            served.card.instance_id,
            served.checksum,
        )
        return _Outcome.STANDBY

    async def _drop_replaced(self, key: str) -> None:
        """``key`` now holds a refused card: what its previous card was (a served entry, a
        LoRA adapter, a prefill instance) leaves, as on a DELETE."""
        if self._lora is not None and self._lora.on_delete(key):
            return
        if self.prefill is not None and await self.prefill.on_delete(key):
            return
        if key in self._cards.groups_by_key:
            await self._handle_delete(key)

    async def _view(
        self, name: str, endpoints: dict[str, ModelEndpoint], card: ModelDeploymentCard
    ) -> AcceptedInstances:
        """A new routing view for ``card``, over the model's client of the card's endpoint
        (opened, and watched for instances leaving, when the model has none there yet: see
        ``ServedCards.on_instances_changed``)."""
        path = card.endpoint.path()
        endpoint = endpoints.get(path)
        if endpoint is None:
            client = await self._runtime.endpoint(card.endpoint).client()
            listener = functools.partial(self._cards.on_instances_changed, name)
            client.add_listener(listener)
            endpoint = endpoints[path] = ModelEndpoint(client, listener)
        return AcceptedInstances(endpoint.client)

    async def _build(self, card: ModelDeploymentCard, view: AcceptedInstances) -> list[Built]:
        """Build every pipeline ``card`` asks for, routed through ``view``; registers nothing.

        The (input, type) table is ``PAIRS`` (Dynamo's ``handle_put`` serves one pair per
        card; here a card with several types is served on each, when every one pairs with
        its input). A card with any other pair is refused, naming ``SUPPORTED_PAIRS``.
        """
        built: list[Built] = []
        try:
            for build, kind in pipelines_for(card):
                built.append((kind, await build(self._factory, card, view)))
        except BaseException:
            self._cards.release_card(card, view)  # what the factory holds goes with the pipelines
            raise
        return built

    def _refuse(self, key: str, card: ModelDeploymentCard, err: InvalidCard) -> _Outcome:
        """Refuse ``card`` (logged once per model and reason: ``RefusalLog``)."""
        self._refusals.refuse(key, card, err)
        return _Outcome.REJECTED

    # -- DELETE ---------------------------------------------------------------------------------

    async def _handle_delete(self, key: str) -> None:
        if self._lora is not None and self._lora.on_delete(key):
            return  # an adapter was unloaded
        if self.prefill is not None and await self.prefill.on_delete(key):
            return  # a prefill instance left
        was_rejected = key in self._rejected_keys
        self._rejected_keys.discard(key)
        if await self._cards.remove_entry(key):
            return
        # A DELETE of a key this frontend never held is harmless (the store may report keys
        # gone that it never announced, e.g. on a re-list after a restore): nothing to do.
        what = "refused model entry" if was_rejected else "model entry not held"
        log.debug("%s deleted key=%s", what, key)

    async def _send_all(self, updates: list[ModelUpdate]) -> None:
        for update in updates:
            await self._send(update)

    async def _send(self, update: ModelUpdate) -> None:
        if self._updates is not None:
            await self._updates.put(update)
