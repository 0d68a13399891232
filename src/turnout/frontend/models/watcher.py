"""Turn model-card events from the discovery store into served models.

Workers publish one ``ModelDeploymentCard`` per instance under their lease::

    v1/mdc/{namespace}/{component}/{endpoint}/{instance_id:x}[/{lora}]  -> card (JSON)

The ``ModelWatcher`` follows that prefix and keeps the ``ModelManager`` in step with it:

* PUT of a card for a model nobody serves yet: build its pipelines (through the
  ``PipelineFactory``, chosen by the card's ``ModelInput`` x ``ModelType``), register them,
  remember the entry, send ``ModelUpdate.Added``.
* PUT for a model already served, with the served card (same ``checksum()``): another
  instance joined; remember the entry, send ``Added``. Nothing is rebuilt: the model's
  endpoint client already sees the new instance.
* PUT for a model already served, with another card: the instance would be served with the
  wrong tokenizer, template or limits, so it gets none of the served card's requests. Its
  entry joins a *standby group* (one per checksum); the first instance of a new card builds
  that group's pipelines at once, unregistered (logged once, as a warning: a rolling upgrade
  looks like this). A card whose pipelines cannot be built is refused, as before.
* DELETE (the worker left, or its lease expired): forget the entry. When it was the last
  entry of the served card and standby groups remain, the model *switches* card: the
  standby group with the most instances (ties: the earliest seen) becomes the served one,
  its pre-built pipelines replacing the old ones in one step, with no await in between (a
  model is never half-built, never missing), logged once and counted in
  ``turnout_model_card_switches_total{model}``. When no group remains, unregister the model,
  close its clients, and send ``ModelUpdate.Removed`` for each request kind that no model
  serves any more.

The switch also happens the moment the client sees the served card's last instance leave
discovery (``_on_instances_changed``), when a standby card has a live instance: the instance
key and the card key of a leaving worker vanish together, but the endpoint client and this
watcher learn it on separate watches; in between, a request would find no instance of the
served card to route to. Switching on the first of the two closes that gap, which is what
lets a rolling upgrade (start the new workers, stop the old ones one by one) fail no request.

The pipelines route through the model's endpoint client seen as ``AcceptedInstances``: only
instances of the served card are candidates. An instance announced in discovery whose card
was refused (artifacts that could not be fetched, invalid card) or is on standby gets no
request of this model.

Cards of prefill instances (``ModelType.Prefill``, disaggregated serving) are not models:
they go to ``frontend.prefill_watch``, which activates the model's prefill router with its
first prefill instance and deactivates it with the last.

Events are handled one at a time, in store order. A bad event (invalid card, unsupported
pair, failing factory) is logged and skipped; the watcher never stops for one.

Nothing in a card is trusted: whoever can write the store can write one. A card whose
numbers are out of range (a context of 2^62 tokens, a KV block of 0 tokens, a tokenizer
announced at 20 GB: ``protocols.card_bounds``, with this frontend's ``--max-artifact-bytes``)
or whose chat template spins on a probe conversation is refused before anything is built from
it, with one error line naming the model, the instance and the field (once per model and
reason: the next instances of the same card are refused at debug level), and no traceback.
A key that held a served card and now holds a refused one leaves its model first.

Building a Tokens model fetches the artifacts its card names (the tokenizer) by content from
the model's instances (``frontend.artifacts``, called by the factory). When no instance
delivers them (worker gone, checksum mismatch, deadline passed), the build fails like any
other: nothing of the model is registered, the instance is left out, the reason is logged once
(as an error, without a traceback), and the next instance's card builds the model afresh.

This is a re-design of Dynamo's ``discovery/watcher.rs`` for asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, cast

import msgspec

from turnout.errors import ModelNotFound
from turnout.frontend.models.accepted_instances import AcceptedInstances
from turnout.frontend.models.manager import ModelKind, ModelManager
from turnout.frontend.models.pairs import (
    SUPPORTED_PAIRS,
    TYPE_KINDS,
    InvalidCard,
    PipelineFactory,
    UnsupportedModel,
    pipelines_for,
)
from turnout.frontend.models.prefill_watch import PrefillWatch, is_prefill_card
from turnout.llm.artifacts import ArtifactError
from turnout.protocols.card_bounds import DEFAULT_MAX_ARTIFACT_BYTES, CardBounds, card_problem
from turnout.protocols.model import (
    MDC_ROOT,
    ModelDeploymentCard,
    ModelType,
)
from turnout.runtime.discovery.base import WatchEvent, WatchEventKind

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from turnout.router.lora import LoraRegistry
    from turnout.runtime.component import DistributedRuntime, EndpointClient

    _Builder = Callable[[ModelDeploymentCard, EndpointClient], Awaitable[object]]

__all__ = [
    "GLOBAL_NAMESPACES",
    "SUPPORTED_PAIRS",
    "AcceptedInstances",
    "ModelAdded",
    "ModelRemoved",
    "ModelUpdate",
    "ModelWatcher",
    "PipelineFactory",
    "is_global_namespace",
]

log = logging.getLogger(__name__)

#: The prefix the watcher follows (with the trailing slash, so ``v1/mdcx`` is not matched).
MDC_PREFIX = f"{MDC_ROOT}/"
#: Backoff between attempts to re-open a failed model watch.
WATCH_RETRY_MIN_SECONDS = 0.5
WATCH_RETRY_MAX_SECONDS = 10.0

#: Namespaces whose frontend serves the models of every namespace: the empty one (no
#: namespace given) and ``"global"``. Any other name serves only its own namespace.
GLOBAL_NAMESPACES = frozenset({"", "global"})


def is_global_namespace(namespace: str | None) -> bool:
    """True when a frontend in ``namespace`` sees every namespace's models (see above)."""
    return namespace is None or namespace in GLOBAL_NAMESPACES


