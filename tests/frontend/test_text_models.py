"""Text-input models: the worker does its own templating and tokenization; the frontend
routes the OpenAI request as is and relays the OpenAI chunks (streamed or folded)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import openai
import pytest
from tests.frontend.stack import Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.protocols.model import EndpointId, ModelDeploymentCard, ModelInput, ModelType, mdc_key
from turnout.runtime.context import RequestContext

TEXT_ENDPOINT = EndpointId(namespace="test", component="text", name="generate")


async def shouting_worker(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    """A Text+Chat worker: answers with the last user message in capitals, word by word."""
    request = msgspec.json.decode(payload)
    words = request["messages"][-1]["content"].upper().split()
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": request["model"]}  # fmt: skip
    for i, word in enumerate(words):
        delta = {"role": "assistant", "content": word} if i == 0 else {"content": " " + word}
        chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        yield msgspec.json.encode(chunk)
    usage = {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}
    yield msgspec.json.encode(
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}
    )


@pytest.fixture
async def text_stack() -> AsyncIterator[Stack]:
    before = set(asyncio.all_tasks())
    stack = await make_stack()

    def records(instance_id: int) -> list[tuple[str, bytes]]:
        card = ModelDeploymentCard(
            display_name="shout", endpoint=TEXT_ENDPOINT, instance_id=instance_id,
            model_type=ModelType.Chat, model_input=ModelInput.Text,
        )  # fmt: skip
        return [(mdc_key(TEXT_ENDPOINT, instance_id), msgspec.json.encode(card))]

    serving = await stack.runtime.endpoint(TEXT_ENDPOINT).serve(shouting_worker, records=records)
    await stack.wait_for_model("shout")
    yield stack
    await serving.stop(drain_timeout=0.5)
    await stack.close()
    await assert_no_leaked_tasks(before)


async def test_text_chat_is_relayed(text_stack: Stack) -> None:
    api = openai.AsyncOpenAI(base_url=text_stack.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "hello there world"}]
    whole = await api.chat.completions.create(model="shout", messages=messages)  # type: ignore[arg-type]
    assert whole.choices[0].message.content == "HELLO THERE WORLD"
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None and whole.usage.completion_tokens == 3
    stream = await api.chat.completions.create(model="shout", messages=messages, stream=True)  # type: ignore[arg-type]
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "HELLO THERE WORLD"
    # The model serves chat only: completions is a clear 404.
    with pytest.raises(openai.NotFoundError, match="completions"):
        await api.completions.create(model="shout", prompt="x")
    await api.close()


async def failing_worker(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    choice = {"index": 0, "delta": {"content": "partial"}, "finish_reason": None}
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "flaky",
             "choices": [choice]}  # fmt: skip
    yield msgspec.json.encode(chunk)
    raise RuntimeError("the engine fell over")


async def test_text_stream_failing_midway_ends_with_an_error_event() -> None:
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    endpoint = EndpointId(namespace="test", component="flaky", name="generate")

    def records(instance_id: int) -> list[tuple[str, bytes]]:
        card = ModelDeploymentCard(
            display_name="flaky", endpoint=endpoint, instance_id=instance_id,
            model_type=ModelType.Chat, model_input=ModelInput.Text,
        )  # fmt: skip
        return [(mdc_key(endpoint, instance_id), msgspec.json.encode(card))]

    serving = await stack.runtime.endpoint(endpoint).serve(failing_worker, records=records)
    await stack.wait_for_model("flaky")
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=10)
    try:
        stream = await api.chat.completions.create(
            model="flaky", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        with pytest.raises(openai.APIError, match="fell over"):
            async for _ in stream:
                pass
    finally:
        await api.close()
        await serving.stop(drain_timeout=0.5)
        await stack.close()
    await assert_no_leaked_tasks(before)


async def test_a_text_model_lists_only_its_own_route(text_stack: Stack) -> None:
    api = openai.AsyncOpenAI(base_url=text_stack.url + "/v1", api_key="x", max_retries=0)
    (model,) = (await api.models.list()).data
    # Chat only, and not /v1/responses or /v1/messages: the worker templates its requests.
    assert model.model_extra is not None
    assert model.model_extra["endpoints"] == ["/v1/chat/completions"]
    await api.close()
