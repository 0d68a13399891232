"""Log probabilities end to end: the mocker reports one per token, the frontend returns them
in OpenAI's chat and completions shapes, streamed and not (bodies checked strictly against
the openai types by the suite's conformance hook)."""

from __future__ import annotations

import math

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
    assert logprobs.top_logprobs is None  # logprobs 0: no alternatives
    await api.close()


async def test_alternatives_whole_and_streamed(stack: Stack) -> None:
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "count"}]
    whole = await api.chat.completions.create(
        model="mock", messages=messages, max_tokens=6, logprobs=True, top_logprobs=3,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    entries = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert entries is not None and len(entries) == 6
    for e in entries:
        alts = e.top_logprobs
        assert len(alts) == 3
        values = [a.logprob for a in alts]
        assert values == sorted(values, reverse=True)
        assert (e.token, e.logprob) in [(a.token, a.logprob) for a in alts]
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-9
    stream = await api.chat.completions.create(
        model="mock", messages=messages, max_tokens=6, logprobs=True, top_logprobs=3,  # type: ignore[arg-type]
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    streamed = [
        e
        async for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs is not None
        for e in chunk.choices[0].logprobs.content or []
    ]
    assert [[(a.token, a.logprob) for a in e.top_logprobs] for e in streamed] == [
        [(a.token, a.logprob) for a in e.top_logprobs] for e in entries
    ]
    out = await api.completions.create(
        model="mock", prompt="hello", max_tokens=4, logprobs=2, extra_body={"ignore_eos": True}
    )
    tops = out.choices[0].logprobs.top_logprobs  # type: ignore[union-attr]
    assert tops is not None and len(tops) == 4
    assert all(1 <= len(t) <= 2 for t in tops)
    await api.close()


async def test_alternatives_are_refused_beyond_the_engine_or_without_logprobs(
    stack: Stack,
) -> None:
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="between 0 and 20"):
        await api.chat.completions.create(
            model="mock", messages=messages, logprobs=True, top_logprobs=21,  # type: ignore[arg-type]
        )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="needs 'logprobs': true"):
        await api.chat.completions.create(model="mock", messages=messages, top_logprobs=2)  # type: ignore[arg-type]
    await api.close()


async def test_no_logprobs_unless_asked(stack: Stack) -> None:
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    out = await api.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert out.choices[0].logprobs is None
    await api.close()


@pytest.mark.slow
async def test_llamacpp_alternatives_whole_and_streamed(smol_stack: Stack) -> None:
    """The real model's own alternatives: up to 20 per token, most likely first, the greedy
    token the most likely; the same whole and streamed; completions' legacy shape too."""
    api = openai.AsyncOpenAI(base_url=smol_stack.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = await api.chat.completions.create(
        model="smol", messages=messages, max_tokens=5, temperature=0, logprobs=True,  # type: ignore[arg-type]
        top_logprobs=20,
    )  # fmt: skip
    entries = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert entries is not None and len(entries) == whole.usage.completion_tokens  # type: ignore[union-attr]
    for e in entries:
        values = [a.logprob for a in e.top_logprobs]
        assert len(values) == 20 and values == sorted(values, reverse=True)
        assert e.top_logprobs[0].token == e.token
        assert math.isclose(e.top_logprobs[0].logprob, e.logprob, abs_tol=1e-4)
        assert all(v <= 0 for v in values) and sum(math.exp(v) for v in values) <= 1.0 + 1e-4
    assert "".join(e.token for e in entries) == whole.choices[0].message.content
    stream = await api.chat.completions.create(
        model="smol", messages=messages, max_tokens=5, temperature=0, logprobs=True,  # type: ignore[arg-type]
        top_logprobs=20, stream=True,
    )  # fmt: skip
    streamed = [
        e
        async for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs is not None
        for e in chunk.choices[0].logprobs.content or []
    ]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [[a.token for a in e.top_logprobs] for e in streamed] == [
        [a.token for a in e.top_logprobs] for e in entries
    ]

    out = await api.completions.create(
        model="smol", prompt="The sky is", max_tokens=4, temperature=0, logprobs=5
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert "".join(lp.tokens) == out.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    for token, logprob, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(alts) <= 5 and max(alts.values()) == alts[token]
        assert math.isclose(alts[token], logprob, abs_tol=1e-4)
    stream = await api.completions.create(
        model="smol", prompt="The sky is", max_tokens=4, temperature=0, logprobs=5, stream=True
    )
    pieces = [c.choices[0].logprobs async for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens or []] == lp.tokens
    assert [t for p in pieces for t in p.top_logprobs or []] == lp.top_logprobs
    with pytest.raises(openai.BadRequestError, match="between 0 and 5"):
        await api.completions.create(model="smol", prompt="x", logprobs=6)
    await api.close()
