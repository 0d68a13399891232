"""The embeddings pipeline alone: ``dimensions`` on a model whose card lets its vectors be
cut (Matryoshka), with a fake worker."""

from __future__ import annotations

import numpy as np
import pytest

from turnout.engines.embeddings.model import SentenceEmbeddingModel
from turnout.errors import RequestError, WorkerProtocolError
from turnout.frontend.unary.embeddings import EmbeddingsPipeline
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.model import EndpointId, ModelDeploymentCard, ModelInput, ModelType
from turnout.protocols.openai import EmbeddingsRequest
from turnout.protocols.unary import EmbeddingOutput, EmbeddingRequest, EmbeddingSpec
from turnout.runtime.context import RequestContext

VECTOR = np.array([3.0, 4.0, 12.0, 0.0], dtype="<f4")  # |v| = 13, |v[:2]| = 5


class FakeCaller:
    def __init__(self, reply: EmbeddingOutput | None = None) -> None:
        self.reply = reply

    async def call(
        self, request: EmbeddingRequest, ctx: RequestContext, timeout: float | None = None
    ) -> EmbeddingOutput:
        n = len(request.token_ids)
        return self.reply or EmbeddingOutput(
            embeddings=np.tile(VECTOR / 13, n).astype("<f4").tobytes(),
            count=n,
            dimensions=4,
            prompt_tokens=sum(map(len, request.token_ids)),
        )


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    data = SentenceEmbeddingModel(run=False).tokenizer_json
    return Tokenizer.from_bytes(data)


def pipeline(tokenizer: Tokenizer, caller: FakeCaller, **spec: object) -> EmbeddingsPipeline:
    card = ModelDeploymentCard(
        display_name="m",
        endpoint=EndpointId(namespace="a", component="b", name="c"),
        instance_id=1,
        model_type=ModelType.Embedding,
        model_input=ModelInput.Tokens,
        context_length=16,
        embedding=EmbeddingSpec(dimensions=4, **spec),  # type: ignore[arg-type]
    )
    return EmbeddingsPipeline("m", card, tokenizer, caller, client=None)  # type: ignore[arg-type]


async def test_a_matryoshka_model_cuts_and_renormalises(tokenizer: Tokenizer) -> None:
    p = pipeline(tokenizer, FakeCaller(), normalized=True, truncatable_to=[2])
    out = await p.embed(EmbeddingsRequest(model="m", input="hi", dimensions=2), RequestContext("r"))
    assert out.data[0].embedding == pytest.approx([0.6, 0.8])
    full = await p.embed(EmbeddingsRequest(model="m", input="hi"), RequestContext("r"))
    assert full.data[0].embedding == pytest.approx((VECTOR / 13).tolist())
    with pytest.raises(RequestError, match="allowed: 2, 4") as err:
        await p.embed(EmbeddingsRequest(model="m", input="hi", dimensions=3), RequestContext("r"))
    assert err.value.param == "dimensions"


async def test_a_cut_of_unnormalised_vectors_is_left_as_is(tokenizer: Tokenizer) -> None:
    p = pipeline(tokenizer, FakeCaller(), truncatable_to=[2])
    out = await p.embed(EmbeddingsRequest(model="m", input="hi", dimensions=2), RequestContext("r"))
    assert out.data[0].embedding == pytest.approx([3 / 13, 4 / 13])


async def test_a_reply_of_the_wrong_size_is_the_workers_fault(tokenizer: Tokenizer) -> None:
    bad = EmbeddingOutput(embeddings=b"\0" * 12, count=1, dimensions=4, prompt_tokens=1)
    p = pipeline(tokenizer, FakeCaller(bad))
    with pytest.raises(WorkerProtocolError, match="12 bytes"):
        await p.embed(EmbeddingsRequest(model="m", input="hi"), RequestContext("r"))
