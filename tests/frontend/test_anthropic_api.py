"""Anthropic's ``/v1/messages`` and ``count_tokens`` through the official ``anthropic`` client
against a real stack: text, system, tool history, streamed events, stop reasons, refusals in
Anthropic's error shape, a client that leaves (every body and event checked strictly against
the anthropic types by the suite's conformance hook)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter
from tests.frontend.stack import Stack

from turnout.frontend.anthropic_api import MessageWriter
from turnout.frontend.choice_output import ChoicePiece
from turnout.frontend.responses import make_usage
from turnout.llm.parsers import ToolCallDelta

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL: Any = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture
def stack(whole_prompt_stack: Stack) -> Stack:
    return whole_prompt_stack


def client(stack: Stack) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=stack.url, api_key="x", max_retries=0)


def text_of(message: Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


async def test_a_message_with_a_system_prompt(stack: Stack) -> None:
    api = client(stack)
    out = await api.messages.create(
        model="echo", max_tokens=500, system="Be brief.",
        messages=[{"role": "user", "content": "Hello there"}],
    )  # fmt: skip
    assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_")
    text = text_of(out)
    assert "system: Be brief." in text and "user: Hello there" in text
    assert out.stop_reason == "end_turn" and out.stop_sequence is None
    assert out.usage.input_tokens > 0 and out.usage.output_tokens > 0
    await api.close()


async def test_tool_history_is_translated(stack: Stack) -> None:
    api = client(stack)
    out = await api.messages.create(
        model="echo", max_tokens=800,
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "dropped", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "text", "text": "Thanks!"},
            ]},
        ],
    )  # fmt: skip
    text = text_of(out)
    assert 'assistant: Checking.[{"id": "toolu_1"' in text.replace("\n", "")
    assert "tool: sunny" in text and "user: Thanks!" in text and "dropped" not in text
    await api.close()


async def test_streamed_events_and_the_stream_helper(stack: Stack) -> None:
    api = client(stack)
    stream = await api.messages.create(
        model="echo", max_tokens=300, stream=True,
        messages=[{"role": "user", "content": "Stream me"}],
    )  # fmt: skip
    kinds, text = [], ""
    async for event in stream:
        kinds.append(event.type)
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            text += event.delta.text
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "user: Stream me" in text
    async with api.messages.stream(
        model="echo", max_tokens=300, messages=[{"role": "user", "content": "helper"}]
    ) as helper:
        final = await helper.get_final_message()
    assert "user: helper" in text_of(final) and final.stop_reason == "end_turn"
    await api.close()


async def test_stop_reasons(stack: Stack) -> None:
    api = client(stack)
    short = await api.messages.create(
        model="echo", max_tokens=3, messages=[{"role": "user", "content": "a b c d e f"}]
    )
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    stopped = await api.messages.create(
        model="echo", max_tokens=300, stop_sequences=["HALT", "Zebra"],
        messages=[{"role": "user", "content": "go go HALT never"}],
    )  # fmt: skip
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "HALT"
    assert "never" not in text_of(stopped)
    await api.close()


async def test_a_tool_call_is_a_tool_use_block(stack: Stack) -> None:
    api = client(stack)
    out = await api.messages.create(
        model="tools", max_tokens=500, tools=[TOOL],
        messages=[{"role": "user", "content": "Weather? " + CALL}],
    )  # fmt: skip
    uses = [b for b in out.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    assert uses[0].input == {"city": "Paris"} and uses[0].id.startswith("toolu_")
    assert out.stop_reason == "tool_use"
    stream = await api.messages.create(
        model="tools", max_tokens=500, tools=[TOOL], stream=True,
        messages=[{"role": "user", "content": "Weather? " + CALL}],
    )  # fmt: skip
    partial = ""
    async for event in stream:
        if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
            partial += event.delta.partial_json
    assert json.loads(partial) == {"city": "Paris"}
    await api.close()


async def test_count_tokens_matches_the_usage(stack: Stack) -> None:
    api = client(stack)
    messages: Any = [{"role": "user", "content": "Count these words please"}]
    counted = await api.messages.count_tokens(model="echo", system="sys", messages=messages)
    out = await api.messages.create(model="echo", max_tokens=5, system="sys", messages=messages)
    assert counted.input_tokens == out.usage.input_tokens > 0
    await api.close()


@pytest.mark.parametrize(
    ("body", "status", "kind", "says"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error",
         "max_tokens"),
        ({"max_tokens": 5, "messages": [], "bogus": 1}, 400, "invalid_request_error", "bogus"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AA=="}}]}]},
         400, "invalid_request_error", "image"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         400, "invalid_request_error", "web_search"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
          "thinking": {"type": "enabled", "budget_tokens": 2048}},
         400, "invalid_request_error", "thinking"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, 400,
         "invalid_request_error", "messages[0].role"),
        ({"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
         404, "not_found_error", "nope"),
    ],
)  # fmt: skip
async def test_refusals_have_anthropic_errors(
    stack: Stack, body: dict[str, Any], status: int, kind: str, says: str
) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        r = await http.post("/v1/messages", json={"model": "echo", **body})
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert says in error["error"]["message"]


async def test_the_client_raises_its_own_errors(stack: Stack) -> None:
    api = client(stack)
    with pytest.raises(anthropic.NotFoundError):
        await api.messages.create(
            model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    await api.close()


def test_the_writer_orders_thinking_text_and_tool_use() -> None:
    writer = MessageWriter("m", stream=True)
    writer.start(5)
    for piece in (
        ChoicePiece(reasoning="Hmm, "),
        ChoicePiece(reasoning="weather."),
        ChoicePiece(content="Let me look."),
        ChoicePiece(tool_calls=[ToolCallDelta(0, "call_a", "get_weather", '{"city": ')]),
        ChoicePiece(tool_calls=[ToolCallDelta(0, arguments='"Rome"}')]),
        ChoicePiece(tool_calls=[ToolCallDelta(1, "call_b", "get_weather", '{"city": "Nice"')]),
    ):
        writer.add(piece)
    final = writer.finish("tool_calls", None, make_usage(5, 9, 3))
    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    assert writer.events is not None
    kinds = []
    for raw in writer.events:
        head, data = raw.decode().split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == "event: " + event["type"]
        adapter.validate_python(event, strict=True)
        kinds.append(event["type"])
    message = Message.model_validate(final, strict=True)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "text"]
    assert message.content[0].thinking == "Hmm, weather."  # type: ignore[union-attr]
    assert message.content[2].input == {"city": "Rome"}  # type: ignore[union-attr]
    # Arguments that never close (cut by the limit) come back as text, not a broken call.
    assert message.content[3].text == '{"city": "Nice"'  # type: ignore[union-attr]
    assert message.stop_reason == "tool_use" and message.usage.cache_read_input_tokens == 3
    assert kinds.count("content_block_start") == 4 and kinds[-1] == "message_stop"


async def test_a_tool_round_trip_renders_with_the_models_own_template(echo_stack: Stack) -> None:
    api = anthropic.AsyncAnthropic(base_url=echo_stack.url, api_key="x", max_retries=0)
    out = await api.messages.create(
        model="echo", max_tokens=5,
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
        ],
    )  # fmt: skip
    assert out.type == "message"
    await api.close()
