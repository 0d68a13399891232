"""Each parser on outputs as its model family writes them (one call, with and without the
stop token, with reasoning and preambles), on text that only looks like markup, and on
random marker soup: whole, at every split and in random chunks, never an exception, and
nothing of an output lost that was not recognised as markup."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.llm.parsers.streaming import WEATHER, every_split, run

from turnout.llm.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, make_output_parser

PARIS = '{"city": "Paris", "unit": "celsius"}'

# (tool-call parser, reasoning parser, output, content, reasoning, calls)
OUTPUTS: list[tuple[str | None, str | None, str, str, str, list[tuple[str, Any]]]] = [
    # Qwen2.5-Instruct: one block, the JSON on its own line.
    ("hermes", None,
     f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>',
     "", "", [WEATHER]),
    # Qwen3 thinking, then a call.
    ("hermes", "qwen3",
     "<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n"
     f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>',
     "\n\n", "\nThe user wants the weather in Paris. I should call get_weather.\n", [WEATHER]),
    # Hermes-2-Pro stopped on EOS before the closing tag.
    ("hermes", None, f'<tool_call>\n{{"arguments": {PARIS}, "name": "get_weather"}}\n',
     "", "", [WEATHER]),
    # Llama 3.1 with <|python_tag|>; Llama 3.2 writes the JSON bare, sometimes with a type.
    ("llama3_json", None,
     f'<|python_tag|>{{"name": "get_weather", "parameters": {PARIS}}}', "", "", [WEATHER]),
    ("llama3_json", None,
     f'{{"type": "function", "name": "get_weather", "parameters": {PARIS}}}',
     "", "", [WEATHER]),
    # Mistral-7B-Instruct-v0.3 (a space after the token), Mistral-Small-3.2 (v11, text first).
    ("mistral", None, f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {PARIS}}}]',
     "", "", [WEATHER]),
    ("mistral", None, f"Let me check.[TOOL_CALLS]get_weather[ARGS]{PARIS}",
     "Let me check.", "", [WEATHER]),
    # v11 text where [ARGS] is not a token of the tokenizer; a [CALL_ID] before the arguments.
    ("mistral", None, f"[TOOL_CALLS]get_weather{PARIS}", "", "", [WEATHER]),
    ("mistral", None, f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{PARIS}",
     "", "", [WEATHER]),
    # Llama 3.2 pythonic; Llama 4 inside its python tags.
    ("pythonic", None, '[get_weather(city="Paris", unit="celsius")]', "", "", [WEATHER]),
    ("pythonic", None, "<|python_start|>[get_weather(city='Paris', unit='celsius')]<|python_end|>",
     "", "", [WEATHER]),
    # DeepSeek-V3: one call, the list closed.
    ("deepseek_v3", None,
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
     f"```json\n{PARIS}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "", "", [WEATHER]),
    # gpt-oss: reasoning then a call, with and without the <|call|> stop token in the text.
    ("harmony", "harmony",
     "<|channel|>analysis<|message|>The user asks for the weather in Paris. "
     "We should call get_weather.<|end|><|start|>assistant<|channel|>commentary "
     f"to=functions.get_weather <|constrain|>json<|message|>{PARIS}<|call|>",
     "", "The user asks for the weather in Paris. We should call get_weather.", [WEATHER]),
    ("harmony", None,
     "<|channel|>analysis<|message|>Weather lookup.<|end|><|start|>assistant<|channel|>"
     f"commentary to=functions.get_weather <|constrain|>json<|message|>{PARIS}",
     "", "Weather lookup.", [WEATHER]),
    # gpt-oss: a preamble to the user (commentary without recipient) before the call.
    ("harmony", "harmony",
     "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
     "commentary<|message|>Checking the weather now.<|end|><|start|>assistant<|channel|>"
     f"commentary to=functions.get_weather <|constrain|>json<|message|>{PARIS}<|call|>",
     "Checking the weather now.", "Need weather.", [WEATHER]),
    # gpt-oss: a plain answer.
    (None, "harmony",
     "<|channel|>analysis<|message|>Simple greeting; answer briefly.<|end|><|start|>"
     "assistant<|channel|>final<|message|>Hello! How can I help?<|return|>",
     "Hello! How can I help?", "Simple greeting; answer briefly.", []),
    # DeepSeek-R1-0528 writes the opening tag itself; R1 and Qwen3-Thinking-2507 do not.
    (None, "deepseek_r1", "<think>\nParis is in France.\n</think>\n\nIt is mild in Paris.",
     "\n\nIt is mild in Paris.", "\nParis is in France.\n", []),
    (None, "deepseek_r1", "The user asks about Paris.\n</think>\n\nIt is mild in Paris.",
     "\n\nIt is mild in Paris.", "The user asks about Paris.\n", []),
    # Qwen3 that chose not to think writes an empty block.
    (None, "qwen3", "<think>\n\n</think>\n\nIt is mild in Paris.",
     "\n\nIt is mild in Paris.", "\n\n", []),
]  # fmt: skip


@pytest.mark.parametrize(("tool", "reasoning", "text", "content", "thought", "calls"), OUTPUTS)
def test_recorded_outputs(
    tool: str | None,
    reasoning: str | None,
    text: str,
    content: str,
    thought: str,
    calls: list[tuple[str, Any]],
) -> None:
    result = every_split(text, tool, reasoning)
    assert (result.content, result.reasoning, result.calls) == (content, thought, calls)
    assert result.called == bool(calls)


@pytest.mark.parametrize(
    ("tool", "text", "held"),
    [
        ("hermes", "Wrap it in <tool_", "<tool_"),
        ("mistral", "See the [TOOL", "[TOOL"),
        ("deepseek_v3", "Next: <｜tool▁call", "<｜tool▁call"),
    ],
)
def test_a_partial_marker_is_held_back_then_released_at_the_end(
    tool: str, text: str, held: str
) -> None:
    parser = make_output_parser(
        tool_call_parser=tool, reasoning_parser=None, tools=[{"function": {"name": "f"}}]
    )
    assert parser is not None
    assert parser.feed(text).content == text.removesuffix(held)
    end = parser.finish()
    assert (end.content, end.tool_calls, parser.called_tools) == (held, [], False)


@pytest.mark.parametrize(
    ("tool", "text"),
    [
        ("hermes", "Use <tool> tags, or <tool_call without a bracket, or </tool_call> alone."),
        ("hermes", "Type <tool_call> to start a call, then the JSON."),
        ("mistral", "The [TOOL] field and [TOOL_CALLS are not calls."),
        ("mistral", "Then write [TOOL_CALLS] followed by the calls."),
        ("deepseek_v3", "The <｜tool▁sep｜> token separates name and arguments."),
        ("llama3_json", '{"answer": 42, "unit": "none"}'),
        ("llama3_json", "{not json, just braces}"),
        ("pythonic", "[1, 2, 3] are the first numbers."),
        ("pythonic", "[print(x) for x in range(3)]"),
        ("pythonic", "  [1, 2] after white space, which stays"),
        ("llama3_json", "\n{not json}"),
        ("harmony", "A model that writes no harmony markup <|at all."),
    ],
)
def test_marker_like_prose_is_text(tool: str, text: str) -> None:
    result = every_split(text, tool, "harmony" if tool == "harmony" else None)
    assert (result.content, result.calls, result.called) == (text, [], False)


@pytest.mark.parametrize(
    ("tool", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),
        ("llama3_json", '{"name": "rm_rf", "parameters": {}}'),
        ("mistral", '[TOOL_CALLS] [{"name": "rm_rf", "arguments": {}}]'),
        ("mistral", "[TOOL_CALLS]rm_rf[ARGS]{}"),
        ("pythonic", "[rm_rf()]"),
        ("deepseek_v3", "<｜tool▁call▁begin｜>rm_rf<｜tool▁sep｜>{}<｜tool▁call▁end｜>"),
        ("mistral", "[TOOL_CALLS]get weather[ARGS]{}"),  # a name has no spaces
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} and more'),
        ("llama3_json", '{"name": "get_weather", "parameters": {}} trailing words'),
    ],
)
def test_calls_to_unknown_functions_and_leftovers_are_text(tool: str, text: str) -> None:
    result = every_split(text, tool)
    assert (result.content, result.calls, result.called) == (text, [], False)


def test_a_good_call_then_a_bad_one() -> None:
    text = (
        f'<tool_call>{{"name": "get_weather", "arguments": {PARIS}}}</tool_call>'
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    )
    result = every_split(text, "hermes")
    assert result.calls == [WEATHER]
    assert result.content == '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'


def test_harmony_channels_are_read_without_tools_too() -> None:
    """gpt-oss's markup is never the answer, whichever harmony parser the card names."""
    text = (
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Answer."
    )
    for names in (("harmony", None), (None, "harmony")):
        result = every_split(text, *names, tools=None)
        assert (result.reasoning, result.content, result.calls) == ("Think.", "Answer.", [])
    parser = make_output_parser(tool_call_parser="harmony", reasoning_parser=None, tools=[])
    assert parser is not None and parser.needs_special_tokens
    # A call with no tools offered is not a call.
    call = f"<|channel|>commentary to=functions.get_weather<|message|>{PARIS}<|call|>"
    assert every_split(call, "harmony", tools=None).calls == []


