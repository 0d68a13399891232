"""Request limits in the preprocessor: every bound refused with a 400 naming its field, before
the template or the tokenizer runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from turnout.errors import ConfigError, ContextLengthExceeded, RequestError
from turnout.llm.chat_template import ChatTemplate
from turnout.llm.limits import SEED_MAX, RequestLimits
from turnout.llm.model_card import load_model_card
from turnout.llm.preprocessor import Preprocessor
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.model import EndpointId, ModelCapabilities, ModelDeploymentCard
from turnout.protocols.openai import ChatCompletionRequest, CompletionRequest

EP = EndpointId(namespace="ns", component="c", name="generate")
CTX = 256


@pytest.fixture(scope="module")
def card(gguf_path: Path) -> ModelDeploymentCard:
    card = load_model_card(gguf_path, endpoint=EP, context_length=CTX, display_name="smol")
    caps = ModelCapabilities(logprobs=True, max_top_logprobs=20, min_tokens=True)
    return msgspec.structs.replace(card, capabilities=caps)


def make_pre(
    card: ModelDeploymentCard, tok: Tokenizer, limits: RequestLimits | None = None
) -> Preprocessor:
    assert card.chat_template is not None
    template = ChatTemplate(card.chat_template, card.bos_token, card.eos_token)
    return Preprocessor(card, tok, template, limits)


@pytest.fixture(scope="module")
def pre(card: ModelDeploymentCard, smol_tokenizer: Tokenizer) -> Preprocessor:
    return make_pre(card, smol_tokenizer)


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


def completion(**fields: Any) -> CompletionRequest:
    return msgspec.convert({"model": "smol", "prompt": "Hello", **fields}, CompletionRequest)


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts the template renders and tokenizer encodes of the test."""
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


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "param", "flag"),
    [
        ({"stop": [f"s{i}" for i in range(17)]}, "stop", "--max-stop-strings"),
        ({"stop": "x" * 257}, "stop", "--max-stop-string-chars"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids", "--max-stop-token-ids"),
        ({"stop_token_ids": [5, 10**9]}, "stop_token_ids", "out of range"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "out of range"),
        ({"messages": [{"role": "user", "content": "x"}] * 10_001}, "messages", "--max-messages"),
        ({"tools": [TOOL] * 257, "tool_choice": "none"}, "tools", "--max-tools"),
        ({"n": 17}, "n", "--max-choices"),
        ({"seed": SEED_MAX, "n": 2}, "seed", "choice i gets seed + i"),
    ],
)
async def test_chat_bounds(
    pre: Preprocessor, work: dict[str, int], fields: dict[str, Any], param: str, flag: str
) -> None:
    with pytest.raises(RequestError) as info:
        await pre.preprocess_chat(chat(**fields))
    assert info.value.param == param
    assert flag in str(info.value)
    assert work == {"render": 0, "encode": 0}


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
async def test_response_size_bound(
    card: ModelDeploymentCard, smol_tokenizer: Tokenizer, work: dict[str, int], param: str
) -> None:
    """n x max_tokens x (1 + top_logprobs) within --max-response-items; a max_tokens past
    the context is refused for that first."""
    pre = make_pre(card, smol_tokenizer, RequestLimits(max_response_items=10_000))
    fields = {"n": 16, param: 100, "logprobs": True, "top_logprobs": 20}
    with pytest.raises(RequestError) as info:
        await pre.preprocess_chat(chat(**fields))
    assert info.value.param == param
    assert "--max-response-items" in str(info.value)
    with pytest.raises(ContextLengthExceeded):
        await pre.preprocess_chat(chat(**{**fields, param: 8000}))
    with pytest.raises(RequestError) as info:
        await pre.preprocess_completion(completion(n=16, max_tokens=200, logprobs=5))
    assert info.value.param == "max_tokens"
    assert work == {"render": 0, "encode": 0}
    await pre.preprocess_chat(chat(**{**fields, param: 29}))  # 16 x 29 x 21 = 9744


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": ["a"] * 17}, "stop"),
        ({"seed": SEED_MAX, "n": 3}, "seed"),
        ({"stop_token_ids": [49152]}, "stop_token_ids"),
    ],
)
async def test_completion_bounds(
    pre: Preprocessor, work: dict[str, int], fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(RequestError) as info:
        await pre.preprocess_completion(completion(**fields))
    assert info.value.param == param
    assert work["encode"] == 0


async def test_within_bounds_accepted(pre: Preprocessor) -> None:
    out = await pre.preprocess_chat(
        chat(
            stop=[f"s{i}" for i in range(15)] + ["x" * 256],
            stop_token_ids=[0, pre.tokenizer.vocab_size - 1],
            seed=SEED_MAX - 1,
            n=2,
            max_tokens=10,
        )
    )
    assert out.sampling_options.seed == SEED_MAX - 1
    assert out.stop_conditions.stop_token_ids_hidden == [0, pre.tokenizer.vocab_size - 1]


@pytest.mark.parametrize("field", ["seed", "top_k", "min_tokens", "max_tokens", "n"])
def test_big_integers_fail_decoding_naming_the_field(field: str) -> None:
    body = msgspec.json.encode({"model": "m", "messages": [], field: 10**26})
    with pytest.raises(msgspec.ValidationError, match=rf"\$\.{field}"):
        msgspec.json.decode(body, type=ChatCompletionRequest)


async def test_unset_max_tokens_is_capped_by_the_response_budget(
    card: ModelDeploymentCard, smol_tokenizer: Tokenizer
) -> None:
    pre = make_pre(card, smol_tokenizer, RequestLimits(max_response_items=100))
    out = await pre.preprocess_chat(chat(n=2, logprobs=True, top_logprobs=1))
    assert out.stop_conditions.max_tokens == 25  # 100 // (2 choices x (1 + 1))
    out = await pre.preprocess_chat(chat())
    assert out.stop_conditions.max_tokens == 100
    with pytest.raises(RequestError) as info:
        await pre.preprocess_chat(chat(min_tokens=101))
    assert info.value.param == "min_tokens"


async def test_prompt_that_cannot_fit_is_refused_before_the_template(
    pre: Preprocessor, work: dict[str, int]
) -> None:
    """Characters over the longest token already past the context: refused unrendered."""
    per_token = pre.tokenizer.max_token_chars
    text = "a" * (per_token * CTX)
    with pytest.raises(ContextLengthExceeded) as info:
        await pre.preprocess_chat(chat(messages=[{"role": "user", "content": text}]))
    assert info.value.param == "messages"
    assert "at least" in str(info.value)
    with pytest.raises(ContextLengthExceeded):
        await pre.preprocess_completion(completion(prompt=text))
    # Tool calls count too.
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": text}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(ContextLengthExceeded):
        await pre.preprocess_chat(chat(messages=messages))
    assert work == {"render": 0, "encode": 0}


async def test_prompt_near_the_bound_is_tokenized(pre: Preprocessor, work: dict[str, int]) -> None:
    """Under the bound the exact count decides (this one is too long only once tokenized)."""
    text = "word " * (CTX * 2)
    with pytest.raises(ContextLengthExceeded) as info:
        await pre.preprocess_chat(chat(messages=[{"role": "user", "content": text}]))
    assert "at least" not in str(info.value)
    assert work["encode"] == 1


async def test_token_prompt_too_long_is_refused_before_its_ids_are_checked(
    pre: Preprocessor,
) -> None:
    with pytest.raises(ContextLengthExceeded):
        await pre.preprocess_completion(completion(prompt=[10**9] * (CTX + 1)))


def test_max_token_chars(smol_tokenizer: Tokenizer) -> None:
    """The longest token of SmolLM2's vocabulary: a newline and 80 spaces."""
    assert smol_tokenizer.max_token_chars == 81
    longest = smol_tokenizer.encode("\n" + " " * 80)
    assert len(longest) == 1


@pytest.mark.parametrize("name", ["max_stop_strings", "max_response_items"])
def test_limits_must_be_positive(name: str) -> None:
    with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')}"):
        RequestLimits(**{name: 0})
