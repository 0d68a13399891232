"""The attach engine against scripted servers: each API's stream becomes turnout outputs, and
every way a server can fail ends the stream with the right kind (what the frontend does
with it: 400, migrate, 503)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from tests.engines.attach.fake_server import FakeServer, Reply

from turnout.engines.attach.api_base import TokensApi
from turnout.engines.attach.llamacpp_api import LlamaCppApi
from turnout.engines.attach.sglang_api import SglangApi
from turnout.engines.attach.tokens_engine import AttachedEngine
from turnout.engines.attach.upstream import Deadlines
from turnout.engines.attach.vllm_api import VllmApi
from turnout.engines.attach.vocab import VocabBytes
from turnout.protocols.llm import (
    FinishReason,
    LLMEngineOutput,
    OutputOptions,
    PreprocessedRequest,
    StopConditions,
)
from turnout.protocols.model import EndpointId, ModelDeploymentCard, ModelInput, ModelType
from turnout.runtime.context import RequestContext

CARD = ModelDeploymentCard(
    display_name="m",
    endpoint=EndpointId(namespace="t", component="c", name="generate"),
    instance_id=0,
    model_type=ModelType.Chat | ModelType.Completions,
    model_input=ModelInput.Tokens,
    context_length=100,
)
FAST = Deadlines(connect=1.0, first_byte=2.0, idle=0.4, probe=1.0)


@pytest.fixture
async def server() -> AsyncIterator[FakeServer]:
    fake = await FakeServer().start()
    yield fake
    await fake.stop()


async def run(
    api: TokensApi, server: FakeServer, request: PreprocessedRequest, **kw: object
) -> list[LLMEngineOutput]:
    engine = AttachedEngine(url=server.url, api=api, card=CARD, served_name="served",
                            deadlines=FAST, health_interval=60, load_interval=60, **kw)  # type: ignore[arg-type]  # fmt: skip
    await engine.start()
    try:
        return [out async for out in engine.generate(request, RequestContext("r1"))]
    finally:
        await engine.stop()


def req(**kw: object) -> PreprocessedRequest:
    return PreprocessedRequest(model="m", token_ids=[1, 2, 3], **kw)  # type: ignore[arg-type]


def ids(outputs: list[LLMEngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


# ------------------------------------------------------------------ llama.cpp


def lc_event(tok: int, n: int, content: str = "x", **kw: object) -> dict[str, object]:
    return {"content": content, "tokens": [tok], "stop": False, "tokens_predicted": n, **kw}


LC_FINAL = {"content": "", "tokens": [], "stop": True, "stop_type": "limit",
            "tokens_predicted": 3, "tokens_evaluated": 3, "timings": {"cache_n": 2}}  # fmt: skip


async def test_llamacpp_stream_becomes_token_outputs(server: FakeServer) -> None:
    events = [lc_event(7, 1), lc_event(8, 2), lc_event(9, 3), LC_FINAL]
    server.route("POST", "/completion", Reply(events=events))
    outputs = await run(LlamaCppApi(server.url), server, req(
        stop_conditions=StopConditions(max_tokens=3), eos_token_ids=[0]))  # fmt: skip
    assert ids(outputs) == [7, 8, 9]
    final = outputs[-1]
    assert final.finish_reason is FinishReason.LENGTH
    assert final.usage is not None and final.usage.completion_tokens == 3
    assert final.usage.cached_tokens == 2
    body = server.body("/completion")
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 3
    assert body["stream"] is True and body["return_tokens"] is True


async def test_llamacpp_held_back_tokens_are_rebuilt_from_their_bytes(server: FakeServer) -> None:
    # "日" is three bytes: token 5 is its first, token 6 the other two. llama.cpp sends no
    # event for 5 and names only 6 in the event that completes the character.
    vocab = VocabBytes([(b"\xe6", 5), (b"\x97\xa5", 6), (b"a", 1)])
    events = [lc_event(1, 1, "a"), lc_event(6, 3, "日"), {**LC_FINAL, "stop_type": "eos"}]
    server.route("POST", "/completion", Reply(events=events))
    outputs = await run(LlamaCppApi(server.url, vocab), server, req())
    assert ids(outputs) == [1, 5, 6]
    assert outputs[-1].finish_reason is FinishReason.EOS


async def test_llamacpp_logprobs_and_alternatives(server: FakeServer) -> None:
    alternatives = [{"id": 9, "logprob": -2.0}, {"id": 7, "logprob": -0.5}]
    probs = [{"id": 7, "logprob": -0.5, "top_logprobs": alternatives}]
    events = [lc_event(7, 1, completion_probabilities=probs), {**LC_FINAL, "tokens_predicted": 1}]
    server.route("POST", "/completion", Reply(events=events))
    outputs = await run(LlamaCppApi(server.url), server, req(
        output_options=OutputOptions(logprobs=1)))  # fmt: skip
    assert outputs[0].log_probs == [-0.5]
    assert outputs[0].top_logprobs == [[(7, -0.5)]]
    assert server.body("/completion")["n_probs"] == 1


async def test_a_stop_id_ends_the_stream_and_the_upstream_request(server: FakeServer) -> None:
    events = [lc_event(7, 1), lc_event(2, 2), lc_event(8, 3)]
    server.route("POST", "/completion", Reply(events=events, delay=0.05, hang=True))
    outputs = await run(LlamaCppApi(server.url), server, req(
        stop_conditions=StopConditions(stop_token_ids_hidden=[2])))  # fmt: skip
    assert ids(outputs) == [7, 2]
    assert outputs[-1].finish_reason is FinishReason.STOP
    await wait_for(lambda: server.client_gone == 1, "the server to see the client leave")


async def test_refused_options_are_never_sent(server: FakeServer) -> None:
    outputs = await run(LlamaCppApi(server.url), server, req(
        stop_conditions=StopConditions(min_tokens=3)))  # fmt: skip
    (only,) = outputs
    assert only.finish_reason is FinishReason.ERROR and only.error_kind == "bad_request"
    assert "min_tokens" in (only.error or "") and server.url in (only.error or "")
    assert not [r for r in server.requests if r[1] == "/completion"]


# ------------------------------------------------------------------ failures


@pytest.mark.parametrize(
    ("reply", "kind", "words"),
    [
        (Reply(400, json={"error": {"code": 400, "message": "the prompt is too long"}}),
         "bad_request", ["HTTP 400", "the prompt is too long"]),
        (Reply(500, json={"error": {"message": "CUDA out of memory"}}),
         "engine_failed", ["HTTP 500", "CUDA out of memory"]),
        (Reply(events=[b"data: this is not json"]), "engine_failed", ["does not decode"]),
        (Reply(events=[lc_event(7, 1)], hang=True), "engine_failed", ["idle deadline"]),
        (Reply(events=[lc_event(7, 1)], cut=True), "engine_failed", ["broke"]),
        (Reply(events=[lc_event(7, 1)]), "engine_failed", ["without a final event"]),
        (Reply(events=[{"error": {"code": 500, "message": "decode failed"}}]),
         "engine_failed", ["decode failed"]),
    ],
    ids=["4xx", "5xx", "garbage", "hang", "cut", "no-final", "in-band-error"],
)  # fmt: skip
async def test_server_failures_end_the_stream_with_their_kind(
    server: FakeServer, reply: Reply, kind: str, words: list[str]
) -> None:
    server.route("POST", "/completion", reply)
    outputs = await run(LlamaCppApi(server.url), server, req())
    final = outputs[-1]
    assert final.finish_reason is FinishReason.ERROR and final.error_kind == kind, final
    for word in words:
        assert word in (final.error or ""), final.error
    assert server.url in (final.error or "") or kind == "engine_failed"


async def test_an_unreachable_server_fails_over() -> None:
    fake = await FakeServer().start()
    url = fake.url
    await fake.stop()
    api = LlamaCppApi(url)
    engine = AttachedEngine(url=url, api=api, card=CARD, served_name="s", deadlines=FAST,
                            health_interval=60, load_interval=60)  # fmt: skip
    await engine.start()
    try:
        outputs = [o async for o in engine.generate(req(), RequestContext("r"))]
    finally:
        await engine.stop()
    assert outputs[-1].error_kind == "engine_failed"
    assert "cannot connect" in (outputs[-1].error or "")


async def test_a_server_that_stops_answering_is_reported_failed(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(json={"status": "ok"}))
    engine = AttachedEngine(url=server.url, api=LlamaCppApi(server.url), card=CARD,
                            served_name="s", deadlines=FAST, health_interval=0.05,
                            load_interval=60)  # fmt: skip
    failures: list[str] = []
    engine.on_failure(failures.append)
    await engine.start()
    try:
        await asyncio.sleep(0.2)  # time under test: a few health checks pass without a failure
        assert not failures
        await server.stop()
        await wait_for(lambda: bool(failures), "the health check to fail")
        assert server.url in failures[0]
    finally:
        await engine.stop()


async def test_a_client_that_leaves_closes_the_upstream_request(server: FakeServer) -> None:
    server.route("POST", "/completion", Reply(events=[lc_event(7, 1)], hang=True))
    engine = AttachedEngine(url=server.url, api=LlamaCppApi(server.url), card=CARD,
                            served_name="s", deadlines=Deadlines(idle=30), health_interval=60,
                            load_interval=60)  # fmt: skip
    await engine.start()
    try:
        stream = engine.generate(req(), RequestContext("r"))
        first = await anext(stream)
        assert first.token_ids == [7]
        await stream.aclose()  # type: ignore[attr-defined]
        await wait_for(lambda: server.client_gone == 1, "the server to see the client leave")
        assert engine.in_flight == 0
    finally:
        await engine.stop()


# ------------------------------------------------------------------ vLLM and SGLang


async def test_vllm_completions_stream(server: FakeServer) -> None:
    events = [
        {"choices": [{"index": 0, "text": "a", "token_ids": [7, 8], "logprobs": {
            "tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-0.1, -0.2],
            "top_logprobs": [{"token_id:7": -0.1, "token_id:3": -3.0},
                             {"token_id:8": -0.2}]}}], "usage": None},
        {"choices": [{"index": 0, "text": "", "token_ids": [9], "finish_reason": "length",
                      "logprobs": {"tokens": ["token_id:9"], "token_logprobs": [-0.3],
                                   "top_logprobs": [{"token_id:9": -0.3}]}}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3,
                                  "prompt_tokens_details": {"cached_tokens": 1}}},
        b"data: [DONE]",
    ]  # fmt: skip
    server.route("POST", "/v1/completions", Reply(events=events))
    outputs = await run(VllmApi(server.url), server, req(
        output_options=OutputOptions(logprobs=1), stop_conditions=StopConditions(min_tokens=2),
        cache_salt="tenant"))  # fmt: skip
    assert ids(outputs) == [7, 8, 9]
    assert [lp for o in outputs for lp in (o.log_probs or [])] == [-0.1, -0.2, -0.3]
    assert outputs[0].top_logprobs == [[(7, -0.1)], [(8, -0.2)]]
    final = outputs[-1]
    assert final.finish_reason is FinishReason.LENGTH
    assert final.usage is not None and final.usage.cached_tokens == 1
    body = server.body("/v1/completions")
    assert body["model"] == "served" and body["prompt"] == [1, 2, 3]
    assert body["max_tokens"] == 97  # what the 100-token context leaves
    assert body["return_token_ids"] is True and body["return_tokens_as_token_ids"] is True
    assert body["min_tokens"] == 2 and body["cache_salt"] == "tenant"
    assert body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("incremental", [False, True])
async def test_sglang_generate_stream(server: FakeServer, incremental: bool) -> None:
    chunks = [[7], [8, 9], [10]]
    events, so_far = [], []
    for i, new in enumerate(chunks):
        so_far = so_far + new
        last = i == len(chunks) - 1
        meta = {"prompt_tokens": 3, "completion_tokens": len(so_far), "cached_tokens": 0,
                "finish_reason": {"type": "length", "length": 4} if last else None}  # fmt: skip
        events.append({"text": "", "output_ids": new if incremental else so_far, "meta_info": meta})
    events.append(b"data: [DONE]")
    server.route("POST", "/generate", Reply(events=events))
    outputs = await run(SglangApi(server.url), server, req(
        stop_conditions=StopConditions(max_tokens=4)))  # fmt: skip
    assert ids(outputs) == [7, 8, 9, 10]
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    body = server.body("/generate")
    assert body["input_ids"] == [1, 2, 3] and body["sampling_params"]["max_new_tokens"] == 4


async def test_sglang_refuses_cache_salt(server: FakeServer) -> None:
    (only,) = await run(SglangApi(server.url), server, req(cache_salt="t"))
    assert only.error_kind == "bad_request" and "cache_salt" in (only.error or "")


async def wait_for(predicate: object, what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():  # type: ignore[operator]
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