def test_the_parsers_that_need_special_tokens_say_so() -> None:
    needs = {}
    for name in TOOL_CALL_PARSERS:
        parser = make_output_parser(
            tool_call_parser=name, reasoning_parser=None, tools=[{"function": {"name": "f"}}]
        )
        assert parser is not None
        needs[name] = parser.needs_special_tokens
    # Their markup is special tokens that a default detokenization would drop.
    assert needs["mistral"] and needs["deepseek_v3"] and needs["harmony"]
    # These read the same either way: the JSON or list stays when <|python_tag|> goes.
    assert not needs["llama3_json"] and not needs["pythonic"]


def test_no_parser_means_the_fast_path() -> None:
    assert make_output_parser(tool_call_parser=None, reasoning_parser=None, tools=None) is None
    assert make_output_parser(tool_call_parser="mistral", reasoning_parser=None, tools=[]) is None


# ---------------------------------------------------------------- marker soup

PIECES = [
    "<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[TOOL", "[ARGS]", "[CALL_ID]",
    "<|python_tag|>", "<|python_start|>", "<|python_end|>", "[", "]", "{", "}", '"name"', ":",
    '"get_time"', '"arguments"', '"parameters"', "{}", ";", ",", " ", "\n", "a", "get_time(",
    "tz='UTC'", ")", "<think>", "</think>", "<th", "<|channel|>", "<|message|>", "<|end|>",
    "<|start|>", "<|call|>", "analysis", "final", "commentary to=functions.get_time",
    "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
    "function", "```json", "```",
]  # fmt: skip
COMBOS = [
    *((name, None) for name in TOOL_CALL_PARSERS),
    *((None, name) for name in REASONING_PARSERS),
    ("hermes", "qwen3"),
    ("hermes", "deepseek_r1"),
    ("mistral", "deepseek_r1"),
]
#: Parsers whose every character of an output without calls is answer text.
KEEPS_ALL_TEXT = ("hermes", "llama3_json", "mistral", "pythonic")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.sampled_from(PIECES), max_size=16).map("".join),
    st.lists(st.integers(0, 300), max_size=8),
    st.sampled_from(COMBOS),
)
def test_marker_soup_parses_the_same_in_any_chunks_and_loses_nothing(
    text: str, cuts: list[int], combo: tuple[str | None, str | None]
) -> None:
    tool, reasoning = combo
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    whole = run([text], tool, reasoning)  # no exception, and calls' arguments are JSON
    parts = run(chunks, tool, reasoning)
    assert (parts.content, parts.reasoning, parts.calls) == (
        whole.content,
        whole.reasoning,
        whole.calls,
    )
    if reasoning is None and tool in KEEPS_ALL_TEXT and not whole.calls:
        assert whole.content == text
    if tool is None and reasoning == "qwen3" and "<think>" not in text:
        # Without an opening marker there is no reasoning: every character is answer text (an
        # empty think block, even one never closed, is consumed: Qwen3's "no thinking" form).
        assert whole.content == text
