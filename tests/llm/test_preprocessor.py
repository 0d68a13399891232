"""The preprocessor: OpenAI requests to token-level requests, and every rejection rule."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest

from turnout.errors import ContextLengthExceeded, RequestError
from turnout.llm import preprocessor as pp_module
from turnout.llm.chat_template import ChatTemplate
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
    # An engine that can do what these tests ask (the refusals are tested with a bare card).
    caps = ModelCapabilities(logprobs=True, max_top_logprobs=5, min_tokens=True)
    return msgspec.structs.replace(card, capabilities=caps)


@pytest.fixture(scope="module")
def pre(card: ModelDeploymentCard, smol_tokenizer: Tokenizer) -> Preprocessor:
    assert card.chat_template is not None
    template = ChatTemplate(card.chat_template, card.bos_token, card.eos_token)
    return Preprocessor(card, smol_tokenizer, template)


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


def completion(**fields: Any) -> CompletionRequest:
    return msgspec.convert({"model": "smol", "prompt": "Hello", **fields}, CompletionRequest)


async def test_chat_basic(pre: Preprocessor, smol_tokenizer: Tokenizer) -> None:
    out = await pre.preprocess_chat(chat(stop="END", temperature=0.5, seed=3))
    text = smol_tokenizer.decode(out.token_ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert out.token_ids[0] == 1  # <|im_start|> as one special token
    assert out.stop_conditions.stop == ["END"]
    assert out.stop_conditions.max_tokens == CTX - len(out.token_ids)
    assert out.sampling_options.temperature == 0.5
    assert out.sampling_options.seed == 3
    assert out.eos_token_ids == [2]
    assert out.mdc_sum == pre.card.checksum()
    assert out.model == "smol"
    assert out.output_options.skip_special_tokens is True


async def test_chat_options(pre: Preprocessor) -> None:
    out = await pre.preprocess_chat(
        chat(
            max_tokens=10,
            max_completion_tokens=20,
            min_tokens=2,
            stop=["a", "", "b"],
            stop_token_ids=[5],
            top_k=40,
            logprobs=True,
            top_logprobs=3,
            skip_special_tokens=False,
            nvext={
                "ignore_eos": True,
                "backend_instance_id": 42,
            },
        )
    )
    sc = out.stop_conditions
    assert sc.max_tokens == 20  # max_completion_tokens wins
    assert (sc.min_tokens, sc.stop, sc.stop_token_ids_hidden, sc.ignore_eos) == (
        2,
        ["a", "b"],
        [5],
        True,
    )
    assert out.sampling_options.top_k == 40
    assert out.output_options.logprobs == 3
    assert out.output_options.skip_special_tokens is False
    assert out.backend_instance_id == 42


async def test_top_level_ignore_eos(pre: Preprocessor) -> None:
    out = await pre.preprocess_chat(chat(ignore_eos=True))
    assert out.stop_conditions.ignore_eos is True
    out = await pre.preprocess_chat(chat())
    assert out.stop_conditions.ignore_eos is False


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"n": 17}, "n"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.[0].content",
        ),
    ],
)
async def test_chat_rejections(pre: Preprocessor, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as info:
        await pre.preprocess_chat(chat(**fields))
    assert type(info.value) is RequestError
    assert info.value.param == param


@pytest.mark.parametrize("ok", [{"temperature": 0}, {"temperature": 2}, {"top_p": 1}, {"n": 1}])
async def test_chat_boundaries_accepted(pre: Preprocessor, ok: dict[str, Any]) -> None:
    await pre.preprocess_chat(chat(**ok))


async def test_prompt_too_long(pre: Preprocessor) -> None:
    long_text = "word " * (CTX + 10)
    with pytest.raises(ContextLengthExceeded) as info:
        await pre.preprocess_chat(chat(messages=[{"role": "user", "content": long_text}]))
    assert str(info.value).startswith(f"This model's maximum context length is {CTX} tokens.")
    assert "However, your prompt has" in str(info.value)
    assert info.value.param == "messages"


async def test_prompt_plus_max_tokens_too_long(pre: Preprocessor) -> None:
    fits = await pre.preprocess_completion(completion(max_tokens=CTX - 1))
    assert len(fits.token_ids) == 1
    with pytest.raises(ContextLengthExceeded, match=r"you requested 257 tokens \(1 in the prompt"):
        await pre.preprocess_completion(completion(max_tokens=CTX))


async def test_prompt_exactly_context_length(pre: Preprocessor) -> None:
    with pytest.raises(ContextLengthExceeded, match=f"your prompt has {CTX} tokens"):
        await pre.preprocess_completion(completion(prompt=[5] * CTX))
    out = await pre.preprocess_completion(completion(prompt=[5] * (CTX - 1)))
    assert out.stop_conditions.max_tokens == 1


async def test_no_template(card: ModelDeploymentCard, smol_tokenizer: Tokenizer) -> None:
    with pytest.raises(RequestError, match="no chat template"):
        await Preprocessor(card, smol_tokenizer, None).preprocess_chat(chat())


async def test_template_exception(card: ModelDeploymentCard, smol_tokenizer: Tokenizer) -> None:
    strict = ChatTemplate("{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(RequestError, match=r"^Conversation roles must alternate$"):
        await Preprocessor(card, smol_tokenizer, strict).preprocess_chat(chat())


# ------------------------------------------------------------------ completions


@pytest.mark.parametrize("prompt", ["Hello world", ["Hello world"], [19556, 905], [[19556, 905]]])
async def test_completion_prompt_shapes(pre: Preprocessor, prompt: Any) -> None:
    out = await pre.preprocess_completion(completion(prompt=prompt))
    assert out.token_ids == [19556, 905]


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (["a", "b"], "batched prompts are not supported"),
        ([[1], [2]], "batched prompts are not supported"),
        ("", "must not be empty"),
        ([], "must not be empty"),
        ([[]], "non-empty lists of integers"),
        ([1, "a"], "must be a string, a list of strings"),
        ([99999999], "out of range"),
        ([-1], "out of range"),
    ],
)
async def test_completion_prompt_rejections(pre: Preprocessor, prompt: Any, match: str) -> None:
    with pytest.raises(RequestError, match=match) as info:
        await pre.preprocess_completion(completion(prompt=prompt))
    assert info.value.param == "prompt"


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"), ({"max_tokens": 0}, "max_tokens")],
)
async def test_completion_rejections(pre: Preprocessor, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as info:
        await pre.preprocess_completion(completion(**fields))
    assert info.value.param == param


async def test_completion_logprobs(pre: Preprocessor) -> None:
    out = await pre.preprocess_completion(completion(logprobs=2))
    assert out.output_options.logprobs == 2


# ------------------------------------------------------------------ offloading


class RecordingTokenizer(Tokenizer):
    """The real tokenizer, noting which thread each encode ran on."""

    __slots__ = ("threads",)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.threads.append(threading.get_ident())
        return super().encode(text, add_special_tokens)


async def test_long_prompts_leave_the_event_loop(
    card: ModelDeploymentCard, pre: Preprocessor, smol_tokenizer: Tokenizer
) -> None:
    tok = RecordingTokenizer(
        smol_tokenizer.inner, sha256=smol_tokenizer.sha256, size=smol_tokenizer.size
    )
    tok.threads = []
    big = msgspec.structs.replace(card, context_length=100_000)
    recording = Preprocessor(big, tok, pre.template)
    loop_thread = threading.get_ident()
    long_prompt = "x" * (pp_module.OFFLOAD_THRESHOLD_CHARS + 1)
    await recording.preprocess_completion(completion(prompt="short"))
    await recording.preprocess_completion(completion(prompt=long_prompt, max_tokens=1))
    await recording.preprocess_chat(chat(messages=[{"role": "user", "content": "hi"}]))
    await recording.preprocess_chat(chat(messages=[{"role": "user", "content": "y " * 5000}]))
    assert tok.threads[0] == tok.threads[2] == loop_thread
    assert tok.threads[1] != loop_thread
    assert tok.threads[3] != loop_thread


# ------------------------------------------------------------------- capabilities


@pytest.fixture(scope="module")
def bare(card: ModelDeploymentCard, smol_tokenizer: Tokenizer) -> Preprocessor:
    """A model whose engine declares nothing beyond plain sampling."""
    plain = msgspec.structs.replace(card, capabilities=ModelCapabilities())
    assert plain.chat_template is not None
    template = ChatTemplate(plain.chat_template, plain.bos_token, plain.eos_token)
    return Preprocessor(plain, smol_tokenizer, template)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"logprobs": True}, "logprobs", "cannot return log probabilities"),
        ({"logprobs": True, "top_logprobs": 2}, "top_logprobs", "log probabilities"),
        ({"min_tokens": 3}, "min_tokens", "cannot honour 'min_tokens'"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias", "no engine applies it"),
        ({"response_format": {"type": "json_object"}}, "response_format", "json_object"),
        ({"tools": [TOOL]}, "tools", "no tool-call parser"),
        ({"tool_choice": "auto"}, "tool_choice", "only allowed when 'tools'"),
    ],
)
async def test_what_the_engine_cannot_do_is_a_400_naming_it(
    bare: Preprocessor, fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(RequestError, match=words) as info:
        await bare.preprocess_chat(chat(**fields))
    assert info.value.param == param


async def test_what_needs_no_capability_still_passes(bare: Preprocessor) -> None:
    out = await bare.preprocess_chat(
        chat(response_format={"type": "text"}, tools=[TOOL], tool_choice="none", min_tokens=0)
    )
    assert out.token_ids
    with pytest.raises(RequestError, match="log probabilities"):
        await bare.preprocess_completion(completion(logprobs=1))


async def test_more_alternatives_than_the_engine_returns_is_a_400(pre: Preprocessor) -> None:
    with pytest.raises(RequestError, match="at most 5 alternatives") as info:
        await pre.preprocess_chat(chat(logprobs=True, top_logprobs=6))
    assert info.value.param == "top_logprobs"


@pytest.mark.parametrize("body", [{"store": True}, {"nvext": {"priorty": 1}}])
def test_unknown_fields_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"model": "m", "prompt": "x", **body}, CompletionRequest)
