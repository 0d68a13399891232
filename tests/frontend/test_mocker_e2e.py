"""The mocker behind the real frontend, driven by the official OpenAI client."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from tests.frontend.stack import Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.mocker import MockerConfig, make_mocker_engines
from turnout.engines.mocker.engine import MockerEngine


@pytest.fixture
def mocker_stack(
    two_mockers: tuple[Stack, list[MockerEngine]],
) -> tuple[Stack, list[MockerEngine]]:
    return two_mockers


async def test_mocker_chat_and_completions(mocker_stack: tuple[Stack, list[MockerEngine]]) -> None:
    stack, _ = mocker_stack
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    chat = await api.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "hello"}], max_tokens=12
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 12
    assert chat.choices[0].finish_reason == "length"
    stream = await api.completions.create(
        model="mock", prompt="a b c d", max_tokens=9, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == 9
    await api.close()


async def test_repeated_prompt_reports_cached_tokens(
    mocker_stack: tuple[Stack, list[MockerEngine]],
) -> None:
    stack, _ = mocker_stack
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    prompt = list(range(1000, 1000 + 200))  # 12 full blocks of 16
    cached = []
    for _ in range(4):  # round-robin over 2 workers: each sees the prompt twice
        out = await api.completions.create(model="mock", prompt=prompt, max_tokens=2)
        assert out.usage is not None
        details = out.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
    assert cached[:2] == [0, 0]
    assert cached[2] >= 192 and cached[3] >= 192, cached
    await api.close()


async def test_prompt_longer_than_the_pool_is_400(
    mocker_stack: tuple[Stack, list[MockerEngine]],
) -> None:
    stack, _ = mocker_stack
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    pool_tokens = 256 * 16
    with pytest.raises(openai.BadRequestError, match="context length"):
        await api.completions.create(model="mock", prompt=[1000] * pool_tokens, max_tokens=1)
    ok = await api.completions.create(model="mock", prompt=[1000] * 100, max_tokens=1)
    assert ok.choices[0].finish_reason == "length"
    await api.close()


async def test_model_waits_for_min_initial_workers(gguf_path: str) -> None:
    before = set(asyncio.all_tasks())
    stack = await make_stack(router_min_initial_workers=2)
    try:
        config = MockerConfig(num_gpu_blocks=64, block_size=16, speedup_ratio=0)
        first, second = make_mocker_engines(config, 2, model_path=gguf_path)
        await stack.add_worker(first, model_name="mock")
        await stack.wait_for_model("mock", instances=1)
        body = {"model": "mock", "prompt": "hi", "max_tokens": 1}
        async with httpx.AsyncClient(base_url=stack.url) as http:
            early = await http.post("/v1/completions", json=body)
            assert early.status_code == 503  # one worker is not enough yet
            assert "2 workers" in early.json()["error"]["message"]
            assert early.headers["retry-after"]
            await stack.add_worker(second, model_name="mock")
            await stack.wait_for_model("mock", instances=2)
            assert (await http.post("/v1/completions", json=body)).status_code == 200
    finally:
        await stack.close()
    await assert_no_leaked_tasks(before)
