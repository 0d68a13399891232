"""Which pipelines a model card gets: Dynamo's (input, type) table, and the factory contract.

A card says what its worker takes (``ModelInput``: tokens, text, tensors) and what it serves
(``ModelType`` flags). Each supported pair is built by one ``PipelineFactory`` method and
registered for one kind of request (``ModelKind``); a card with several types gets each. A
card with a type its input cannot serve is refused whole, with Dynamo's message.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from turnout.frontend.models.accepted_instances import ModelClient
from turnout.frontend.models.manager import ModelKind
from turnout.protocols.model import ModelDeploymentCard, ModelInput, ModelType

if TYPE_CHECKING:
    from turnout.frontend.metrics.frontend import FrontendMetrics
    from turnout.router.prefill_slots import PrefillPool, PrefillSlots

__all__ = [
    "PAIRS",
    "SUPPORTED_PAIRS",
    "TYPE_KINDS",
    "InvalidCard",
    "PipelineFactory",
    "UnsupportedModel",
    "pipelines_for",
]

#: The (ModelInput, ModelType) pairs the watcher can build, as error messages name them
#: (Dynamo's words).
SUPPORTED_PAIRS = (
    "Tokens+(Chat|Completions), Text+Chat, Text+Completions, Tokens+Embeddings, Tensor+TensorBased"
)


class PipelineFactory(Protocol):
    """Builds the engine the HTTP service calls for one model and one kind of request.

    Each ``build_*`` method gets the card and the routing view of that card's instances (one
    per card, shared by its chat and completions pipelines) and returns the engine to
    register. Raising refuses the card: the watcher logs the error and serves nothing of it
    (``InvalidCard``: once per model and message, naming the field).
    """

    @property
    def max_artifact_bytes(self) -> int:
        """The largest artifact a card may name (larger ones are refused unread)."""
        ...

    @property
    def metrics(self) -> FrontendMetrics | None:
        """Where the watcher counts card switches; None: not counted."""
        ...

    @property
    def prefill_slots(self) -> PrefillSlots | None:
        """Each model's prefill side (disaggregated serving); None: prefill cards are not
        taken."""
        ...

    async def build_chat(self, card: ModelDeploymentCard, client: ModelClient) -> object:
        """Tokens + Chat: preprocessor -> migration -> backend -> router -> worker."""
        ...

    async def build_completions(self, card: ModelDeploymentCard, client: ModelClient) -> object:
        """Tokens + Completions: the same pipeline, without a chat template."""
        ...

    async def build_text_chat(self, card: ModelDeploymentCard, client: ModelClient) -> object:
        """Text + Chat: the worker does its own pre/post-processing; router only."""
        ...

    async def build_text_completions(
        self, card: ModelDeploymentCard, client: ModelClient
    ) -> object:
        """Text + Completions: router only."""
        ...

    async def build_embeddings(self, card: ModelDeploymentCard, client: ModelClient) -> object:
        """Tokens + Embedding: tokenizer -> router -> worker (one reply per request)."""
        ...

    async def build_tensor(self, card: ModelDeploymentCard, client: ModelClient) -> object:
        """Tensor + TensorBased: checked against the card's tensors -> router -> worker."""
        ...

    async def build_prefill_pool(
        self, card: ModelDeploymentCard, client: ModelClient
    ) -> PrefillPool:
        """The router among a model's prefill workers (a prefill card, its view)."""
        ...

    def serving(self, card: ModelDeploymentCard, client: ModelClient) -> None:
        """The pipelines of ``card`` built over ``client`` are the ones registered for its
        model now: what is read per model name (its KV router, its session table) is
        theirs."""
        ...

    async def release(self, card: ModelDeploymentCard, client: ModelClient) -> None:
        """No pipeline of ``card`` over ``client`` is kept any more: free what they held (a
        KV router, load and session tables). Nothing held is nothing to do."""
        ...


#: Builds one pipeline of a card with the factory, routed through the card's view.
Build = Callable[[PipelineFactory, ModelDeploymentCard, ModelClient], Awaitable[object]]

#: What each served (input, type) pair is built with, and which requests it serves. A card
#: whose every type pairs with its input is served on each; one type that does not makes
#: the whole card unsupported (never half-served).
PAIRS: dict[tuple[ModelInput, ModelType], tuple[Build, ModelKind]] = {
    (ModelInput.Tokens, ModelType.Chat): (
        lambda f, card, client: f.build_chat(card, client),
        ModelKind.CHAT,
    ),
    (ModelInput.Tokens, ModelType.Completions): (
        lambda f, card, client: f.build_completions(card, client),
        ModelKind.COMPLETIONS,
    ),
    (ModelInput.Tokens, ModelType.Embedding): (
        lambda f, card, client: f.build_embeddings(card, client),
        ModelKind.EMBEDDINGS,
    ),
    (ModelInput.Text, ModelType.Chat): (
        lambda f, card, client: f.build_text_chat(card, client),
        ModelKind.CHAT,
    ),
    (ModelInput.Text, ModelType.Completions): (
        lambda f, card, client: f.build_text_completions(card, client),
        ModelKind.COMPLETIONS,
    ),
    (ModelInput.Tensor, ModelType.TensorBased): (
        lambda f, card, client: f.build_tensor(card, client),
        ModelKind.TENSOR,
    ),
}
#: The request kind of each model type (to say which kinds are left without a model).
TYPE_KINDS = {
    ModelType.Chat: ModelKind.CHAT,
    ModelType.Completions: ModelKind.COMPLETIONS,
    ModelType.Embedding: ModelKind.EMBEDDINGS,
    ModelType.TensorBased: ModelKind.TENSOR,
}


class UnsupportedModel(Exception):
    """A card asks for an (input, type) pair no pipeline serves. The watcher logs a refusal
    of this kind once per (model, message), as an error without a traceback: the message
    says everything, and every instance of the model would repeat it."""


class InvalidCard(UnsupportedModel):
    """A card whose content is refused: a number out of range (``protocols.card_bounds``),
    a chat template that does not compile or that runs past its budget on a probe
    conversation. ``field`` names the card's field at fault."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def pipelines_for(card: ModelDeploymentCard) -> list[tuple[Build, ModelKind]]:
    """How to build each pipeline of ``card``, and its request kind; ``UnsupportedModel`` if
    any type of the card does not pair with its input (Dynamo's message, naming which)."""
    mt, mi = card.model_type, card.model_input
    types = [t for t in ModelType if t in mt]
    missing = [t for t in types if (mi, t) not in PAIRS]
    if not types or missing:
        which = "|".join(t.name or "" for t in missing) or "no type"
        raise UnsupportedModel(
            f"Unsupported model configuration: {mt.names()} with {mi.value} input "
            f"({which} cannot be served with {mi.value} input). Supported combinations: "
            f"{SUPPORTED_PAIRS}"
        )
    return [PAIRS[(mi, t)] for t in types]
