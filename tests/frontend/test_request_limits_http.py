"""Bounded work per request, over HTTP with the official clients: what a small (or merely
large) body asks for is refused with a 400 naming the field before any expensive step, and
the frontend's memory stays where it was."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import openai
import psutil
import pytest
from tests.frontend.stack import Stack
from tests.watchdog import MemoryWatchdog

from turnout.llm.chat_template import ChatTemplate
from turnout.llm.limits import SEED_MAX
from turnout.llm.tokenizer import Tokenizer

MiB = 1 << 20
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def api(echo_stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=echo_stack.url + "/v1", api_key="x", max_retries=0)
    yield client
    await client.close()


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts the template renders and tokenizer encodes (the stack runs in this process)."""
    counts = {"render": 0, "encode": 0}
    render, encode = ChatTemplate.render, Tokenizer.encode

    def counted_render(self: ChatTemplate, *args: Any, **kwargs: Any) -> str:
        counts["render"] += 1
        return render(self, *args, **kwargs)

    def counted_encode(self: Tokenizer, *args: Any, **kwargs: Any) -> list[int]:
        counts["encode"] += 1
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(ChatTemplate, "render", counted_render)
    monkeypatch.setattr(Tokenizer, "encode", counted_encode)
    yield counts


async def test_a_megabyte_stop_string_is_refused_and_memory_stays(
    api: openai.AsyncOpenAI,
) -> None:
    """One stop string of 1 MB once grew the frontend by its prefixes (L²/2 characters:
    24 GB); now a 400 naming 'stop', and the process's RSS barely moves."""
    baseline = psutil.Process().memory_info().rss
    with MemoryWatchdog(limit_bytes=baseline + 1024 * MiB) as watchdog:
        for _ in range(3):
            with pytest.raises(openai.BadRequestError) as info:
                await api.chat.completions.create(
                    model="echo", messages=USER, stop=["x" * MiB], n=4
                )
            assert info.value.param == "stop"
            assert "--max-stop-string-chars" in info.value.message
    watchdog.check()
    assert watchdog.peak_bytes - baseline < 200 * MiB, watchdog.peak_bytes - baseline


async def test_many_stop_strings_are_refused(api: openai.AsyncOpenAI) -> None:
    stops = [f"{i:06d}" + "x" * 94 for i in range(150_000)]
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(model="echo", messages=USER, stop=stops)
    assert info.value.param == "stop"
    assert "--max-stop-strings" in info.value.message


async def test_stop_strings_within_bounds_still_stop(api: openai.AsyncOpenAI) -> None:
    """The echo answers with the prompt: a stop string of it ends the answer there."""
    out = await api.completions.create(
        model="echo", prompt="alpha beta gamma delta", stop=["zzz", "gamma"], max_tokens=20
    )
    assert out.choices[0].text == "alpha beta "
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("seed", "n"), [(10**26, 1), (SEED_MAX, 2), (-(2**63) - 1, 1)])
async def test_a_seed_out_of_range_is_a_400(api: openai.AsyncOpenAI, seed: int, n: int) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(model="echo", messages=USER, seed=seed, n=n, max_tokens=2)
    assert info.value.param == "seed"


async def test_big_integers_anywhere_are_400s(api: openai.AsyncOpenAI) -> None:
    for field in ("top_k", "min_tokens", "max_tokens"):
        with pytest.raises(openai.BadRequestError) as info:
            await api.chat.completions.create(
                model="echo", messages=USER, extra_body={field: 10**26}
            )
        assert info.value.param == field


async def test_the_largest_seed_is_accepted(api: openai.AsyncOpenAI) -> None:
    out = await api.chat.completions.create(
        model="echo", messages=USER, seed=SEED_MAX - 1, n=2, max_tokens=2
    )
    assert len(out.choices) == 2


async def test_stop_token_ids_outside_the_vocabulary_are_a_400(api: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(
            model="echo", messages=USER, extra_body={"stop_token_ids": [5, 10**6]}
        )
    assert info.value.param == "stop_token_ids"
    assert "out of range" in info.value.message


async def test_a_response_too_large_to_build_is_refused(api: openai.AsyncOpenAI) -> None:
    """A 200-byte request once asked for a 213 MB body: 16 choices x 8000 tokens x 21."""
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(
            model="echo", messages=USER, n=16, max_tokens=8000, logprobs=True, top_logprobs=20
        )
    assert info.value.param == "max_tokens"
    assert "--max-response-items" in info.value.message


async def test_too_many_messages_are_refused_unrendered(
    api: openai.AsyncOpenAI, work: dict[str, int]
) -> None:
    messages: Any = [{"role": "user", "content": ""}] * 10_001
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(model="echo", messages=messages)
    assert info.value.param == "messages"
    assert work == {"render": 0, "encode": 0}


async def test_a_prompt_that_cannot_fit_is_refused_untokenized(
    echo_stack: Stack, api: openai.AsyncOpenAI, work: dict[str, int]
) -> None:
    """A 15 MB message (under the 16 MB body cap) once took 10 s to be refused after the
    template and the tokenizer: now it is refused from its length alone, on every route."""
    text = "a" * (15 * 10**6)
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": text}]
        )
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        await api.completions.create(model="echo", prompt=text)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        await api.responses.create(model="echo", input=text)
    assert info.value.code == "context_length_exceeded"
    claude = anthropic.AsyncAnthropic(base_url=echo_stack.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="maximum context length"):
        await claude.messages.create(
            model="echo", max_tokens=10, messages=[{"role": "user", "content": text}]
        )
    await claude.close()
    assert work == {"render": 0, "encode": 0}


async def test_responses_input_items_are_bounded(api: openai.AsyncOpenAI) -> None:
    items: Any = [{"role": "user", "content": "x"}] * 10_001
    with pytest.raises(openai.BadRequestError) as info:
        await api.responses.create(model="echo", input=items)
    assert info.value.param == "input"
    assert "--max-messages" in info.value.message


async def test_messages_stop_sequences_are_bounded(echo_stack: Stack) -> None:
    claude = anthropic.AsyncAnthropic(base_url=echo_stack.url, api_key="x", max_retries=0)
    for stops, flag in (
        (["x" * MiB], "--max-stop-string-chars"),
        ([f"s{i}" for i in range(17)], "--max-stop-strings"),
    ):
        with pytest.raises(anthropic.BadRequestError) as info:
            await claude.messages.create(
                model="echo", max_tokens=10, messages=USER, stop_sequences=stops
            )
        assert "'stop_sequences'" in info.value.message and flag in info.value.message
    await claude.close()
