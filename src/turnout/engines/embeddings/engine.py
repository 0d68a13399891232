"""The embeddings engine: a sentence-embedding model behind a worker (Tokens + Embedding).

The frontend tokenizes inputs with the tokenizer this engine's card names; the engine checks
the token ids (in the vocabulary, no longer than the model reads), batches them with other
requests' (``batcher``) and replies with float32 vectors.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from turnout.engines.base import UnaryEngine, UnaryFailure
from turnout.errors import ConfigError
from turnout.llm.artifacts import publish_artifact
from turnout.protocols.llm import ErrorKind
from turnout.protocols.model import (
    DEVICE_CPU,
    KIND_HF_TOKENIZER_JSON,
    EndpointId,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
    RuntimeConfig,
)
from turnout.protocols.unary import EmbeddingOutput, EmbeddingRequest, EmbeddingSpec
from turnout.runtime.context import RequestContext

from .batcher import EmbeddingBatcher
from .model import DEFAULT_MODEL_NAME, SentenceEmbeddingModel

_PLACEHOLDER = EndpointId(namespace="placeholder", component="placeholder", name="generate")


class EmbeddingEngine(UnaryEngine[EmbeddingRequest, EmbeddingOutput]):
    """Serve a sentence-transformers model (default: all-MiniLM-L6-v2 from its package)."""

    request_type = EmbeddingRequest
    reply_type = EmbeddingOutput

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        threads: int | None = None,
        max_batch_size: int = 32,
        max_batch_tokens: int = 16384,
        max_waiting: int = 1024,
        context_length: int | None = None,
        model: SentenceEmbeddingModel | None = None,
    ) -> None:
        """``context_length``: read at most this many tokens per input (at most the model's
        own limit; default: the model's). ``model``: one already loaded (shared by engines
        in one process; ``model_path`` and ``threads`` are then unused)."""
        self._path = model_path
        self._context_length = context_length
        self._preloaded = model
        self._threads = threads
        self._limits = (max_batch_size, max_batch_tokens, max_waiting)
        self.model: SentenceEmbeddingModel | None = None
        self.max_tokens = 0
        self.batcher: EmbeddingBatcher | None = None

    async def start(self) -> None:
        # Loading builds the graph (seconds): off the event loop, which serves heartbeats.
        if self._preloaded is not None:
            self.model = self._preloaded
        else:
            self.model = await asyncio.to_thread(
                SentenceEmbeddingModel, self._path, threads=self._threads
            )
        limit = self._context_length
        if limit is not None and not 0 < limit <= self.model.max_tokens:
            raise ConfigError(
                f"--context-length {limit}: this model reads 1 to {self.model.max_tokens} "
                "tokens per input"
            )
        #: Longest input this engine reads, in tokens.
        self.max_tokens = limit or self.model.max_tokens
        size, tokens, waiting = self._limits
        self.batcher = EmbeddingBatcher(
            self.model.embed, max_batch_size=size, max_batch_tokens=tokens, max_waiting=waiting
        )
        self.batcher.start()

    async def stop(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()

    def health(self) -> str | None:
        if self.failure is not None:
            return self.failure
        return self.batcher.failure if self.batcher is not None else None

    def model_card_template(self) -> ModelDeploymentCard:
        model = self.model
        assert model is not None, "start() first"
        tokenizer = publish_artifact("tokenizer.json", KIND_HF_TOKENIZER_JSON, model.tokenizer_json)
        name = model.name if self._path is not None else DEFAULT_MODEL_NAME
        return ModelDeploymentCard(
            display_name=name,
            endpoint=_PLACEHOLDER,
            instance_id=0,
            model_type=ModelType.Embedding,
            model_input=ModelInput.Tokens,
            tokenizer=tokenizer,
            context_length=self.max_tokens,
            runtime_config=RuntimeConfig(
                max_num_seqs=self._limits[0],
                max_num_batched_tokens=self._limits[1],
                device_type=DEVICE_CPU,
            ),
            embedding=EmbeddingSpec(dimensions=model.dimensions, normalized=model.normalized),
        )

    async def run(self, request: EmbeddingRequest, ctx: RequestContext) -> EmbeddingOutput:
        model, batcher = self.model, self.batcher
        assert model is not None and batcher is not None, "start() first"
        sequences = request.token_ids
        if not sequences:
            raise UnaryFailure("no input to embed", ErrorKind.BAD_REQUEST)
        vocab = model.vocab_size
        for i, seq in enumerate(sequences):
            if not seq:
                raise UnaryFailure(f"input {i} is empty", ErrorKind.BAD_REQUEST)
            if len(seq) > self.max_tokens:
                raise UnaryFailure(
                    f"input {i} has {len(seq)} tokens; this model reads at most {self.max_tokens}",
                    ErrorKind.BAD_REQUEST,
                )
            if vocab and (min(seq) < 0 or max(seq) >= vocab):
                raise UnaryFailure(
                    f"input {i} has a token id outside the vocabulary (0..{vocab - 1})",
                    ErrorKind.BAD_REQUEST,
                )
        vectors = await batcher.embed(sequences)
        return EmbeddingOutput(
            embeddings=vectors.astype("<f4", copy=False).tobytes(),
            count=len(sequences),
            dimensions=model.dimensions,
            prompt_tokens=sum(len(s) for s in sequences),
        )
