"""Turn model-card events from the discovery store into served models.

Workers publish one ``ModelDeploymentCard`` per instance under their lease::

    v1/mdc/{namespace}/{component}/{endpoint}/{instance_id:x}[/{lora}]  -> card (JSON)

The ``ModelWatcher`` follows that prefix and keeps the ``ModelManager`` in step with it:

* PUT of a card for a model nobody serves yet: build its pipelines (through the
  ``PipelineFactory``, chosen by the card's ``ModelInput`` x ``ModelType``), register them,
  remember the entry, send ``ModelUpdate.Added``.
* PUT for a model already served: another instance joined; remember the entry, send
  ``Added``. Nothing is rebuilt: the model's endpoint client already sees the new instance.
  An instance whose card checksum disagrees with the model's is refused (it would be served
  with the wrong tokenizer or template).

The pipelines route through the model's endpoint client seen as ``AcceptedInstances``: only
instances whose card the watcher accepted are candidates. An instance announced in discovery
whose card was refused (checksum mismatch, artifacts that could not be fetched, invalid card)
gets no request of this model.
* DELETE (the worker left, or its lease expired): forget the entry; when it was the model's
  last one, unregister the model, close its client, and send ``ModelUpdate.Removed`` for each
  request kind that no model serves any more.

Events are handled one at a time, in store order. A bad event (invalid card, unsupported
pair, failing factory) is logged and skipped; the watcher never stops for one.

Building a Tokens model fetches the artifacts its card names (the tokenizer) by content from
the model's instances (``frontend.artifacts``, called by the factory). When no instance
delivers them (worker gone, checksum mismatch, deadline passed), the build fails like any
other: nothing of the model is registered, the instance is left out, the reason is logged once
(as an error, without a traceback), and the next instance's card builds the model afresh.

This is a re-design of Dynamo's ``discovery/watcher.rs`` for asyncio.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import msgspec

from turnout.errors import ModelNotFound
from turnout.frontend.model_manager import ModelManager
from turnout.llm.artifacts import ArtifactError
from turnout.protocols.model import (
    MDC_ROOT,
    Instance,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
)
from turnout.runtime.discovery.base import WatchEvent, WatchEventKind

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from turnout.runtime.component import DistributedRuntime, EndpointClient

    _Builder = Callable[[ModelDeploymentCard, EndpointClient], Awaitable[object]]
    _Register = Callable[[str, object], None]
    _Unregister = Callable[[str], None]

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

#: The (ModelInput, ModelType) pairs the watcher can build, as error messages name them.
SUPPORTED_PAIRS = "Tokens+(Chat|Completions), Text+Chat, Text+Completions"


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


# -- pipelines ----------------------------------------------------------------------------------


class PipelineFactory(Protocol):
    """Builds the engine the HTTP service calls for one model and one kind of request.

    Each method gets the model's card and the endpoint client to route through (one client
    per model, shared by its chat and completions pipelines) and returns the engine to
    register. Raising refuses the model: the watcher logs the error and serves nothing of it.
    """

    async def build_chat(self, card: ModelDeploymentCard, client: EndpointClient) -> object:
        """Tokens + Chat: preprocessor -> migration -> backend -> router -> worker."""
        ...

    async def build_completions(self, card: ModelDeploymentCard, client: EndpointClient) -> object:
        """Tokens + Completions: the same pipeline, without a chat template."""
        ...

    async def build_text_chat(self, card: ModelDeploymentCard, client: EndpointClient) -> object:
        """Text + Chat: the worker does its own pre/post-processing; router only."""
        ...

    async def build_text_completions(
        self, card: ModelDeploymentCard, client: EndpointClient
    ) -> object:
        """Text + Completions: router only."""
        ...

    async def release(self, name: str) -> None:
        """The model's last instance left: free what its pipelines hold (e.g. a KV router)."""
        ...


