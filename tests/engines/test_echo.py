"""The echo engine: the prompt's tokens come back in order, one output each."""

from __future__ import annotations

import asyncio

import pytest
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.echo import PLACEHOLDER_ENDPOINT, EchoEngine
from turnout.llm.artifacts import LOCAL_ARTIFACTS
from turnout.protocols.llm import (
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    StopConditions,
)
from turnout.runtime.context import RequestContext

PROMPT = [11, 22, 33, 44, 55]


def make_request(tokens: list[int], max_tokens: int | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="echo",
        token_ids=tokens,
        stop_conditions=StopConditions(max_tokens=max_tokens),
        eos_token_ids=[33],  # inside the prompt: the echo must not stop on it
    )


async def collect(
    engine: EchoEngine, request: PreprocessedRequest, ctx: RequestContext | None = None
) -> list[LLMEngineOutput]:
    return [out async for out in engine.generate(request, ctx or RequestContext())]


@pytest.mark.parametrize(
    ("max_tokens", "expected", "reason"),
    [
        (None, PROMPT, FinishReason.EOS),
        (3, PROMPT[:3], FinishReason.LENGTH),
        (5, PROMPT, FinishReason.LENGTH),
        (12, (PROMPT * 3)[:12], FinishReason.LENGTH),
        (1, PROMPT[:1], FinishReason.LENGTH),
    ],
)
async def test_tokens_come_back_in_order_one_per_output(
    max_tokens: int | None, expected: list[int], reason: FinishReason
) -> None:
    outs = await collect(EchoEngine(), make_request(PROMPT, max_tokens))
    assert [o.token_ids for o in outs] == [[t] for t in expected]
    assert [o.finish_reason for o in outs] == [None] * (len(expected) - 1) + [reason]
    usage = outs[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (
        len(PROMPT),
        len(expected),
        0,
    )
    assert all(o.usage is None for o in outs[:-1])


async def test_zero_max_tokens_ends_at_once() -> None:
    outs = await collect(EchoEngine(), make_request(PROMPT, 0))
    assert len(outs) == 1
    assert outs[0].token_ids == []
    assert outs[0].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("tokens", "context_length", "message"),
    [([], None, "empty prompt"), (PROMPT, 5, "context length is 5")],
)
async def test_bad_requests_end_with_an_error(
    tokens: list[int], context_length: int | None, message: str
) -> None:
    outs = await collect(EchoEngine(context_length=context_length), make_request(tokens, 4))
    assert len(outs) == 1
    assert outs[0].finish_reason is FinishReason.ERROR
    assert outs[0].error is not None and message in outs[0].error


async def test_cancellation_during_a_delay_stops_at_once() -> None:
    engine = EchoEngine(delay_ms=200)
    ctx = RequestContext()
    loop = asyncio.get_running_loop()
    outs: list[LLMEngineOutput] = []
    cancelled_at = 0.0
    async for out in engine.generate(make_request(PROMPT, 50), ctx):
        outs.append(out)
        if len(outs) == 2:
            loop.call_later(0.02, ctx.cancel)
            cancelled_at = loop.time() + 0.02
    # The third token was due 200 ms after the second: cancellation cut the wait short.
    assert loop.time() - cancelled_at < 0.15
    assert [o.token_ids for o in outs] == [[11], [22], []]
    assert outs[-1].finish_reason is FinishReason.CANCELLED
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 2


async def test_cancellation_without_delay_stops_at_the_next_token() -> None:
    ctx = RequestContext()
    outs: list[LLMEngineOutput] = []
    async for out in EchoEngine().generate(make_request(PROMPT, 10_000), ctx):
        outs.append(out)
        if len(outs) == 3:
            ctx.cancel()
    assert len(outs) == 4
    assert outs[-1].finish_reason is FinishReason.CANCELLED


async def test_delay_paces_the_tokens() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    outs = await collect(EchoEngine(delay_ms=30), make_request(PROMPT, 4))
    assert len(outs) == 4
    assert loop.time() - start >= 4 * 0.03 * 0.9


async def test_closing_the_generator_mid_stream_leaves_nothing_running() -> None:
    before = set(asyncio.all_tasks())
    gen = EchoEngine(delay_ms=5).generate(make_request(PROMPT, 1000), RequestContext())
    assert (await anext(gen)).token_ids == [11]
    await gen.aclose()
    await assert_no_leaked_tasks(before)


async def test_a_long_echo_without_delay_lets_other_tasks_run() -> None:
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    outs = await collect(EchoEngine(), make_request(PROMPT, 2000))
    ticks_during = ticks
    done.set()
    await task
    assert len(outs) == 2000
    assert ticks_during >= 2000 // 16 - 1


def test_model_card_template_describes_the_model(gguf_path: str) -> None:
    card = EchoEngine(gguf_path, context_length=512).model_card_template()
    assert card.endpoint == PLACEHOLDER_ENDPOINT
    assert card.context_length == 512
    # The tokenizer travels by content: a tokenizer.json built from the GGUF, held for serving.
    assert card.tokenizer is not None and card.tokenizer.kind == "hf_tokenizer_json"
    assert card.tokenizer.sha256 in LOCAL_ARTIFACTS
    assert card.chat_template and "<|im_start|>" in card.chat_template
    assert card.eos_token_ids
