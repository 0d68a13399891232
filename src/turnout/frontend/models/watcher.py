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
* DELETE (the worker left, or its lease expired): forget the entry. When it was the last
  entry of the served card and standby groups remain, the model *switches* card: the
  standby group with the most instances (ties: the earliest seen) becomes the served one,
  its pre-built pipelines replacing the old ones in one step, with no await in between (a
  model is never half-built, never missing), logged once and counted in
  ``turnout_model_card_switches_total{model}``. When no group remains, unregister the model,
  close its clients, and send ``ModelUpdate.Removed`` for each request kind that no model
  serves any more.

Every card of a model routes through a view of its own (``AcceptedInstances``) over the one
endpoint client the model's cards on that endpoint share, listing only the instances that
publish that card; the factory keeps one KV router (and one load table, one session table)
per card. A request is tokenized by the pipeline of the card served when it arrived, and it
stays on that card's instances to its end, retries and migrations included: after a switch,
requests already running on the old card finish on the old card's instances (or fail there),
never on an instance whose tokenizer or template differs. An instance announced in discovery
whose card was refused (artifacts that could not be fetched, invalid card) is in no view.

The switch also happens the moment the client sees the served card's last instance leave
discovery or be set aside (``_on_instances_changed``), when a standby card has a live
instance: the instance key and the card key of a leaving worker vanish together, but the
endpoint client and this watcher learn it on separate watches; in between, a new request
would find no instance of the served card to route to. Switching on the first of the two
closes that gap, which is what lets a rolling upgrade (start the new workers, stop the old
ones one by one) refuse no new request.

A card switched away from is not forgotten at once: for ``card_grace_s`` seconds (the switch
*grace period*) it stays the model's *previous* card, its pipelines and view kept even with
no instance left. When an instance of the previous card is routable again within the grace
period (it was set aside for a moment, or its worker registered again after a lost lease),
the model switches back to it: a transient loss of the served card does not hand the model
for good to another card, which may be a single odd worker. Past the grace period the switch
is final; the previous card, if it still has instances, is one more standby card.

An instance whose record names another request or event plane than this frontend's is
refused: it is in no view, so no request goes to it, and one warning line says so (once per
instance). A worker on another plane set would otherwise take requests while its KV events
and load reports go where this frontend does not listen. A record that names no plane (a
process older than the field) is accepted. ``held_back()`` lists the refused instances and
the standby ones, with the reason, for the frontend's record and ``turnout status``.

Cards of prefill instances (``ModelType.Prefill``, disaggregated serving) are not models:
they go to ``frontend.models.prefill_watch``, which activates the model's prefill router with
its first prefill instance and deactivates it with the last.

Events of one model are handled one at a time, in store order; different models' events are
handled concurrently (at most ``max_concurrent_models`` at once), so that a model whose build
waits on a slow artifact fetch (a tokenizer fetch running to its deadline) never holds up the
others. A bad event (invalid card, unsupported pair, failing factory) is logged and skipped;
the watcher never stops for one.

