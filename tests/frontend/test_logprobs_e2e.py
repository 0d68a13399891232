"""Log probabilities end to end: the mocker reports one per token, the frontend returns them
in OpenAI's chat and completions shapes, streamed and not (bodies checked strictly against
the openai types by the suite's conformance hook)."""

from __future__ import annotations

import openai
import pytest
from tests.frontend.stack import Stack

from turnout.engines.mocker import MockerEngine


@pytest.fixture
def stack(two_mockers: tuple[Stack, list[MockerEngine]]) -> Stack:
    return two_mockers[0]


async def test_chat_logprobs_whole_and_streamed_agree(stack: Stack) -> None:
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "count to ten"}]
    whole = await api.chat.completions.create(
        model="mock", messages=messages, max_tokens=8, logprobs=True,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == 8
    assert all(-4.0 <= e.logprob < 0 and e.top_logprobs == [] for e in entries)
    assert "".join(e.token for e in entries) == choice.message.content
    stream = await api.chat.completions.create(
        model="mock", messages=messages, max_tokens=8, logprobs=True, stream=True,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    streamed = [
        e
        async for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs is not None
        for e in chunk.choices[0].logprobs.content or []
    ]
    # The mocker is deterministic: the same tokens, the same numbers.
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    await api.close()


async def test_completions_logprobs_shape(stack: Stack) -> None:
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    out = await api.completions.create(
        model="mock", prompt="hello there", max_tokens=5, logprobs=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.token_logprobs is not None and logprobs.text_offset is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert logprobs.text_offset[0] == 0
    assert "".join(logprobs.tokens) == out.choices[0].text
    with pytest.raises(openai.BadRequestError, match="at most 0 alternatives"):
        await api.completions.create(model="mock", prompt="hi", max_tokens=2, logprobs=2)
    await api.close()


async def test_no_logprobs_unless_asked(stack: Stack) -> None:
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    out = await api.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert out.choices[0].logprobs is None
    await api.close()