class _Outcome(enum.Enum):
    """What became of a PUT; the watcher's only state transition per key."""

    ADDED = "added"  # a new model was built and registered
    JOINED = "joined"  # another instance of a served model
    REJECTED = "rejected"  # logged and skipped


# -- the watcher --------------------------------------------------------------------------------


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
    ) -> None:
        self._runtime = runtime
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
        # Model name -> the routing view of its endpoint client (accepted instances only).
        self._views: dict[str, AcceptedInstances] = {}

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

    def _accept(self, name: str) -> None:
        """Make the routing view of ``name`` match its accepted entries."""
        view = self._views.get(name)
        if view is not None:
            view.accepted = {c.instance_id for c in self._manager.entries_for_model(name)}

    async def close(self) -> None:
        """Close every endpoint client the watcher opened (at frontend shutdown)."""
        await self._manager.close()

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

        name = card.display_name
        if self._manager.has_model_any(name):
            return await self._join(key, card)

        try:
            await self._build(card)
        except Exception as err:
            log.error(
                "error adding model %s from namespace %s: %s",
                name,
                namespace,
                err,
                # Expected, operational failures carry their whole story in the message.
                exc_info=not isinstance(err, (_Unsupported, ArtifactError)),
            )
            return _Outcome.REJECTED
        self._manager.save_model_entry(key, card)
        self._accept(name)
        log.info(
            "added model model=%s namespace=%s type=%s input=%s instance=%x",
            name,
            namespace,
            card.model_type.names(),
            card.model_input.value,
            card.instance_id,
        )
        await self._send(ModelUpdate.Added(card.model_type))
        self._notify_model_changed()
        return _Outcome.ADDED

    async def _join(self, key: str, card: ModelDeploymentCard) -> _Outcome:
        """Another instance (or LoRA entry) of a served model."""
        name = card.display_name
        existing = self._manager.entries_for_model(name)
        if existing and existing[0].checksum() != card.checksum():
            ref = existing[0]
            log.error(
                "model card mismatch, instance not added: model=%s key=%s checksum=%s "
                "differs from instance=%x checksum=%s",
                name,
                key,
                card.checksum(),
                ref.instance_id,
                ref.checksum(),
            )
            return _Outcome.REJECTED
        self._manager.save_model_entry(key, card)
        self._accept(name)
        log.debug(
            "new instance of existing model model=%s namespace=%s instance=%x",
            name,
            card.endpoint.namespace,
            card.instance_id,
        )
        await self._send(ModelUpdate.Added(card.model_type))
        self._notify_model_changed()
        return _Outcome.JOINED

    async def _build(self, card: ModelDeploymentCard) -> None:
        """Build and register every pipeline ``card`` asks for, or none of them.

        The (input, type) table, as in the seed's ``handle_put``:

        ====== ===================== ===============================================
        input  type                  engines
        ====== ===================== ===============================================
        Tokens Chat and/or Compl.    build_chat / build_completions (full pipeline)
        Text   Chat                  build_text_chat (router only)
        Text   Completions           build_text_completions (router only)
        other                        refused, naming ``SUPPORTED_PAIRS``
        ====== ===================== ===============================================
        """
        name, mt, mi = card.display_name, card.model_type, card.model_input
        f = self._factory
        steps: list[tuple[_Builder, _Register, _Unregister]] = []
        m = self._manager
        if mi is ModelInput.Tokens and (mt.supports_chat() or mt.supports_completions()):
            if mt.supports_chat():
                steps.append((f.build_chat, m.add_chat_model, m.remove_chat_model))
            if mt.supports_completions():
                steps.append(
                    (f.build_completions, m.add_completions_model, m.remove_completions_model)
                )
        elif mi is ModelInput.Text and mt.supports_chat():
            steps.append((f.build_text_chat, m.add_chat_model, m.remove_chat_model))
        elif mi is ModelInput.Text and mt.supports_completions():
            steps.append(
                (f.build_text_completions, m.add_completions_model, m.remove_completions_model)
            )
        else:
            raise _Unsupported(
                f"unsupported model configuration {mi.name}+{mt.names()} "
                f"({mt.names()} with {mi.name} input); supported: {SUPPORTED_PAIRS}"
            )

        inner = await self._runtime.endpoint(card.endpoint).client()
        # Typed as the client it stands for: the factory and the manager use it as one.
        client = cast("EndpointClient", AcceptedInstances(inner))
        registered: list[_Unregister] = []
        try:
            for build, register, unregister in steps:
                engine = await build(card, client)
                register(name, engine)
                registered.append(unregister)
        except BaseException:
            for unregister in registered:
                unregister(name)
            await _close_client(client)
            raise
        self._views[name] = cast("AcceptedInstances", client)
        self._manager.add_model_client(name, client)

    # -- DELETE ---------------------------------------------------------------------------------

    async def _handle_delete(self, key: str) -> None:
        was_rejected = key in self._rejected_keys
        self._rejected_keys.discard(key)
        card = self._manager.remove_model_entry(key)
        if card is None:
            if was_rejected:
                log.debug("refused model entry deleted key=%s", key)
            else:
                log.error("Missing model entry for %s", key)
            return
        name = card.display_name
        if self._manager.entries_for_model(name):
            self._accept(name)
            log.debug("instance of model left, others remain model=%s key=%s", name, key)
            return
        self._views.pop(name, None)

        # The last instance left: unregister every kind, then report each kind that no
        # model serves any more (a kind another model still serves stays enabled).
        m = self._manager
        per_kind = (
            (ModelType.Chat, m.remove_chat_model, m.list_chat_models),
            (ModelType.Completions, m.remove_completions_model, m.list_completions_models),
            (ModelType.Embedding, m.remove_embeddings_model, m.list_embeddings_models),
            (ModelType.TensorBased, m.remove_tensor_model, m.list_tensor_models),
        )
        emptied: list[ModelType] = []
        for kind, remove, list_names in per_kind:
            try:
                remove(name)
            except ModelNotFound:
                continue  # the model did not serve this kind
            if not list_names():
                emptied.append(kind)
        for client in m.take_model_clients(name):
            await _close_client(client)
        release = getattr(self._factory, "release", None)
        if release is not None:
            await release(name)
        log.info("removed model model=%s", name)
        for kind in emptied:
            await self._send(ModelUpdate.Removed(kind))
        if not emptied:
            log.debug("no model update to send for model=%s", name)

    async def _send(self, update: ModelUpdate) -> None:
        if self._updates is not None:
            await self._updates.put(update)


class AcceptedInstances:
    """A model's endpoint client, as its pipelines see it: ``instance_ids()`` and
    ``instances()`` keep only the instances whose card the watcher ``accepted``.

    Everything else (streaming to an instance, side-handler calls, membership through
    ``announced_ids``, listeners, ``close``) is the client's own. It compares and hashes as
    the client it wraps.
    """

    __slots__ = ("accepted", "client")

    def __init__(self, client: EndpointClient) -> None:
        self.client = client
        #: Instance ids with an accepted card of the model; set by the watcher.
        self.accepted: set[int] = set()

    def instance_ids(self) -> list[int]:
        accepted = self.accepted
        return [i for i in self.client.instance_ids() if i in accepted]

    def instances(self) -> list[Instance]:
        accepted = self.accepted
        return [inst for inst in self.client.instances() if inst.instance_id in accepted]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, AcceptedInstances):
            other = other.client
        return self.client is other

    def __hash__(self) -> int:
        return hash(self.client)


class _Unsupported(Exception):
    """A card asks for an (input, type) pair the watcher cannot build."""


async def _close_client(client: EndpointClient) -> None:
    try:
        await client.close()
    except Exception:
        log.exception("error closing endpoint client")
