"""Chat requests through a preprocessor with a prompt cache: for random conversations that
grow turn by turn (unicode, whitespace at the edges, special tokens in the text, tool calls
and results, tools, with and without the generation prompt), through SmolLM2's own template
and ones shaped like Qwen2.5's and Llama 3.1's, the token ids are those of a preprocessor
without one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.llm.templates import LLAMA_LIKE, QWEN_LIKE, WEATHER_TOOL
from tests.llm.tokenizer_zoo import ZOO

from turnout.errors import RequestError
from turnout.llm.chat_template import ChatTemplate
from turnout.llm.model_card import load_model_card
from turnout.llm.preprocessor import Preprocessor
from turnout.llm.prompt_cache import PromptCache
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.model import EndpointId, ModelDeploymentCard
from turnout.protocols.openai import ChatCompletionRequest

EP = EndpointId(namespace="ns", component="c", name="generate")


@pytest.fixture(scope="module")
def smol_card(gguf_path: Path) -> ModelDeploymentCard:
    return load_model_card(gguf_path, endpoint=EP, context_length=1 << 20, display_name="m")


@pytest.fixture(scope="module")
def pairs(
    smol_card: ModelDeploymentCard, smol_tokenizer: Tokenizer
) -> dict[str, tuple[Preprocessor, Preprocessor, PromptCache]]:
    """Per template: a preprocessor without a cache, one with, and its cache."""
    llama3 = ZOO["llama3"]()
    setups = {
        "smollm2": (smol_card.chat_template, smol_tokenizer),
        "qwen_like": (QWEN_LIKE, smol_tokenizer),
        "llama_like": (LLAMA_LIKE, llama3),
    }
    out = {}
    for name, (source, tok) in setups.items():
        assert source is not None
        card = msgspec.structs.replace(smol_card, chat_template=source)
        template = ChatTemplate(source, "<|begin_of_text|>", "<|eot_id|>")
        cache = PromptCache()
        out[name] = (
            Preprocessor(card, tok, template),
            Preprocessor(card, tok, template, prompt_cache=cache),
            cache,
        )
    return out


_TEXT = st.lists(
    st.one_of(
        st.sampled_from(
            [" ", "\n", "  \n", "\t", "hello", " world", "café", "漢字 🙂", "123",
             "<|im_end|>", "<|im_start|>", "<|eot_id|>", "<|start_header_id|>", "<|im", "|>"]
        ),
        st.text(max_size=5),
    ),
    max_size=12,
).map("".join)  # fmt: skip
_CALL = st.builds(
    lambda name, city: {
        "id": "call_1",
        "type": "function",
        "function": {"name": name, "arguments": msgspec.json.encode({"city": city}).decode()},
    },
    st.sampled_from(["get_weather", "lookup"]),
    _TEXT,
)
_TURN = st.one_of(
    st.tuples(_TEXT, _TEXT).map(lambda qa: [
        {"role": "user", "content": qa[0]}, {"role": "assistant", "content": qa[1]}
    ]),
    st.tuples(_TEXT, _CALL, _TEXT).map(lambda t: [
        {"role": "user", "content": t[0]},
        {"role": "assistant", "content": None, "tool_calls": [t[1]]},
        {"role": "tool", "content": t[2], "tool_call_id": "call_1"},
    ]),
)  # fmt: skip


def request(messages: list[dict[str, Any]], tools: bool, gen: bool) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 1}
    if tools:
        body |= {"tools": [WEATHER_TOOL], "tool_choice": "none"}
    body["add_generation_prompt"] = gen
    return msgspec.convert(body, ChatCompletionRequest)


async def ids_or_error(pre: Preprocessor, req: ChatCompletionRequest) -> list[int] | str:
    try:
        return (await pre.preprocess_chat(req)).token_ids
    except RequestError as e:
        return f"error: {e}"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    system=st.one_of(st.none(), _TEXT),
    turns=st.lists(_TURN, min_size=1, max_size=6),
    last=_TEXT,
    tools=st.booleans(),
    gen=st.booleans(),
)
async def test_growing_conversations(
    pairs: dict[str, tuple[Preprocessor, Preprocessor, PromptCache]],
    system: str | None,
    turns: list[list[dict[str, Any]]],
    last: str,
    tools: bool,
    gen: bool,
) -> None:
    history: list[dict[str, Any]] = (
        [] if system is None else [{"role": "system", "content": system}]
    )
    for turn in turns:
        history += turn
        messages = [*history, {"role": "user", "content": last}]
        for whole, cached, _ in pairs.values():
            req = request(messages, tools, gen)
            assert await ids_or_error(cached, req) == await ids_or_error(whole, req)


async def test_multi_turn_encodes_only_new_turns(
    pairs: dict[str, tuple[Preprocessor, Preprocessor, PromptCache]],
) -> None:
    """Twenty turns through each template: after the first request, each encodes a small
    share of its prompt, and all of them together encode over three times fewer tokens."""
    for whole, cached, cache in pairs.values():
        before_encoded, before_reused = cache.stats.tokens_encoded, cache.stats.tokens_reused
        history: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly."}]
        total = 0
        for i in range(20):
            history.append({"role": "user", "content": f"Question {i}: what about {i} cats?"})
            req = request(history, tools=False, gen=True)
            ids = (await cached.preprocess_chat(req)).token_ids
            assert ids == (await whole.preprocess_chat(req)).token_ids
            total += len(ids)
            history.append({"role": "assistant", "content": f"There are {i} cats, I think."})
        encoded = cache.stats.tokens_encoded - before_encoded
        assert encoded + cache.stats.tokens_reused - before_reused == total
        assert 3 * encoded < total


async def test_pieces_are_reused_within_a_tenant_only(
    pairs: dict[str, tuple[Preprocessor, Preprocessor, PromptCache]],
) -> None:
    """The same conversation from two tenants: the second tenant reuses nothing of the first's
    pieces (it could time the difference), the first tenant's next request reuses them all,
    and every request's ids are a whole encode's."""
    whole, cached, cache = pairs["smollm2"]
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "A secret plan only tenant a knows about, in detail."},
    ]
    req = request(messages, tools=False, gen=True)
    expected = (await whole.preprocess_chat(req)).token_ids

    async def reused_by(tenant: str) -> int:
        """Tokens the tenant's request took from the cache."""
        before = cache.stats.tokens_reused
        assert (await cached.preprocess_chat(req, tenant)).token_ids == expected
        return cache.stats.tokens_reused - before

    first = await reused_by("a")  # a fresh space: only pieces repeated within the prompt
    assert first < len(expected)
    assert await reused_by("b") == first  # tenant b: nothing of a's
    assert await reused_by("a") == len(expected)  # tenant a: every piece from the cache
