"""Serving LoRA adapters by name (``--enable-lora``): ``"model": "<adapter>"`` runs on the base
model's pipeline with ``lora_name`` set, so the router sends it only to instances that hold the
adapter (or, when none does, to the one that will load it: see ``router.lora``).

An adapter is servable as soon as some live instance *can* load it (its base card lists it);
``/v1/models`` lists it, vLLM's way (``root`` = the adapter, ``parent`` = the base model), once
some instance has it loaded, as Dynamo lists an adapter from its card.
"""

from __future__ import annotations

from collections.abc import Callable

from turnout.frontend.models.pipeline import Generation, TokensPipeline
from turnout.protocols.llm import PreprocessedRequest
from turnout.protocols.openai import ChatCompletionRequest, CompletionRequest
from turnout.router.lora import LoraRegistry
from turnout.runtime.context import RequestContext

__all__ = ["LoraModels", "LoraPipeline"]


class LoraPipeline:
    """A base model's tokens pipeline seen as one adapter's: same preprocessing (tokenizer,
    template, limits), with the adapter named on every request. Cheap: built per lookup, so
    it always wraps the base model's current pipeline (cards switch, models come back)."""

    __slots__ = ("adapter", "base")

    def __init__(self, base: TokensPipeline, adapter: str) -> None:
        self.base = base
        self.adapter = adapter

    @property
    def name(self) -> str:
        return self.adapter

    @property
    def client(self) -> object:
        return self.base.client

    @property
    def card(self) -> object:
        return self.base.card

    @property
    def is_chat(self) -> bool:
        return self.base.is_chat

    async def preprocess(
        self, request: ChatCompletionRequest | CompletionRequest, ctx: RequestContext | None
    ) -> PreprocessedRequest:
        pre = await self.base.preprocess(request, ctx)
        pre.lora_name = self.adapter
        return pre

    def generate(self, request: PreprocessedRequest, ctx: RequestContext) -> Generation:
        return self.base.generate(request, ctx)


class LoraModels:
    """The model manager's resolver of adapter names (``ModelManager.lora``)."""

    __slots__ = ("registry",)

    def __init__(self, registry: LoraRegistry) -> None:
        self.registry = registry

    def resolve(self, name: str, lookup: Callable[[str], object]) -> LoraPipeline | None:
        """The pipeline serving adapter ``name`` (``lookup``: the registry of the request's
        kind, by base model name), or None when no instance can load it or its base model
        has no tokens pipeline of that kind."""
        base = self.registry.base_model(name)
        if base is None:
            return None
        try:
            engine = lookup(base)
        except KeyError:
            return None
        if not isinstance(engine, TokensPipeline):
            return None  # text-input models take no adapter name on the request
        return LoraPipeline(engine, name)

    def listed(self) -> list[tuple[str, str]]:
        """``(adapter, base model)`` for ``/v1/models``: the adapters loaded somewhere."""
        return self.registry.loaded_adapters()
