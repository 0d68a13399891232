"""``n`` > 1 through HTTP: the frontend fans out one sub-request per choice and merges them,
whole and streamed (chunks checked strictly by the suite's conformance hook)."""

from __future__ import annotations

from collections import defaultdict

import openai
import pytest
from tests.frontend.stack import Stack

from turnout.engines.mocker.engine import MockerEngine


@pytest.fixture
def stack(two_mockers: tuple[Stack, list[MockerEngine]]) -> tuple[Stack, list[MockerEngine]]:
    return two_mockers


async def test_whole_response_has_every_choice(
    stack: tuple[Stack, list[MockerEngine]],
) -> None:
    http, _ = stack
    api = openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="x", max_retries=0)
    out = await api.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=5,
        logprobs=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.content for c in out.choices)
    assert all(c.logprobs is not None and len(c.logprobs.content or []) == 5 for c in out.choices)
    assert out.usage is not None
    assert out.usage.completion_tokens == 15 and out.usage.prompt_tokens > 0
    await api.close()


async def test_streamed_choices_interleave_and_each_finishes(
    stack: tuple[Stack, list[MockerEngine]],
) -> None:
    http, _ = stack
    api = openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="x", max_retries=0)
    stream = await api.completions.create(
        model="mock", prompt="count", n=4, max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts: dict[int, str] = defaultdict(str)
    finished: dict[int, str] = {}
    ids = set()
    usage = None
    async for chunk in stream:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert len(ids) == 1  # one response
    assert finished == {0: "length", 1: "length", 2: "length", 3: "length"}
    assert all(texts[i] for i in range(4))
    assert usage is not None and usage.completion_tokens == 24
    await api.close()


async def test_each_choice_runs_as_its_own_request(
    stack: tuple[Stack, list[MockerEngine]],
) -> None:
    http, engines = stack
    api = openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="x", max_retries=0)
    await api.completions.create(model="mock", prompt="x y z", n=4, max_tokens=2)
    # Round-robin over two workers: the four sub-requests went two and two.
    steps = [e.get_stats().num_steps for e in engines]
    assert all(s > 0 for s in steps), steps
    with pytest.raises(openai.BadRequestError, match="'n' must be between 1 and 16"):
        await api.completions.create(model="mock", prompt="x", n=17, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="'echo' with 'n' > 1"):
        await api.completions.create(model="mock", prompt="x", n=2, echo=True, max_tokens=2)
    await api.close()
