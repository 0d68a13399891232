"""``/v1/embeddings`` end to end: the official openai client, a frontend, workers running the
real all-MiniLM-L6-v2 (ONNX Runtime), compared with what sentence-transformers answers
(``tests/data/minilm_reference.json``, written by ``scripts/embedding_reference.py``)."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from tests.frontend.stack import Stack, make_stack
from tokenizers import Tokenizer

from turnout.engines.base import UnaryFailure
from turnout.engines.embeddings import EmbeddingEngine
from turnout.engines.embeddings.model import DEFAULT_MODEL_NAME, SentenceEmbeddingModel
from turnout.protocols.llm import ErrorKind
from turnout.protocols.unary import EmbeddingOutput
from turnout.router.mode import RouterMode

pytestmark = pytest.mark.slow

REFERENCE = json.loads((Path(__file__).parents[1] / "data" / "minilm_reference.json").read_text())
MODEL = DEFAULT_MODEL_NAME


@pytest.fixture(scope="module")
def minilm() -> SentenceEmbeddingModel:
    """Loaded once for the module (building the graph takes a couple of seconds)."""
    return SentenceEmbeddingModel(threads=2)


@pytest.fixture
async def stack(minilm: SentenceEmbeddingModel) -> AsyncIterator[Stack]:
    s = await make_stack()
    await s.add_worker(EmbeddingEngine(model=minilm), model_name=MODEL)
    await s.wait_for_model(MODEL)
    yield s
    await s.close()


@pytest.fixture
def tokenizer(minilm: SentenceEmbeddingModel) -> Tokenizer:
    return Tokenizer.from_str(minilm.tokenizer_json.decode())


def api(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


#: The client's default asks for base64 and decodes it; "float" asks for floats.
@pytest.mark.parametrize("encoding_format", [openai.NOT_GIVEN, "float"])
async def test_vectors_match_the_reference(stack: Stack, encoding_format: object) -> None:
    client = api(stack)
    out = await client.embeddings.create(
        model=MODEL,
        input=REFERENCE["sentences"],
        encoding_format=encoding_format,  # type: ignore[arg-type]
    )
    await client.close()
    got = np.array([d.embedding for d in out.data])
    assert [d.index for d in out.data] == list(range(len(REFERENCE["sentences"])))
    assert got.shape == (len(REFERENCE["sentences"]), 384)
    assert cosines(got, np.array(REFERENCE["embeddings"])).min() >= 0.999
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # Normalize module
    tokens = sum(REFERENCE["prompt_tokens"])
    assert out.usage.prompt_tokens == out.usage.total_tokens == tokens
    assert out.model == MODEL


async def test_every_input_form_gives_the_same_vector(stack: Stack, tokenizer: Tokenizer) -> None:
    text = REFERENCE["sentences"][1]
    ids = tokenizer.encode(text).ids
    client = api(stack)
    forms = [text, [text, "other"], ids, [ids, ids]]
    results = [await client.embeddings.create(model=MODEL, input=f) for f in forms]  # type: ignore[arg-type]
    await client.close()
    first = np.array(results[0].data[0].embedding)
    for out in results:
        assert np.allclose(np.array(out.data[0].embedding), first, atol=1e-5)
    assert [len(r.data) for r in results] == [1, 2, 1, 2]
    assert results[2].usage.prompt_tokens == len(ids)
    assert results[3].usage.prompt_tokens == 2 * len(ids)


async def test_base64_is_little_endian_float32(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        floats = (await http.post("/v1/embeddings", json={"model": MODEL, "input": "hello"})).json()
        b64 = (
            await http.post(
                "/v1/embeddings",
                json={"model": MODEL, "input": "hello", "encoding_format": "base64"},
            )
        ).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, np.array(floats["data"][0]["embedding"]), atol=1e-6)
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"


async def test_concurrent_requests_are_batched_and_each_gets_its_own(stack: Stack) -> None:
    client = api(stack)
    sentences = REFERENCE["sentences"]
    outs = await asyncio.gather(
        *(client.embeddings.create(model=MODEL, input=s) for s in sentences * 2)
    )
    await client.close()
    got = np.array([o.data[0].embedding for o in outs])
    expected = np.array(REFERENCE["embeddings"] * 2)
    assert cosines(got, expected).min() >= 0.999
    engine = stack.workers[0].engine
    assert isinstance(engine, EmbeddingEngine) and engine.batcher is not None
    assert engine.batcher.stats.sequences == 2 * len(sentences)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ""}, "input", "empty string"),
        ({"input": []}, "input", "empty list"),
        ({"input": ["ok", ""]}, "input", "input 1 is an empty string"),
        ({"input": [[]]}, "input", "no tokens"),
        ({"input": ["a", 1]}, "input", "not a mix"),
        ({"input": [101, 99999999]}, "input", "vocabulary"),
        ({"input": "word " * 300}, "input", "at most 256"),
        ({"input": ["x"] * 2049}, "input", "at most 2048"),
        ({"input": "hi", "dimensions": 100}, "dimensions", "cannot shorten"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": "hi", "truncate": True}, "truncate", "unrecognized"),
        ({"input": "hi", "nvext": {"ignore_eos": True}}, "nvext.ignore_eos", "unrecognized"),
    ],
)
async def test_bad_requests_are_400s_naming_the_field(
    stack: Stack, body: dict[str, object], param: str, words: str
) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        r = await http.post("/v1/embeddings", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert words in error["message"]


async def test_own_dimensions_are_accepted(stack: Stack) -> None:
    client = api(stack)
    out = await client.embeddings.create(model=MODEL, input="hi", dimensions=384)
    await client.close()
    assert len(out.data[0].embedding) == 384


async def test_models_list_says_which_routes_serve_it(stack: Stack) -> None:
    client = api(stack)
    models = await client.models.list()
    await client.close()
    (model,) = models.data
    assert model.id == MODEL
    assert model.model_extra == {"root": MODEL, "parent": None, "endpoints": ["/v1/embeddings"]}


async def test_an_embedding_model_serves_no_chat_and_a_chat_model_no_embeddings(
    stack: Stack,
) -> None:
    client = api(stack)
    with pytest.raises(openai.NotFoundError, match="does not serve chat completions"):
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await client.embeddings.create(model="nope", input="hi")
    await client.close()


class BrokenKernel(EmbeddingEngine):
    """An engine whose every batch fails as a broken engine would (``engine_failed``)."""

    attempts = 0

    async def run(self, request: object, ctx: object) -> EmbeddingOutput:  # type: ignore[override]
        BrokenKernel.attempts += 1
        raise UnaryFailure("kernel crashed", ErrorKind.ENGINE_FAILED)


async def test_a_failing_worker_costs_no_request(minilm: SentenceEmbeddingModel) -> None:
    s = await make_stack(router_mode=RouterMode.ROUND_ROBIN)
    try:
        await s.add_worker(BrokenKernel(model=minilm), model_name=MODEL)
        await s.add_worker(EmbeddingEngine(model=minilm), model_name=MODEL)
        await s.wait_for_model(MODEL, instances=2)
        client = api(s)
        outs = [await client.embeddings.create(model=MODEL, input=t) for t in ["a", "b", "c"]]
        await client.close()
        assert all(len(o.data[0].embedding) == 384 for o in outs)
        assert BrokenKernel.attempts >= 1  # it was tried, then set aside
    finally:
        await s.close()


async def test_a_client_that_leaves_takes_its_work_off_the_queue(stack: Stack) -> None:
    engine = stack.workers[0].engine
    assert isinstance(engine, EmbeddingEngine) and engine.batcher is not None
    batcher = engine.batcher
    started, gate = threading.Event(), threading.Event()
    run = batcher._run

    def slow(sequences: list[list[int]]) -> np.ndarray:
        started.set()
        gate.wait(10)
        return run(sequences)

    batcher._run = slow
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        first = asyncio.ensure_future(
            http.post("/v1/embeddings", json={"model": MODEL, "input": "first"})
        )
        await until(started.is_set)  # the first request's batch runs (and blocks)
        leaving = asyncio.ensure_future(
            http.post("/v1/embeddings", json={"model": MODEL, "input": "leaves"})
        )
        await until(lambda: len(batcher._queue) == 1)
        leaving.cancel()
        await until(lambda: not batcher._queue)  # the worker dropped it
        gate.set()
        assert (await first).status_code == 200
    assert batcher.stats.sequences == 1


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
