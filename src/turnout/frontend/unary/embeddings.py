"""``POST /v1/embeddings``: inputs -> token ids -> an embedding worker -> vectors.

The pipeline of a Tokens + Embedding model (as Dynamo builds it: preprocessor, router,
worker; no KV routing, since an embedding keeps no cache). The frontend tokenizes with the
model's own tokenizer (its card's artifact), refuses what the model cannot read (empty input,
too many tokens, too many inputs) with a 400 naming ``input``, sends all of a request's
inputs to one worker, which batches them with other requests', and writes OpenAI's
response: floats, or their little-endian float32 bytes in base64 (what OpenAI's clients ask
for by default, and decode).

``dimensions``: a model whose card lists lengths its vectors may be cut to (Matryoshka
models) answers with the first ``dimensions`` components, renormalised when its vectors are
unit length; any other value than the model's own length is a 400.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass

import msgspec
import numpy as np

from turnout.errors import RequestError, WorkerProtocolError
from turnout.frontend.http.surface import Surface
from turnout.frontend.models.manager import ModelKind
from turnout.frontend.models.pipeline import WorkerGate
from turnout.frontend.unary.base import apply_nvext, unary_surface
from turnout.llm.preprocessor import OFFLOAD_THRESHOLD_CHARS
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.model import ModelDeploymentCard
from turnout.protocols.openai import (
    Embedding,
    EmbeddingsRequest,
    EmbeddingsResponse,
    EmbeddingsUsage,
)
from turnout.protocols.unary import EmbeddingOutput, EmbeddingRequest, EmbeddingSpec
from turnout.router.push_router import InstanceSource
from turnout.router.unary import UnaryCaller
from turnout.runtime.context import RequestContext

#: Most inputs in one request (OpenAI's limit).
MAX_INPUTS = 2048

_decoder = msgspec.json.Decoder(EmbeddingsRequest)


@dataclass(slots=True)
class EmbeddingsPipeline:
    """One embedding model's pipeline: tokenize, route, reply."""

    name: str
    card: ModelDeploymentCard
    tokenizer: Tokenizer
    caller: UnaryCaller[EmbeddingRequest, EmbeddingOutput]
    client: InstanceSource
    gate: WorkerGate | None = None

    @property
    def spec(self) -> EmbeddingSpec:
        assert self.card.embedding is not None
        return self.card.embedding

    async def token_ids(self, request: EmbeddingsRequest) -> list[list[int]]:
        """Each input as the model's token ids; a 400 naming ``input`` for what cannot run."""
        raw = request.input
        if isinstance(raw, str):
            texts: list[str] | None = [raw]
            sequences: list[list[int]] = []
        elif not raw:
            raise RequestError("'input' must not be an empty list", param="input")
        elif all(isinstance(x, str) for x in raw):
            texts = raw  # type: ignore[assignment]
            sequences = []
        elif all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
            texts, sequences = None, [raw]  # type: ignore[list-item]
        elif all(isinstance(x, list) for x in raw):
            texts, sequences = None, raw  # type: ignore[assignment]
        else:
            raise RequestError(
                "'input' must be a string, a list of strings, a list of token ids or a list "
                "of token-id lists (not a mix)",
                param="input",
            )
        count = len(texts) if texts is not None else len(sequences)
        if count > MAX_INPUTS:
            raise RequestError(
                f"'input' has {count} inputs; at most {MAX_INPUTS} per request", param="input"
            )
        if texts is not None:
            for i, text in enumerate(texts):
                if not text:
                    raise RequestError(f"input {i} is an empty string", param="input")
            encode = self.tokenizer.inner.encode_batch
            if sum(map(len, texts)) > OFFLOAD_THRESHOLD_CHARS:
                encodings = await asyncio.to_thread(encode, texts, add_special_tokens=True)
            else:
                encodings = encode(texts, add_special_tokens=True)
            sequences = [e.ids for e in encodings]
        limit = self.card.context_length
        vocab = self.tokenizer.vocab_size
        for i, seq in enumerate(sequences):
            if not seq:
                raise RequestError(f"input {i} has no tokens", param="input")
            if len(seq) > limit:
                raise RequestError(
                    f"input {i} has {len(seq)} tokens; model {self.name!r} reads at most "
                    f"{limit} per input",
                    param="input",
                )
            if texts is None and (min(seq) < 0 or max(seq) >= vocab):
                raise RequestError(
                    f"input {i} has a token id outside the model's vocabulary (0..{vocab - 1})",
                    param="input",
                )
        return sequences

    def check_dimensions(self, dimensions: int | None) -> None:
        spec = self.spec
        if dimensions is None or dimensions == spec.dimensions:
            return
        if dimensions in spec.truncatable_to:
            return
        allowed = sorted({spec.dimensions, *spec.truncatable_to})
        raise RequestError(
            f"model {self.name!r} returns vectors of {spec.dimensions} dimensions and cannot "
            f"shorten them to {dimensions} (allowed: {', '.join(map(str, allowed))})",
            param="dimensions",
        )

    async def embed(self, request: EmbeddingsRequest, ctx: RequestContext) -> EmbeddingsResponse:
        self.check_dimensions(request.dimensions)
        sequences = await self.token_ids(request)
        if self.gate is not None:
            self.gate.check()
        timeout = apply_nvext(request.nvext, ctx)
        reply = await self.caller.call(EmbeddingRequest(token_ids=sequences), ctx, timeout)
        vectors = _vectors(reply, len(sequences))
        if request.dimensions is not None and request.dimensions < vectors.shape[1]:
            vectors = vectors[:, : request.dimensions]
            if self.spec.normalized:
                norms = np.linalg.norm(vectors, axis=1, keepdims=True)
                vectors = vectors / np.maximum(norms, 1e-12)
        if request.encoding_format == "base64":
            data = [
                Embedding(index=i, embedding=base64.b64encode(row.astype("<f4").tobytes()).decode())
                for i, row in enumerate(vectors)
            ]
        else:
            data = [Embedding(index=i, embedding=row) for i, row in enumerate(vectors.tolist())]
        tokens = reply.prompt_tokens
        return EmbeddingsResponse(
            data=data,
            model=request.model,
            usage=EmbeddingsUsage(prompt_tokens=tokens, total_tokens=tokens),
        )


def _vectors(reply: EmbeddingOutput, count: int) -> np.ndarray:
    """The reply's vectors as float32 ``[count, dimensions]``; a malformed reply is the
    worker's fault (502)."""
    dims = reply.dimensions
    if reply.count != count or dims < 1 or len(reply.embeddings) != count * dims * 4:
        raise WorkerProtocolError(
            f"embedding worker replied {reply.count} vectors of {dims} dimensions in "
            f"{len(reply.embeddings)} bytes to a request of {count} inputs"
        )
    return np.frombuffer(reply.embeddings, dtype="<f4").reshape(count, dims)


def embeddings_surface() -> Surface:
    return unary_surface("embeddings", ModelKind.EMBEDDINGS, _decoder, EmbeddingsPipeline.embed)
