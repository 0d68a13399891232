"""Which models the frontend serves, by which engines, and which worker instances back them.

The manager is a passive data structure; the ``ModelWatcher`` is the policy that fills it from
discovery events, and the HTTP service reads it on every request. It holds three things:

* **Engines**, one registry per kind of request (chat, completions, embeddings, tensor):
  served name -> engine. An engine is whatever the pipeline factory built (opaque here); a
  model that serves both chat and completions has one engine in each registry.
* **Model entries**, one per published card: discovery key -> ``ModelDeploymentCard``
  (``v1/mdc/{ns}/{component}/{endpoint}/{instance_id:x}[/{lora}]``). A model stays served
  while it has at least one entry; LoRA keys are entries of the same model name.
* **Endpoint clients**, per model: what the model's registered pipelines route through (the
  served card's routing view, ``models.accepted_instances``), so ``/health`` can say which
  instances are up (``model_instances``).

Everything runs on one event loop; no method awaits, so every method is atomic with respect
to the others and no lock is needed.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from turnout.errors import ModelNotFound, TurnoutError
from turnout.protocols.model import ModelDeploymentCard

if TYPE_CHECKING:
    from turnout.frontend.models.accepted_instances import ModelClient
    from turnout.frontend.models.lora import LoraModels

__all__ = ["ModelAlreadyExists", "ModelKind", "ModelManager"]

log = logging.getLogger(__name__)


class ModelAlreadyExists(TurnoutError):
    """A model name was registered twice for the same kind of request (a bug in the caller)."""


class ModelKind(enum.StrEnum):
    """A kind of request, with its registry of engines (what an HTTP route resolves in)."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    TENSOR = "tensor"


#: The route that serves each kind (``/v1/models`` lists them per model).
KIND_ROUTES = {
    ModelKind.CHAT: "/v1/chat/completions",
    ModelKind.COMPLETIONS: "/v1/completions",
    ModelKind.EMBEDDINGS: "/v1/embeddings",
    ModelKind.TENSOR: "/v1/tensor",
}


class _EngineRegistry:
    """Served name -> engine for one kind of request; ``kind`` appears in error messages."""

    __slots__ = ("_added", "_clock", "_engines", "kind")

    def __init__(self, kind: str, clock: Callable[[], float] = time.time) -> None:
        self.kind = kind
        self._clock = clock
        self._engines: dict[str, object] = {}
        #: Unix seconds at which each name was registered (``/v1/models``' ``created``).
        self._added: dict[str, int] = {}

    def add(self, name: str, engine: object) -> None:
        if name in self._engines:
            raise ModelAlreadyExists(f"model {name!r} is already registered for {self.kind}")
        self._engines[name] = engine
        self._added[name] = int(self._clock())

    def remove(self, name: str) -> None:
        if self._engines.pop(name, None) is None:
            raise ModelNotFound(f"model {name!r} is not registered for {self.kind}")
        del self._added[name]

    def added_at(self, name: str) -> int | None:
        return self._added.get(name)

    def get(self, name: str) -> object:
        """The engine of ``name``; ``KeyError`` if absent."""
        return self._engines[name]

    def names(self) -> list[str]:
        return sorted(self._engines)

    def __contains__(self, name: object) -> bool:
        return name in self._engines