Nothing in a card is trusted: whoever can write the store can write one. A card whose
numbers are out of range (a context of 2^62 tokens, a KV block of 0 tokens, a tokenizer
announced at 20 GB: ``protocols.card_bounds``, with this frontend's ``--max-artifact-bytes``)
or whose chat template spins on a probe conversation is refused before anything is built from
it, with one error line naming the model, the instance and the field (once per model and
reason: the next instances of the same card are refused at debug level), and no traceback.
A key that held a served card and now holds a refused one leaves its model first.

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
import contextlib
import enum
import functools
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import msgspec

from turnout.errors import ModelNotFound
from turnout.frontend.admission.limiter import Cancellable, Clock, LoopClock
from turnout.frontend.models.accepted_instances import AcceptedInstances, ModelClient
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
from turnout.protocols.card_bounds import CardBounds, card_problem
from turnout.protocols.frontend import HeldBackCard, HoldReason
from turnout.protocols.model import (
    MDC_ROOT,
    ModelDeploymentCard,
    ModelType,
)
from turnout.runtime.discovery.base import WatchEvent, WatchEventKind
from turnout.runtime.plane_refusals import PlaneRefusals

if TYPE_CHECKING:
    from turnout.router.lora import LoraRegistry
    from turnout.runtime.component import DistributedRuntime

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
#: How long a card switched away from may come back and be served again (see above). Shorter
#: than the endpoint client's first set-aside (``runtime.endpoint_client.DOWN_RETRY_SECONDS``):
#: an instance that merely ends its set-aside, unproven, does not take the model back; one
#: announced again, or whose connection answers again, does.
CARD_GRACE_SECONDS = 3.0
#: Models whose events are handled at once (each may be waiting on an artifact fetch).
MAX_CONCURRENT_MODELS = 8
#: Events read from the store and not yet handled; past it the watch waits (a model whose
#: build is stalled cannot make the watcher hold an unbounded backlog).
MAX_QUEUED_EVENTS = 4096

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


class _CardName(msgspec.Struct):
    """The part of a card that says which model's events it belongs with."""

    display_name: str


_card_name_decoder = msgspec.json.Decoder(_CardName)


@dataclass(slots=True, eq=False)
class _Group:
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
    built: list[_Built]
    #: Discovery key -> card of every entry (instance, or LoRA entry) with this card.
    entries: dict[str, ModelDeploymentCard] = field(default_factory=dict)

    def instance_ids(self) -> set[int]:
        return {card.instance_id for card in self.entries.values()}


@dataclass(slots=True, eq=False)
class _Endpoint:
    """The client of one endpoint a model's cards are announced on, shared by their views,
    and the watcher's listener on it."""

    client: ModelClient
    listener: Callable[[], None]


@dataclass(slots=True, eq=False)
class _Model:
    """A served model: its served group, its standby groups (by checksum), and the endpoint
    clients their views share (by endpoint path)."""

    served: _Group
    endpoints: dict[str, _Endpoint]
    standby: dict[str, _Group] = field(default_factory=dict)
    #: Instances of the served group that could be routed to at the last look (announced,
    #: not set aside): when the last of them goes while a standby group has routable
    #: instances, the model switches at once.
    served_live: set[int] = field(default_factory=set)
    #: The card served before the last switch, while it may come back (until
    #: ``previous_until`` on the watcher's clock); one of ``standby``.
    previous: _Group | None = None
    previous_until: float = 0.0
    #: Forgets ``previous`` once its grace period is over.
    previous_timer: Cancellable | None = None

    def groups(self) -> list[_Group]:
        return [self.served, *self.standby.values()]


@dataclass(slots=True, eq=False)
class _Lane:
    """The events of one model waiting to be handled, in store order, and the task handling
    them (None when there are none)."""

    events: deque[WatchEvent] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None


# -- the watcher --------------------------------------------------------------------------------


#: Distinct refusal messages (unsupported pairs, invalid cards) remembered so each is logged
#: once (bounded: past it, forgotten and logged again).
_MAX_LOGGED_REFUSALS = 1024


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
        self._grace = card_grace_s
        self._clock: Clock = clock or LoopClock()
        # Set, then replaced, whenever a chat-capable model may have appeared: every task
        # waiting on the old event wakes together (a broadcast, not a hand-off to one).
        self._model_changed = asyncio.Event()
        # Keys whose PUT was refused: their DELETE is expected and logged at debug only.
        self._rejected_keys: set[str] = set()
        # (model, message) of refused cards already logged (see ``_first_sight``).
        self._refusals_logged: set[tuple[str, str]] = set()
        # Instances on other planes than this frontend's: refused. Only ids of entries in
        # ``_groups_by_key`` (forgotten when their last entry leaves).
        self._planes = PlaneRefusals(runtime.request_plane, runtime.event_plane.kind, "frontend")
        #: Set whenever what ``held_back`` returns may have changed; its reader clears it.
        self.held_back_changed = asyncio.Event()
        # What a card may announce; artifacts as large as the factory's fetcher takes.
        self._bounds = CardBounds(max_artifact_bytes=pipeline_factory.max_artifact_bytes)
        # Model name -> its groups of cards; key -> the group holding its entry.
        self._models: dict[str, _Model] = {}
        self._groups_by_key: dict[str, _Group] = {}
        self._seq = 0
        # Per model name, its events waiting to be handled; key -> the model name its last
        # PUT was queued under (so its DELETE follows it). Both hold only keys in the store
        # and models with events in flight.
        self._lanes: dict[str, _Lane] = {}
        self._lane_of_key: dict[str, str] = {}
        self._handling = asyncio.Semaphore(max_concurrent_models)
        self._room = asyncio.Semaphore(MAX_QUEUED_EVENTS)
        self._queued = 0
        self._settled = asyncio.Event()
        self._settled.set()
        # Background work started where nothing can await: updates of switches made in a
        # client's listener, clients being closed.
        self._pending_sends: set[asyncio.Task[None]] = set()
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

    async def wait_for_chat_model(self) -> str:
        """The name of a served chat model (first by name), waiting until there is one."""
        while True:
            names = self._manager.list_models_of(ModelKind.CHAT)
            if names:
                return names[0]
            await self._model_changed.wait()

    async def settled(self) -> None:
        """Return once every event read from the store so far has been handled."""
        await self._settled.wait()

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
            lanes = [lane.task for lane in self._lanes.values() if lane.task is not None]
            for task in lanes:
                task.cancel()
            if lanes:
                await asyncio.wait(lanes)

    async def _watch(self) -> None:
        revision: int | None = None
        delay = WATCH_RETRY_MIN_SECONDS
        while True:
            events = self._runtime.store.watch_prefix(MDC_PREFIX, start_revision=revision)
            try:
                async for event in events:
                    revision = max(revision or 0, event.kv.revision)
                    delay = WATCH_RETRY_MIN_SECONDS
                    await self._dispatch(event)
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

    async def _dispatch(self, event: WatchEvent) -> None:
        """Queue ``event`` behind its model's earlier events. Events that belong to no model
        (a value that is not a card, the DELETE of a key never queued) are handled here: they
        build nothing, so they cannot hold the watch up."""
        key = event.kv.key
        name: str | None
        if event.kind is WatchEventKind.PUT:
            try:
                name = _card_name_decoder.decode(event.kv.value).display_name
            except msgspec.DecodeError:
                name = None
            if name is not None:
                self._lane_of_key[key] = name
        else:
            name = self._lane_of_key.pop(key, None)
        if name is None:
            await self.handle_event(event)
            return
        await self._room.acquire()
        self._queued += 1
        self._settled.clear()
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes[name] = _Lane()
        lane.events.append(event)
        if lane.task is None:
            lane.task = asyncio.get_running_loop().create_task(
                self._run_lane(name, lane), name=f"model-events-{name}"
            )

    async def _run_lane(self, name: str, lane: _Lane) -> None:
        """Handle ``name``'s queued events in order, holding one of the concurrent slots for
        each; the lane is gone once it is empty."""
        try:
            while lane.events:
                event = lane.events.popleft()
                try:
                    async with self._handling:
                        await self.handle_event(event)
                finally:
                    self._done_one()
        finally:
            for _ in lane.events:  # cancelled: what was left will not be handled
                self._done_one()
            lane.events.clear()
            if self._lanes.get(name) is lane:
                del self._lanes[name]

    def _done_one(self) -> None:
        self._room.release()
        self._queued -= 1
        if self._queued == 0:
            self._settled.set()

    def _accept(self, model: _Model) -> None:
        """Make every routing view list its own card's instances (those on this frontend's
        planes)."""
        self._apply_planes(model)
        model.served_live = _routable(model.served)

    def _apply_planes(self, model: _Model) -> None:
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

    def held_back(self) -> list[HeldBackCard]:
        """Every instance with a card of a served model that gets no request, and why:
        refused for its planes, or standby (its card differs from the served one). Sorted by
        model, then instance id."""
        held: list[HeldBackCard] = []
        for name, model in self._models.items():
            served = model.served
            for group in model.groups():
                for instance_id in sorted(group.instance_ids()):
                    refused = self._planes.reason(instance_id)
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

    async def close(self) -> None:
        """Close every endpoint client the watcher opened (at frontend shutdown)."""
        endpoints = [e for m in self._models.values() for e in m.endpoints.values()]
        for model in self._models.values():
            if model.previous_timer is not None:
                model.previous_timer.cancel()
        for endpoint in endpoints:
            endpoint.client.remove_listener(endpoint.listener)
        if self.prefill is not None:
            await self.prefill.close()
        await self._manager.close()
        for endpoint in endpoints:  # those of standby views (closing twice is harmless)
            await _close_client(endpoint.client)
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
                # A card that names its tokenizer by path, not as a content-addressed artifact.
                hint = " (its tokenizer must be a content-addressed artifact: upgrade the worker)"
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

        endpoints: dict[str, _Endpoint] = {}
        try:
            view = await self._view(name, endpoints, card)
            try:
                built = await self._build(card, view)
            except BaseException:
                await _close_endpoints(endpoints)
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
        model = self._models[name] = _Model(served=group, endpoints=endpoints)
        self._add_entry(model, group, key, card)
        self._manager.add_model_client(name, view)
        self._factory.serving(card, view)
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
            back = self._switch_back(model)
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
                    await self._drop_endpoint_if_unused(model, card.endpoint.path())
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
            # The model was removed while we built (a key moved to it from another model
            # left it empty): what was built goes.
            self._release_card(card, view)
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

    async def _view(
        self, name: str, endpoints: dict[str, _Endpoint], card: ModelDeploymentCard
    ) -> AcceptedInstances:
        """A new routing view for ``card``, over the model's client of the card's endpoint
        (opened, and watched for instances leaving, when the model has none there yet: see
        ``_on_instances_changed``)."""
        path = card.endpoint.path()
        endpoint = endpoints.get(path)
        if endpoint is None:
            client = await self._runtime.endpoint(card.endpoint).client()
            listener = functools.partial(self._on_instances_changed, name)
            client.add_listener(listener)
            endpoint = endpoints[path] = _Endpoint(client, listener)
        return AcceptedInstances(endpoint.client)

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
        built: list[_Built] = []
        try:
            for build, kind in pipelines_for(card):
                built.append((kind, await build(self._factory, card, view)))
        except BaseException:
            self._release_card(card, view)  # what the factory holds goes with the pipelines
            raise
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
        finds the model half-built or missing. The old group stays standby, as the model's
        previous card for the grace period (a switch back ends it). Returns the updates to
        send."""
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
        log.warning(
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

    def _switch_back(self, model: _Model) -> list[ModelUpdate]:
        """When the model's previous card has a routable instance again within its grace
        period, serve it again; returns the updates to send (none when nothing changed)."""
        previous = model.previous
        if previous is None or not _routable(previous):
            return []
        if self._clock.now() >= model.previous_until:
            self._forget_previous(model)
            return []
        return self._switch(
            model, previous, "the previous card's instances are back within the grace period"
        )

    def _forget_previous(self, model: _Model) -> None:
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
        model = self._models.get(name)
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

    def _on_instances_changed(self, name: str) -> None:
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
        model = self._models.get(name)
        if model is None:
            return
        self._apply_planes(model)
        updates = self._switch_back(model)
        if not updates:
            updates = self._switch_if_served_gone(model)
        if updates:
            self._background(self._send_all(updates))

    def _switch_if_served_gone(self, model: _Model) -> list[ModelUpdate]:
        served = model.served
        live = _routable(served)
        was_live, model.served_live = model.served_live, live
        if live or not was_live or not model.standby:
            return []
        new = self._choose(model, live_only=True)
        if new is None:
            return []
        announced = served.instance_ids() & served.view.announced_ids()
        why = (
            "no instance of the served card is reachable"
            if announced
            else "the last instance of the served card left"
        )
        return self._switch(model, new, why)

    def _drop_group(self, model: _Model, group: _Group) -> None:
        """``group`` is gone from the model: release what the factory holds for its card,
        and close its endpoint's client unless another group of the model uses it (in the
        background: closing awaits its watch task)."""
        self._release_card(group.card, group.view)
        path = group.card.endpoint.path()
        if any(g.card.endpoint.path() == path for g in model.groups() if g is not group):
            return
        endpoint = model.endpoints.pop(path, None)
        if endpoint is not None:
            endpoint.client.remove_listener(endpoint.listener)
            self._background(_close_client(endpoint.client))

    async def _drop_endpoint_if_unused(self, model: _Model, path: str) -> None:
        """A build on an endpoint new to the model failed: close that endpoint's client."""
        if any(g.card.endpoint.path() == path for g in model.groups()):
            return
        endpoint = model.endpoints.pop(path, None)
        if endpoint is not None:
            endpoint.client.remove_listener(endpoint.listener)
            await _close_client(endpoint.client)

    def _release_card(self, card: ModelDeploymentCard, view: AcceptedInstances) -> None:
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
        card = group.entries.pop(key)
        if card.instance_id not in group.instance_ids():
            self._planes.forget(card.instance_id)
        if group is not model.served:
            if not group.entries and group is not model.previous:
                del model.standby[group.checksum]
                self._drop_group(model, group)
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
            await _close_client(endpoint.client)
        for group in model.groups():
            try:
                await self._factory.release(group.card, group.view)
            except Exception as exc:  # the model is gone all the same: say so, go on
                log.error(
                    "model %s: releasing the routing state of card %s failed: %r",
                    name, group.card.checksum(), exc, exc_info=exc,
                )  # fmt: skip
        log.info("removed model model=%s", name)
        for model_type in emptied:
            await self._send(ModelUpdate.Removed(model_type))
        if not emptied:
            log.debug("no model update to send for model=%s", name)

    async def _send_all(self, updates: list[ModelUpdate]) -> None:
        for update in updates:
            await self._send(update)

    async def _send(self, update: ModelUpdate) -> None:
        if self._updates is not None:
            await self._updates.put(update)


def _routable(group: _Group) -> set[int]:
    """The group's instances its view can route to (announced, not set aside, not refused
    for their planes)."""
    return set(group.view.instance_ids())


async def _close_endpoints(endpoints: dict[str, _Endpoint]) -> None:
    for endpoint in endpoints.values():
        endpoint.client.remove_listener(endpoint.listener)
        await _close_client(endpoint.client)
    endpoints.clear()


async def _close_client(client: ModelClient) -> None:
    try:
        await client.close()
    except Exception:
        log.exception("error closing endpoint client")
