"""Tool-call and reasoning parsers on outputs as their model families write them: whole,
streamed split at every character, and in random chunks, always to the same result; and
malformed outputs, which come back as text."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.llm.parsers.streaming import TIME, TOOLS, WEATHER, every_split, run

from turnout.llm.parsers import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    check_parser_names,
    make_output_parser,
)

# ---------------------------------------------------------------- recorded-style outputs

HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "Europe/Oslo"}}\n</tool_call>'
)
LLAMA3_JSON = (
    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
    '{"name": "get_time", "parameters": {"tz": "Europe/Oslo"}}'
)
MISTRAL_V03 = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
    '{"name": "get_time", "arguments": {"tz": "Europe/Oslo"}}]'
)
MISTRAL_V11 = (
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
    '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Oslo"}'
)
PYTHONIC = '[get_weather(city="Paris", unit="celsius"), get_time(tz="Europe/Oslo")]'
DEEPSEEK_V3 = (
    "I'll look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n'
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
    '```json\n{"tz": "Europe/Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
DEEPSEEK_V31 = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris", "unit": "celsius"}<｜tool▁call▁end｜>'
    '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "Europe/Oslo"}<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>"
)
HARMONY = (
    "<|channel|>analysis<|message|>User wants weather and time. Call tools.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "unit": "celsius"}<|call|>'
    "<|start|>assistant to=functions.get_time<|channel|>commentary json"
    '<|message|>{"tz": "Europe/Oslo"}<|call|>'
)


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [
        ("hermes", HERMES, "Let me check.\n"),
        ("llama3_json", LLAMA3_JSON, ""),
        ("llama3_json", "<|python_tag|>" + LLAMA3_JSON, ""),
        ("mistral", MISTRAL_V03, ""),
        ("mistral", MISTRAL_V11, ""),
        ("pythonic", PYTHONIC, ""),
        ("pythonic", "<|python_start|>" + PYTHONIC + "<|python_end|>", ""),
        ("deepseek_v3", DEEPSEEK_V3, "I'll look."),
        ("deepseek_v3", DEEPSEEK_V31, ""),
        ("harmony", HARMONY, ""),
    ],
)
def test_two_calls_in_each_format(parser: str, text: str, content: str) -> None:
    result = every_split(text, parser, "harmony" if parser == "harmony" else None)
    assert result.calls == [WEATHER, TIME]
    assert result.content == content
    assert result.called
    assert len(set(result.ids)) == 2 and all(i.startswith("call_") for i in result.ids)
    if parser == "harmony":
        assert result.reasoning == "User wants weather and time. Call tools."


@pytest.mark.parametrize("parser", sorted(set(TOOL_CALL_PARSERS)))
def test_plain_answers_stream_as_text(parser: str) -> None:
    text = "The weather in Paris is mild; use [brackets] or {braces} and <tags> freely."
    if parser in ("llama3_json", "pythonic"):
        text = "Sure. " + text  # these formats own only outputs that open with JSON / a list
    result = every_split(text, parser)
    assert (result.content, result.calls, result.called) == (text, [], False)


def test_text_streams_before_the_markup_is_complete() -> None:
    parser = make_output_parser(tool_call_parser="hermes", reasoning_parser=None, tools=TOOLS)
    assert parser is not None
    assert parser.feed("Hello <to").content == "Hello "
    assert parser.feed("ol_call>{").content == ""
    assert parser.feed('"name": "get_time", "arguments": {}}</tool_call>').tool_calls[0].name
    assert parser.finish().content == ""


# ---------------------------------------------------------------- malformed outputs


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
        ("hermes", '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'),
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>'),
        ("hermes", "<tool_call>not json at all"),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),
        ("llama3_json", '{"title": "not a call"}'),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": '),
        ("mistral", "[TOOL_CALLS]get_weather[ARGS]{oops"),
        ("pythonic", "[get_weather(city=some_variable)]"),
        ("pythonic", "[get_weather('Paris')]"),
        ("pythonic", "[1, 2, 3]"),
        ("pythonic", "[get_weather(city="),
        ("deepseek_v3", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{bad"),
        ("deepseek_v3", "<｜tool▁call▁begin｜>no separator here<｜tool▁call▁end｜>"),
        ("harmony", '<|channel|>commentary to=functions.get_weather<|message|>{"city": '),
        ("harmony", "<|channel|>commentary to=functions.nope<|message|>{}<|end|>"),
    ],
)
def test_malformed_calls_come_back_as_text(parser: str, text: str) -> None:
    result = every_split(text, parser)
    assert result.calls == [] and not result.called
    assert result.content  # nothing is lost silently


def test_an_unclosed_block_that_parses_is_a_call() -> None:
    result = every_split('<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}', "hermes")
    assert result.calls == [("get_time", {"tz": "UTC"})]


def test_arguments_written_as_a_json_string_are_read() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    assert every_split(text, "hermes").calls == [("get_time", {"tz": "UTC"})]


def test_no_tools_offered_means_no_tool_parsing() -> None:
    assert make_output_parser(tool_call_parser="hermes", reasoning_parser=None, tools=[]) is None
    parser = make_output_parser(tool_call_parser="hermes", reasoning_parser="qwen3", tools=None)
    assert parser is not None
    assert parser.feed(HERMES).content == HERMES  # reasoning only: the markup is text


# ---------------------------------------------------------------- reasoning

R1 = "Paris is in France; weather there is mild.\n</think>\n\nIt is mild in Paris."
QWEN3 = "<think>\nThe user asks about Paris.\n</think>\n\nIt is mild in Paris."


def test_deepseek_r1_starts_inside_the_reasoning() -> None:
    result = every_split(R1, reasoning="deepseek_r1")
    assert result.reasoning == "Paris is in France; weather there is mild.\n"
    assert result.content == "\n\nIt is mild in Paris."
    # An opening tag the model writes anyway is not part of the reasoning.
    assert every_split("<think>" + R1, reasoning="deepseek_r1").reasoning == result.reasoning
    # Cut off while thinking: all reasoning.
    cut = every_split("Still thinking about", reasoning="deepseek_r1")
    assert (cut.reasoning, cut.content) == ("Still thinking about", "")


def test_qwen3_reasons_only_when_it_opens_the_tag() -> None:
    result = every_split(QWEN3, reasoning="qwen3")
    assert result.reasoning == "\nThe user asks about Paris.\n"
    assert result.content == "\n\nIt is mild in Paris."
    plain = every_split("No thinking here. </think> stays.", reasoning="qwen3")
    assert (plain.reasoning, plain.content) == ("", "No thinking here. </think> stays.")
    short = every_split("<thi", reasoning="qwen3")
    assert (short.reasoning, short.content) == ("", "<thi")


def test_reasoning_then_a_tool_call() -> None:
    text = QWEN3.replace("It is mild in Paris.", HERMES)
    result = every_split(text, "hermes", "qwen3")
    assert result.reasoning == "\nThe user asks about Paris.\n"
    assert result.content == "\n\nLet me check.\n"
    assert result.calls == [WEATHER, TIME]


def test_harmony_reasoning_and_final_answer() -> None:
    text = (
        "<|channel|>analysis<|message|>Simple question.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello there!"
    )
    result = every_split(text, reasoning="harmony")
    assert (result.reasoning, result.content, result.calls) == (
        "Simple question.",
        "Hello there!",
        [],
    )
    # Without markup, the text is the answer.
    assert every_split("just text", reasoning="harmony").content == "just text"


# ---------------------------------------------------------------- random chunkings

SAMPLES = [
    ("hermes", None, HERMES),
    ("llama3_json", None, LLAMA3_JSON),
    ("mistral", None, MISTRAL_V11),
    ("pythonic", None, PYTHONIC),
    ("deepseek_v3", None, DEEPSEEK_V3),
    ("harmony", "harmony", HARMONY),
    ("hermes", "qwen3", QWEN3.replace("It is mild in Paris.", HERMES)),
    (None, "deepseek_r1", R1),
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SAMPLES), st.lists(st.integers(0, 400), max_size=12))
def test_any_chunking_gives_the_whole_result(sample: Any, cuts: list[int]) -> None:
    tool, reasoning, text = sample
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    whole = run([text], tool, reasoning)
    parts = run(chunks, tool, reasoning)
    assert (parts.content, parts.reasoning, parts.calls) == (
        whole.content,
        whole.reasoning,
        whole.calls,
    )


# ---------------------------------------------------------------- names


def test_parser_names() -> None:
    check_parser_names("hermes", "qwen3")
    check_parser_names(None, None)
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'nope' \(known: .*hermes"):
        check_parser_names("nope", None)
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'"):
        check_parser_names(None, "r2")
    assert "harmony" in TOOL_CALL_PARSERS and "harmony" in REASONING_PARSERS
