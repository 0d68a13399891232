"""The output stage between the decoder and the writers: pieces, finish reasons, and the
chunks and bodies they become, checked against the openai client's types."""

from __future__ import annotations

import json
from typing import Any

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from turnout.frontend.openai.choice_output import ChoiceOutput
from turnout.frontend.openai.chunk_writer import ChunkWriter, make_usage, whole_response
from turnout.llm.backend import DecodedDelta
from turnout.llm.parsers.forced import NamedToolOutput, RequiredToolsOutput
from turnout.protocols.llm import FinishReason

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def _chunk(raw: bytes) -> ChatCompletionChunk:
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    return ChatCompletionChunk.model_validate(json.loads(raw[6:]), strict=True)


def _stream(output: ChoiceOutput, texts: list[str]) -> list[ChatCompletionChunk]:
    writer = ChunkWriter("m", True)
    chunks = []
    for text in texts:
        piece = output.take(DecodedDelta(text, [1]))
        if piece:
            chunks.append(_chunk(writer.piece(piece)))
    tail = output.end()
    if tail:
        chunks.append(_chunk(writer.piece(tail)))
    chunks.append(_chunk(writer.finish(output.finish_reason(FinishReason.EOS))))
    return chunks


def test_plain_output_is_text_and_keeps_the_fast_path() -> None:
    output = ChoiceOutput(None, None)
    assert output.plain
    for text in ("Hel", "lo"):
        output.take(DecodedDelta(text, [1]))
    whole = output.whole(FinishReason.EOS, prefix=">")
    assert (whole.text, whole.finish_reason, whole.tool_calls) == (">Hello", "stop", [])


def test_a_named_tool_streams_its_arguments_as_one_call() -> None:
    output = ChoiceOutput(NamedToolOutput("get_weather"), None)
    assert not output.plain
    chunks = _stream(output, ['{"city"', ': "Paris"}'])
    calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
    assert calls[0].id and calls[0].type == "function"
    assert calls[0].function is not None and calls[0].function.name == "get_weather"
    assert all(c.index == 0 and c.id is None for c in calls[1:])
    args = "".join((c.function.arguments or "") for c in calls if c.function)
    assert json.loads(args) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tools_read_the_array_at_the_end() -> None:
    output = ChoiceOutput(RequiredToolsOutput(TOOLS), None)
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    for part in (text[:10], text[10:]):
        assert not output.take(DecodedDelta(part, [1]))
    output.end()
    whole = output.whole(FinishReason.EOS)
    body = whole_response(model="m", is_chat=True, choices=[whole], usage=make_usage(3, 4, None))
    response = ChatCompletion.model_validate(json.loads(body), strict=True)
    message = response.choices[0].message
    assert message.content is None
    assert response.choices[0].finish_reason == "tool_calls"
    calls = message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}  # type: ignore[union-attr]
    assert len({c.id for c in calls}) == 2


def test_required_tools_output_that_is_not_calls_is_text() -> None:
    for text in ('[{"name": "nope", "parameters": {}}]', '[{"name": "get_time"', "[]", "{}"):
        output = ChoiceOutput(RequiredToolsOutput(TOOLS), None)
        output.take(DecodedDelta(text, [1]))
        output.end()
        whole = output.whole(FinishReason.LENGTH)
        assert (whole.text, whole.tool_calls, whole.finish_reason) == (text, [], "length")


def test_a_length_cut_is_length_even_after_a_call() -> None:
    output = ChoiceOutput(NamedToolOutput("get_weather"), None)
    output.take(DecodedDelta('{"ci', [1]))
    assert output.finish_reason(FinishReason.LENGTH) == "length"
    assert output.finish_reason(FinishReason.STOP) == "tool_calls"


def test_reasoning_and_content_pieces_become_delta_fields() -> None:
    from turnout.frontend.openai.choice_output import ChoicePiece

    writer = ChunkWriter("m", True)
    raw = writer.piece(ChoicePiece(content="", reasoning="hmm"))
    data: dict[str, Any] = json.loads(raw[6:])
    assert data["choices"][0]["delta"] == {"reasoning_content": "hmm"}
    _chunk(raw)


def test_harmony_parses_channels_even_without_tools() -> None:
    from turnout.frontend.openai.choice_output import output_parser
    from turnout.protocols.model import ModelCapabilities

    caps = ModelCapabilities(tool_call_parser="harmony")
    parser = output_parser(caps, None, None)
    assert parser is not None
    text = (
        "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>hi"
    )
    out = parser.feed(text)
    tail = parser.finish()
    assert (out.reasoning + tail.reasoning, out.content + tail.content) == ("think", "hi")
    assert output_parser(ModelCapabilities(tool_call_parser="hermes"), None, None) is None