# -- updates ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelUpdate:
    """A change in which kinds of request are served, for the HTTP service to follow.

    Either ``ModelUpdate.Added(model_type)`` (an instance of a model with these types was
    registered; ``model_type`` may hold several flags, as the card does) or
    ``ModelUpdate.Removed(model_type)`` (no model serves this single type any more).
    """

    model_type: ModelType

    Added: ClassVar[type[ModelAdded]]
    Removed: ClassVar[type[ModelRemoved]]


@dataclass(frozen=True, slots=True)
class ModelAdded(ModelUpdate):
    pass


@dataclass(frozen=True, slots=True)
class ModelRemoved(ModelUpdate):
    pass


ModelUpdate.Added = ModelAdded
ModelUpdate.Removed = ModelRemoved


class _Outcome(enum.Enum):
    """What became of a PUT; the watcher's only state transition per key."""

    ADDED = "added"  # a new model was built and registered
    JOINED = "joined"  # another instance of the served card of a model
    STANDBY = "standby"  # an instance of another card of a served model, held back
    REJECTED = "rejected"  # logged and skipped


#: One built pipeline: the kind of request it serves, the engine itself.
_Built = tuple[ModelKind, object]


@dataclass(slots=True, eq=False)
class _Group:
    """The entries of one model that publish the same card (same checksum), and the pipelines
    built from that card, registered or not.

    A model has one served group (its pipelines registered, its instances the only ones routed
    to) and any number of standby groups (pipelines built, not registered, no request routed to
    them): the new workers of a rolling upgrade, until the served card's last instance leaves.
    """

    name: str
    checksum: str
    #: The first card seen of the group: the one its pipelines were built from.
    card: ModelDeploymentCard
    #: Order of first sight among the model's groups (ties in the choice of a new card).
    seq: int
    #: The routing view its pipelines use (shared with other groups on the same endpoint).
    view: AcceptedInstances
    built: list[_Built]
    #: Discovery key -> card of every entry (instance, or LoRA entry) with this card.
    entries: dict[str, ModelDeploymentCard] = field(default_factory=dict)

    def instance_ids(self) -> set[int]:
        return {card.instance_id for card in self.entries.values()}


@dataclass(slots=True, eq=False)
class _Model:
    """A served model: its served group and its standby groups (by checksum)."""

    served: _Group
    standby: dict[str, _Group] = field(default_factory=dict)
    #: Instances of the served group that could be routed to at the last look (announced,
    #: not set aside): when the last of them goes while a standby group has routable
    #: instances, the model switches at once.
    served_live: set[int] = field(default_factory=set)

    def groups(self) -> list[_Group]:
        return [self.served, *self.standby.values()]


