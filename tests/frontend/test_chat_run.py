"""Every surface runs a request the same way (``ChatRun``): chat completions, completions,
``n`` > 1, the Responses API and Anthropic messages, whole and streamed, fail and time alike.

* A first output that is already the worker's failure is the response's status (nothing has
  reached the client), on every surface, whole or streamed, ``n`` = 1 or more; the request's
  duration and output tokens are recorded all the same.
* The time to the first token is taken when the first token arrives, not when a parser lets
  its text out: a tool call the parser holds back does not delay it, on any surface.
* ``n`` > 1 counts the prompt's cached tokens once, as its usage does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.frontend.scripted import call_markup
from tests.frontend.stack import Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.echo import EchoEngine
from turnout.engines.mocker import MockerConfig, make_mocker_engines
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.llm import CompletionUsage, FinishReason, LLMEngineOutput
from turnout.protocols.llm import PreprocessedRequest as Request
from turnout.runtime.context import RequestContext

HI = [{"role": "user", "content": "hi"}]
TTFT = "turnout_time_to_first_token_seconds_count"
PARAMETERS: dict[str, Any] = {"type": "object", "properties": {"city": {"type": "string"}}}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": PARAMETERS}


def surfaces(model: str, *, tools: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """One request per surface (path, body), each with room for a few tokens."""
    chat: dict[str, Any] = {"model": model, "messages": HI, "max_tokens": 16}
    responses: dict[str, Any] = {"model": model, "input": "hi", "max_output_tokens": 16}
    messages: dict[str, Any] = {"model": model, "messages": HI, "max_tokens": 16}
    if tools:
        chat["tools"] = [CHAT_TOOL]
        responses["tools"] = [RESPONSES_TOOL]
        messages["tools"] = [ANTHROPIC_TOOL]
    return [
        ("/v1/chat/completions", chat),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 16}),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 16, "n": 2}),
        ("/v1/responses", responses),
        ("/v1/messages", messages),
    ]


async def metric(http: httpx.AsyncClient, name: str, model: str) -> float:
    """The value of sample ``name`` (e.g. ``..._count``) of ``model`` on ``/metrics``."""
    text = (await http.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("model") == model:
                return sample.value
    return 0.0


class FailsAtOnce(EchoEngine):
    """Its first output carries a token and the engine's failure (as a worker that merges
    its last tokens into the error output sends it)."""

    async def generate(
        self, request: Request, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        yield LLMEngineOutput(
            token_ids=request.token_ids[:1], finish_reason=FinishReason.ERROR,
            error="the engine fell over",
        )  # fmt: skip


class HeldCall(EchoEngine):
    """Answers with a hermes tool call: its first tokens at once, the rest once ``release``
    is set (a parser holds the call's text until it closes)."""

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path)
        self._ids = Tokenizer.from_gguf(model_path).encode(call_markup("Paris"))
        self.release = asyncio.Event()

    async def generate(
        self, request: Request, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        ids = self._ids
        yield LLMEngineOutput(token_ids=ids[:3])
        await asyncio.wait_for(self.release.wait(), 30)
        for token in ids[3:-1]:
            yield LLMEngineOutput(token_ids=[token])
        usage = CompletionUsage(
            prompt_tokens=len(request.token_ids), completion_tokens=len(ids), cached_tokens=0
        )
        yield LLMEngineOutput(token_ids=ids[-1:], finish_reason=FinishReason.EOS, usage=usage)


@pytest.fixture
async def stack(gguf_path: str) -> AsyncIterator[tuple[Stack, HeldCall]]:
    """Model ``fails`` (``FailsAtOnce``) and model ``held`` (``HeldCall``, hermes calls)."""
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    held = HeldCall(gguf_path)
    await stack.add_worker(FailsAtOnce(gguf_path), model_name="fails")
    await stack.add_worker(held, model_name="held", tool_call_parser="hermes")
    await stack.wait_for_model("fails")
    await stack.wait_for_model("held")
    yield stack, held
    await stack.close()
    await assert_no_leaked_tasks(before)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_first_output_that_fails_is_the_status_on_every_surface(
    stack: tuple[Stack, HeldCall], stream: bool
) -> None:
    http_stack, _ = stack
    async with httpx.AsyncClient(base_url=http_stack.url, timeout=30) as http:
        for path, body in surfaces("fails"):
            durations = await metric(http, "turnout_request_duration_seconds_count", "fails")
            outputs = await metric(http, "turnout_output_sequence_tokens_count", "fails")
            r = await http.post(path, json={**body, "stream": stream})
            assert r.status_code == 500, (path, body, r.text)
            assert "the engine fell over" in r.text
            error = r.json()["error"]
            if path == "/v1/messages":
                assert error["type"] == "api_error"
            else:
                assert error["code"] == "worker_error"
            # The request ran: its duration and output tokens are recorded.
            after = await metric(http, "turnout_request_duration_seconds_count", "fails")
            assert after == durations + 1, path
            after = await metric(http, "turnout_output_sequence_tokens_count", "fails")
            assert after == outputs + 1, path


@pytest.mark.parametrize("stream", [False, True])
async def test_the_first_token_is_timed_when_it_arrives_not_when_a_parser_lets_it_out(
    stack: tuple[Stack, HeldCall], stream: bool
) -> None:
    http_stack, engine = stack
    async with httpx.AsyncClient(base_url=http_stack.url, timeout=30) as http:
        for path, body in surfaces("held", tools=True):
            engine.release.clear()
            ttfts = await metric(http, TTFT, "held")
            n = body.get("n", 1)
            request = asyncio.create_task(http.post(path, json={**body, "stream": stream}))

            # The call is still held (by the engine, then by the parser): the first token
            # has been timed all the same.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while await metric(http, TTFT, "held") != ttfts + 1:
                assert loop.time() < deadline, f"{path} (n={n}): no first token timed"
                await asyncio.sleep(0.01)
            assert not request.done()
            engine.release.set()
            r = await request
            assert r.status_code == 200, (path, r.text)
            if path != "/v1/completions":
                assert "get_weather" in r.text
            after = await metric(http, TTFT, "held")
            assert after == ttfts + 1, path  # once per request, n choices or one


async def test_n_choices_count_the_prompts_cached_tokens_once(gguf_path: str) -> None:
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    config = MockerConfig(num_gpu_blocks=256, block_size=16, speedup_ratio=0)
    for engine in make_mocker_engines(config, 1, model_path=gguf_path):
        await stack.add_worker(engine, model_name="mock")
    await stack.wait_for_model("mock")
    prompt = " ".join(f"word{i}" for i in range(64))
    body = {"model": "mock", "prompt": prompt, "max_tokens": 2, "n": 3}
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            cached = await metric(http, "turnout_cached_tokens_total", "mock")
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            hit = usage["prompt_tokens_details"]["cached_tokens"]
            assert hit > 0, usage  # the second time, the prompt is in the worker's cache
            assert await metric(http, "turnout_cached_tokens_total", "mock") == cached + hit
    finally:
        await stack.close()
    await assert_no_leaked_tasks(before)
