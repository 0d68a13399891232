"""Which pipelines a model card gets: Dynamo's (input, type) table, and the factory contract.

A card says what its worker takes (``ModelInput``: tokens, text, tensors) and what it serves
(``ModelType`` flags). Each supported pair is built by one ``PipelineFactory`` method and
registered for one kind of request (``ModelKind``); a card with several types gets each. A
card with a type its input cannot serve is refused whole, with Dynamo's message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from turnout.frontend.models.manager import ModelKind
from turnout.protocols.model import ModelDeploymentCard, ModelInput, ModelType

if TYPE_CHECKING:
    from turnout.runtime.component import EndpointClient

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

#: What each served (input, type) pair is built with, and which requests it serves. A card
#: whose every type pairs with its input is served on each; one type that does not makes
#: the whole card unsupported (never half-served).
PAIRS: dict[tuple[ModelInput, ModelType], tuple[str, ModelKind]] = {
    (ModelInput.Tokens, ModelType.Chat): ("build_chat", ModelKind.CHAT),
    (ModelInput.Tokens, ModelType.Completions): ("build_completions", ModelKind.COMPLETIONS),
    (ModelInput.Tokens, ModelType.Embedding): ("build_embeddings", ModelKind.EMBEDDINGS),
    (ModelInput.Text, ModelType.Chat): ("build_text_chat", ModelKind.CHAT),
    (ModelInput.Text, ModelType.Completions): ("build_text_completions", ModelKind.COMPLETIONS),
    (ModelInput.Tensor, ModelType.TensorBased): ("build_tensor", ModelKind.TENSOR),
}
#: The request kind of each model type (to say which kinds a model no longer serves).
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


def pipelines_for(card: ModelDeploymentCard) -> list[tuple[str, ModelKind]]:
    """The factory methods and request kinds of ``card``; ``UnsupportedModel`` if any type
    of the card does not pair with its input (Dynamo's message, naming which)."""
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


class PipelineFactory(Protocol):
    """Builds the engine the HTTP service calls for one model and one kind of request.

    Each method gets the model's card and the endpoint client to route through (one client
    per model, shared by its chat and completions pipelines) and returns the engine to
    register. Raising refuses the model: the watcher logs the error and serves nothing of it
    (``InvalidCard``: once per model and message, naming the field).

    Optional attribute read by the watcher: ``max_artifact_bytes`` (int), the largest artifact
    a card may name (default ``protocols.card_bounds.DEFAULT_MAX_ARTIFACT_BYTES``).
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

    async def build_embeddings(self, card: ModelDeploymentCard, client: EndpointClient) -> object:
        """Tokens + Embedding: tokenizer -> router -> worker (one reply per request)."""
        ...

    async def build_tensor(self, card: ModelDeploymentCard, client: EndpointClient) -> object:
        """Tensor + TensorBased: checked against the card's tensors -> router -> worker."""
        ...

    async def release(self, name: str) -> None:
        """The model's last instance left: free what its pipelines hold (e.g. a KV router)."""
        ...