# -- the watcher --------------------------------------------------------------------------------


#: Distinct refusal messages (unsupported pairs, invalid cards) remembered so each is logged
#: once (bounded: past it, forgotten and logged again).
_MAX_LOGGED_REFUSALS = 1024


class ModelWatcher:
    """Follows ``v1/mdc/`` in the runtime's store and keeps a ``ModelManager`` up to date.

    ``namespace``: serve only that namespace's models, unless it is global (see
    ``is_global_namespace``). ``updates``: where ``ModelUpdate`` values are put (awaiting
    space if the queue is bounded, as the seed's channel does).
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
    ) -> None:
        self._runtime = runtime
        # ``--enable-lora``: adapter cards feed this registry instead of becoming models.
        self._lora = lora
        self._manager = manager
        self._factory = pipeline_factory
        self._namespace = namespace
        self._global = is_global_namespace(namespace)
        self._updates = updates
        # Set, then replaced, whenever a chat-capable model may have appeared: every task
        # waiting on the old event wakes (Tokio's Notify::notify_waiters).
        self._model_changed = asyncio.Event()
        # Keys whose PUT was refused: their DELETE is expected and logged at debug only.
        self._rejected_keys: set[str] = set()
        # (model, message) of refused cards already logged (see ``_first_sight``).
        self._refusals_logged: set[tuple[str, str]] = set()
        # What a card may announce; artifacts as large as the factory's fetcher takes.
        self._bounds = CardBounds(
            max_artifact_bytes=getattr(
                pipeline_factory, "max_artifact_bytes", DEFAULT_MAX_ARTIFACT_BYTES
            )
        )
        # Model name -> its groups of cards; key -> the group holding its entry.
        self._models: dict[str, _Model] = {}
        self._groups_by_key: dict[str, _Group] = {}
        self._seq = 0
        # Updates of switches made outside the event handler (see ``_on_instances_changed``).
        self._pending_sends: set[asyncio.Task[None]] = set()
        # Prefill instances' cards activate their model's prefill router (disaggregated
        # serving), with a factory that builds prefill pools.
        slots = getattr(pipeline_factory, "prefill_slots", None)
        build = getattr(pipeline_factory, "build_prefill_pool", None)
        self.prefill: PrefillWatch | None = None
        if slots is not None and build is not None:
            self.prefill = PrefillWatch(runtime, slots, build, AcceptedInstances)

    @property
    def manager(self) -> ModelManager:
        return self._manager

    async def wait_for_chat_model(self) -> str:
        """The name of a served chat model (first by name), waiting until there is one."""
        while True:
            names = self._manager.list_chat_models()
            if names:
                return names[0]
            await self._model_changed.wait()

    def _notify_model_changed(self) -> None:
        self._model_changed.set()
        self._model_changed = asyncio.Event()

    async def watch(self) -> None:
        """Handle model-card events until the store is closed or this task is cancelled.

        A watch that fails (the store is unreachable) is opened again with backoff, resuming
        after the last revision it delivered, so nothing is missed and the models served
        meanwhile stay served: replaying a change already applied is harmless (a PUT of a
        known card is a no-op, a DELETE of an unknown key too), and a store that compacted
        past that revision re-lists and reports what vanished as DELETEs.
        """
        revision: int | None = None
        delay = WATCH_RETRY_MIN_SECONDS
        while True:
            events = self._runtime.store.watch_prefix(MDC_PREFIX, start_revision=revision)
            try:
                async for event in events:
                    revision = max(revision or 0, event.kv.revision)
                    delay = WATCH_RETRY_MIN_SECONDS
                    await self.handle_event(event)
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
                aclose = getattr(events, "aclose", None)  # stop the store's watch now
                if aclose is not None:
                    await aclose()
            await asyncio.sleep(delay)
            delay = min(2 * delay, WATCH_RETRY_MAX_SECONDS)

    def _accept(self, model: _Model) -> None:
        """Make the routing views match the groups: a view routes to the instances of the
        served group, and a view only standby groups use routes to theirs (it serves nothing
        until a switch, which sets it again)."""
        served = model.served
        for group in model.standby.values():
            if group.view is not served.view:
                group.view.accepted = group.instance_ids()
        served.view.accepted = served.instance_ids()
        model.served_live = _routable(served)

    async def close(self) -> None:
        """Close every endpoint client the watcher opened (at frontend shutdown)."""
        views = {id(g.view): g.view for m in self._models.values() for g in m.groups()}
        for view in views.values():
            view.client.remove_listener(view.listener)
        if self.prefill is not None:
            await self.prefill.close()
        await self._manager.close()
        for view in views.values():  # standby views (closing twice is harmless)
            await _close_client(view)
        # Clients being closed and updates being sent after a switch: let them finish (an
        # update into a full, unread queue would wait forever: those are cancelled).
        pending = list(self._pending_sends)
        if pending:
            _, late = await asyncio.wait(pending, timeout=1.0)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)

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
        try:
            card = msgspec.json.decode(value, type=ModelDeploymentCard)
        except msgspec.DecodeError as err:
            hint = ""
            if "$.tokenizer" in str(err):
                # Workers that predate content-addressed artifacts named a path here.
                hint = " (a worker older than this frontend? its tokenizer must be an artifact)"
            log.error("invalid model card key=%s error=%s%s value=%.200r", key, err, hint, value)
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
        old = self._groups_by_key.get(key)
        if old is not None and (old.name != name or old.checksum != card.checksum()):
            # The key now holds another card: its old entry leaves first.
            await self._handle_delete(key)
        model = self._models.get(name)
        if model is not None:
            return await self._join(model, key, card)

        try:
            view = await self._view(card)
            try:
                built = await self._build(card, view)
            except BaseException:
                await _close_client(view)
                raise
            self._register(name, built)
        except Exception as err:
            if isinstance(err, InvalidCard):
                return self._refuse(key, card, err)
            if isinstance(err, UnsupportedModel) and not self._first_sight(name, err):
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
        group = self._new_group(card, view, built)
        model = self._models[name] = _Model(served=group)
        self._add_entry(model, group, key, card)
        self._manager.add_model_client(name, view)
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

    async def _join(self, model: _Model, key: str, card: ModelDeploymentCard) -> _Outcome:
        """Another instance (or LoRA entry) of a served model: an instance of the served card
        joins its routing; one of another card joins (or starts) a standby group."""
        name = card.display_name
        checksum = card.checksum()
        served = model.served
        if checksum == served.checksum:
            self._add_entry(model, served, key, card)
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
            self._add_entry(model, group, key, card)
            log.debug(
                "new instance of a standby card model=%s instance=%x checksum=%s",
                name,
                card.instance_id,
                checksum,
            )
            return _Outcome.STANDBY

        # A card never seen for this model: build its pipelines now (nothing is registered),
        # so that the switch, when it comes, is instant and cannot fail half-way.
        try:
            view = served.view
            if card.endpoint != view.endpoint:
                view = await self._view(card)
            try:
                built = await self._build(card, view)
            except BaseException:
                if view is not served.view:
                    await _close_client(view)
                raise
        except Exception as err:
            if isinstance(err, InvalidCard):
                return self._refuse(key, card, err)
            if isinstance(err, UnsupportedModel) and not self._first_sight(name, err):
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
            # The model changed while we built (only cancellation interleaves; be safe).
            if view is not served.view:
                await _close_client(view)
            return _Outcome.REJECTED
        group = self._new_group(card, view, built)
        model.standby[checksum] = group
        self._add_entry(model, group, key, card)
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

    def _first_sight(self, name: str, err: Exception) -> bool:
        """True the first time this refusal of ``name`` is seen (it is then logged as an
        error; later instances of the same card only at debug level)."""
        seen = (name, str(err))
        if seen in self._refusals_logged:
            return False
        if len(self._refusals_logged) >= _MAX_LOGGED_REFUSALS:
            self._refusals_logged.clear()
        self._refusals_logged.add(seen)
        return True

    def _refuse(self, key: str, card: ModelDeploymentCard, err: InvalidCard) -> _Outcome:
        """Log the refusal of an invalid card: an error the first time for its model and
        reason, debug after."""
        name = card.display_name
        if self._first_sight(name, err):
            log.error(
                "model card refused: model=%s instance=%x key=%s field=%s: %s",
                name,
                card.instance_id,
                key,
                err.field,
                err.reason,
            )
        else:
            log.debug("model card refused again model=%s key=%s field=%s", name, key, err.field)
        return _Outcome.REJECTED

    async def _drop_replaced(self, key: str) -> None:
        """``key`` now holds a refused card: what its previous card was (a served entry, a
        LoRA adapter, a prefill instance) leaves, as on a DELETE."""
        if self._lora is not None and self._lora.on_delete(key):
            return
        if self.prefill is not None and await self.prefill.on_delete(key):
            return
        if key in self._groups_by_key:
            await self._handle_delete(key)

    async def _view(self, card: ModelDeploymentCard) -> AcceptedInstances:
        """A new routing view over a new client of ``card``'s endpoint, watched for the
        instances leaving (see ``_on_instances_changed``)."""
        inner = await self._runtime.endpoint(card.endpoint).client()
        view = AcceptedInstances(inner)
        view.listener = functools.partial(self._on_instances_changed, card.display_name)
        inner.add_listener(view.listener)
        return view

    def _new_group(
        self, card: ModelDeploymentCard, view: AcceptedInstances, built: list[_Built]
    ) -> _Group:
        self._seq += 1
        return _Group(card.display_name, card.checksum(), card, self._seq, view, built)

    def _add_entry(self, model: _Model, group: _Group, key: str, card: ModelDeploymentCard) -> None:
        group.entries[key] = card
        self._groups_by_key[key] = group
        if group is model.served:
            self._manager.save_model_entry(key, card)
        self._accept(model)

    async def _build(self, card: ModelDeploymentCard, view: AcceptedInstances) -> list[_Built]:
        """Build every pipeline ``card`` asks for, routed through ``view``; registers nothing.

        The (input, type) table is ``PAIRS`` (Dynamo's ``handle_put`` serves one pair per
        card; here a card with several types is served on each, when every one pairs with
        its input). A card with any other pair is refused, naming ``SUPPORTED_PAIRS``.
        """
        steps = pipelines_for(card)
        # Typed as the client it stands for: the factory and the manager use it as one.
        client = cast("EndpointClient", view)
        built: list[_Built] = []
        for method, kind in steps:
            build: _Builder = getattr(self._factory, method)
            built.append((kind, await build(card, client)))
        return built

    def _register(self, name: str, built: list[_Built]) -> None:
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

    def _unregister(self, name: str, built: list[_Built]) -> None:
        for kind, _ in built:
            with contextlib.suppress(ModelNotFound):
                self._manager.remove_engine(kind, name)

    # -- switching cards ------------------------------------------------------------------------

    @staticmethod
    def _choose(model: _Model, live_only: bool) -> _Group | None:
        """The standby group to serve next: the most instances, ties by the earliest seen.
        ``live_only``: only groups with an instance that can be routed to now."""
        candidates = [
            g for g in model.standby.values() if g.entries and (not live_only or _routable(g))
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda g: (-len(g.instance_ids()), g.seq))

    def _switch(self, model: _Model, new: _Group, why: str) -> list[ModelUpdate]:
        """Serve ``new`` instead of the served group, in one step (no await): no request
        finds the model half-built or missing. The old group stays standby while it has
        entries. Returns the updates to send."""
        m = self._manager
        old = model.served
        name = old.name
        self._unregister(name, old.built)
        self._register(name, new.built)
        for key in old.entries:
            m.remove_model_entry(key)
        for key, card in new.entries.items():
            m.save_model_entry(key, card)
        del model.standby[new.checksum]
        model.served = new
        if old.entries:
            model.standby[old.checksum] = old
        if new.view is not old.view:
            m.take_model_clients(name)
            m.add_model_client(name, new.view)
        self._accept(model)
        metrics = getattr(self._factory, "metrics", None)
        if metrics is not None:
            metrics.card_switches.labels(name).inc()
        log.warning(
            "model switched card: model=%s checksum=%s -> %s (%d instances); %s",
            name,
            old.checksum,
            new.checksum,
            len(new.instance_ids()),
            why,
        )
        if not old.entries:
            self._drop_view(model, old)
        self._notify_model_changed()
        updates: list[ModelUpdate] = [ModelUpdate.Added(new.card.model_type)]
        for model_type, kind in TYPE_KINDS.items():
            if model_type in old.card.model_type and not m.list_models_of(kind):
                updates.append(ModelUpdate.Removed(model_type))
        return updates

    def _on_instances_changed(self, name: str) -> None:
        """A client of ``name`` saw instances come, go, or be set aside. When the last
        routable instance of the served card has just gone and a standby card has routable
        instances, switch now, rather than answer 503 while new workers are up:

        * it left discovery: the card's DELETE follows on the model watch, but requests
          arriving meanwhile would find no instance to route to;
        * it is set aside (unreachable): typically a worker that stopped taking requests
          before this frontend's discovery saw it leave (stores that are polled).

        Runs inside the client's update (synchronously), so the request that set the last
        instance aside retries on the new card's instances."""
        model = self._models.get(name)
        if model is None:
            return
        served = model.served
        live = _routable(served)
        was_live, model.served_live = model.served_live, live
        if live or not was_live or not model.standby:
            return
        new = self._choose(model, live_only=True)
        if new is None:
            return
        announced = served.instance_ids() & served.view.announced_ids()
        why = (
            "no instance of the served card is reachable"
            if announced
            else "the last instance of the served card left"
        )
        updates = self._switch(model, new, why)
        task = asyncio.get_running_loop().create_task(self._send_all(updates))
        self._pending_sends.add(task)
        task.add_done_callback(self._pending_sends.discard)

    def _drop_view(self, model: _Model, group: _Group) -> None:
        """``group`` is gone: close its view's client unless another group of the model uses
        it (in the background: closing awaits its watch task)."""
        if any(g.view is group.view for g in model.groups() if g is not group):
            return
        group.view.client.remove_listener(group.view.listener)
        task = asyncio.get_running_loop().create_task(_close_client(group.view))
        self._pending_sends.add(task)
        task.add_done_callback(self._pending_sends.discard)

    # -- DELETE ---------------------------------------------------------------------------------

    async def _handle_delete(self, key: str) -> None:
        if self._lora is not None and self._lora.on_delete(key):
            return  # an adapter was unloaded
        if self.prefill is not None and await self.prefill.on_delete(key):
            return  # a prefill instance left
        was_rejected = key in self._rejected_keys
        self._rejected_keys.discard(key)
        group = self._groups_by_key.pop(key, None)
        if group is None:
            if was_rejected:
                log.debug("refused model entry deleted key=%s", key)
            else:
                log.error("Missing model entry for %s", key)
            return
        name = group.name
        model = self._models[name]
        del group.entries[key]
        if group is not model.served:
            if not group.entries:
                del model.standby[group.checksum]
                self._drop_view(model, group)
                log.info("standby card of model left model=%s checksum=%s", name, group.checksum)
            self._accept(model)
            return
        self._manager.remove_model_entry(key)
        if group.entries:
            self._accept(model)
            log.debug("instance of model left, others remain model=%s key=%s", name, key)
            return
        new = self._choose(model, live_only=False)
        if new is not None:
            await self._send_all(
                self._switch(model, new, "the last instance of the served card left")
            )
            return
        await self._remove_model(model)

    async def _remove_model(self, model: _Model) -> None:
        """The last instance left: unregister every kind, then report each kind that no
        model serves any more (a kind another model still serves stays enabled)."""
        name = model.served.name
        del self._models[name]
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
        views = {id(g.view): g.view for g in model.groups()}
        for view in views.values():
            view.client.remove_listener(view.listener)
            await _close_client(view)
        release = getattr(self._factory, "release", None)
        if release is not None:
            await release(name)
        log.info("removed model model=%s", name)
        for kind in emptied:
            await self._send(ModelUpdate.Removed(kind))
        if not emptied:
            log.debug("no model update to send for model=%s", name)

    async def _send_all(self, updates: list[ModelUpdate]) -> None:
        for update in updates:
            await self._send(update)

    async def _send(self, update: ModelUpdate) -> None:
        if self._updates is not None:
            await self._updates.put(update)


def _routable(group: _Group) -> set[int]:
    """The group's instances its view's client can route to (announced, not set aside)."""
    return group.instance_ids() & set(group.view.client.instance_ids())


async def _close_client(client: EndpointClient) -> None:
    try:
        await client.close()
    except Exception:
        log.exception("error closing endpoint client")