class ModelManager:
    """Registry of served models: engines per request kind, per-instance cards, clients."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._chat = _EngineRegistry("chat completions", clock)
        self._completions = _EngineRegistry("completions", clock)
        self._embeddings = _EngineRegistry("embeddings", clock)
        self._tensor = _EngineRegistry("tensor requests", clock)
        self._registries = (self._chat, self._completions, self._embeddings, self._tensor)
        self._by_kind = dict(zip(ModelKind, self._registries, strict=True))
        # key -> card, and model name -> {key -> card}. Both change only in
        # save_model_entry / remove_model_entry, so they always agree.
        self._entries: dict[str, ModelDeploymentCard] = {}
        self._entries_by_model: dict[str, dict[str, ModelDeploymentCard]] = {}
        self._clients: dict[str, list[ModelClient]] = {}
        #: ``--enable-lora``: resolves an adapter's name to its base model's pipeline
        #: (``frontend.models.lora.LoraModels``) when no model of that name is registered.
        self.lora: LoraModels | None = None

    # -- engines ------------------------------------------------------------------------------

    def add_engine(self, kind: ModelKind, name: str, engine: object) -> None:
        """Serve ``name`` for ``kind`` requests; ``ModelAlreadyExists`` if it already is."""
        self._by_kind[kind].add(name, engine)

    def remove_engine(self, kind: ModelKind, name: str) -> None:
        """Stop serving ``name`` for ``kind``; ``ModelNotFound`` if it was not."""
        self._by_kind[kind].remove(name)

    def list_models_of(self, kind: ModelKind) -> list[str]:
        """Names served for ``kind`` requests, sorted."""
        return self._by_kind[kind].names()

    def get_engine(self, kind: ModelKind, name: str) -> object:
        """The engine serving ``kind`` requests for ``name``; ``ModelNotFound`` (404) if none."""
        return self._get(self._by_kind[kind], name)

    def kinds(self, name: str) -> list[ModelKind]:
        """The kinds of request ``name`` is served for (what ``/v1/models`` reports)."""
        return [kind for kind, registry in self._by_kind.items() if name in registry]

    def _get(self, registry: _EngineRegistry, name: str) -> object:
        if name in registry:
            return registry.get(name)
        if self.lora is not None:
            adapter = self.lora.resolve(name, registry.get)
            if adapter is not None:
                return adapter
        others = [r.kind for r in self._registries if name in r]
        if others:
            raise ModelNotFound(
                f"model {name!r} does not serve {registry.kind}; it serves {', '.join(others)}"
            )
        raise ModelNotFound(f"model {name!r} does not exist")

    def has_model_any(self, name: str) -> bool:
        """True when ``name`` is served for any kind of request."""
        return any(name in r for r in self._registries)

    def list_models(self) -> list[str]:
        """Every served name, whatever the kind of request; sorted, no duplicates."""
        return sorted({n for r in self._registries for n in r.names()})

    def created(self, name: str) -> int:
        """Unix seconds since ``name`` has been served without a break (the earliest of its
        request kinds); 0 when it is not served."""
        times = [t for r in self._registries if (t := r.added_at(name)) is not None]
        return min(times, default=0)

    # -- per-instance entries -------------------------------------------------------------------

    def save_model_entry(self, key: str, card: ModelDeploymentCard) -> None:
        """Record the card published under ``key`` (replacing an older one under that key)."""
        old = self._entries.get(key)
        if old is not None and old.display_name != card.display_name:
            self._drop_from_model(key, old.display_name)
        self._entries[key] = card
        self._entries_by_model.setdefault(card.display_name, {})[key] = card

    def remove_model_entry(self, key: str) -> ModelDeploymentCard | None:
        """Forget the card under ``key``; returns it, or None if there was none."""
        card = self._entries.pop(key, None)
        if card is not None:
            self._drop_from_model(key, card.display_name)
        return card

    def _drop_from_model(self, key: str, name: str) -> None:
        by_key = self._entries_by_model.get(name)
        if by_key is None:
            return
        by_key.pop(key, None)
        if not by_key:
            del self._entries_by_model[name]

    def entries_for_model(self, name: str) -> list[ModelDeploymentCard]:
        """The cards of every live instance (and LoRA entry) of ``name``, oldest first."""
        return list(self._entries_by_model.get(name, {}).values())

    def device_types(self, name: str) -> dict[int, str]:
        """Instance id -> the device its card announces (``runtime_config.device_type``) for
        every instance of ``name``; read by ``device-aware-weighted`` routing."""
        return {
            card.instance_id: card.runtime_config.device_type
            for card in self._entries_by_model.get(name, {}).values()
            if card.lora is None
        }

    def model_cards(self, name: str) -> Mapping[str, ModelDeploymentCard]:
        """Discovery key -> card for every entry of ``name`` (a copy; for ``/health``)."""
        return dict(self._entries_by_model.get(name, {}))

    # -- endpoint clients -----------------------------------------------------------------------

    def add_model_client(self, name: str, client: ModelClient) -> None:
        """Remember a client that ``name``'s pipelines route through."""
        self._clients.setdefault(name, []).append(client)

    def take_model_clients(self, name: str) -> list[ModelClient]:
        """Remove and return ``name``'s clients; the caller closes them."""
        return self._clients.pop(name, [])

    def take_all_clients(self) -> list[ModelClient]:
        """Remove and return every model's clients (shutdown); the caller closes them."""
        clients = [c for cs in self._clients.values() for c in cs]
        self._clients.clear()
        return clients

    async def close(self) -> None:
        """Close every model's endpoint clients (frontend shutdown); registries are kept."""
        for client in self.take_all_clients():
            try:
                await client.close()
            except Exception:
                log.exception("error closing endpoint client of %s", client.endpoint.path())

    def model_instances(self, name: str) -> list[int]:
        """Sorted ids of the live instances ``name``'s clients can route to (empty if none)."""
        return sorted({i for c in self._clients.get(name, ()) for i in c.instance_ids()})
