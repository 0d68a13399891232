"""Anthropic's ``/v1/messages`` and ``count_tokens`` through the official ``anthropic`` client
against a real stack: text, system, tool history, streamed events, stop reasons, refusals in
Anthropic's error shape, a client that leaves (every body and event checked strictly against
the anthropic types by the suite's conformance hook)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter
from tests.frontend.stack import Stack, WholePromptEcho, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.mocker import MockerConfig, make_mocker_engines
from turnout.frontend.anthropic.api import MessageWriter
from turnout.frontend.openai.choice_output import ChoicePiece
from turnout.frontend.openai.chunk_writer import make_usage
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
        # Unknown fields are refused at every depth, never accepted and ignored.
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi", "bogus": 1}]}]},
         400, "invalid_request_error", "messages[0].content[0].bogus"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "r", "whatever": 2}]}]},
         400, "invalid_request_error", "whatever"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
          "tools": [{**TOOL, "defer_loading": True}], "tool_choice": {"type": "none"}},
         400, "invalid_request_error", "defer_loading"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
          "tool_choice": {"type": "none", "extra": 1}},
         400, "invalid_request_error", "tool_choice.extra"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
          "metadata": {"user_id": "u", "session": "s"}},
         400, "invalid_request_error", "metadata.session"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
          "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
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


async def test_count_tokens_with_tools_needs_no_tool_call_parser(stack: Stack) -> None:
    """Counting runs nothing, so a model that could not parse a call still counts a prompt
    with tools: what the same request, tools passed as context, reports."""
    api = client(stack)
    messages: Any = [{"role": "user", "content": "Weather in Oslo?"}]
    counted = await api.messages.count_tokens(model="echo", tools=[TOOL], messages=messages)
    out = await api.messages.create(
        model="echo", max_tokens=5, tools=[TOOL], tool_choice={"type": "none"}, messages=messages
    )
    assert counted.input_tokens == out.usage.input_tokens > 0
    await api.close()


async def test_cached_prompt_tokens_are_not_counted_twice(gguf_path: str) -> None:
    """Anthropic's accounting: input + cache read = the prompt (what count_tokens says)."""
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    config = MockerConfig(num_gpu_blocks=256, block_size=16, speedup_ratio=0)
    await stack.add_worker(
        make_mocker_engines(config, 1, model_path=gguf_path)[0], model_name="mock"
    )
    await stack.wait_for_model("mock")
    api = client(stack)
    try:
        messages: Any = [{"role": "user", "content": "word " * 200}]
        prompt = (await api.messages.count_tokens(model="mock", messages=messages)).input_tokens
        first = await api.messages.create(model="mock", max_tokens=4, messages=messages)
        assert first.usage.input_tokens == prompt
        async with api.messages.stream(model="mock", max_tokens=4, messages=messages) as again:
            second = await again.get_final_message()
        usage = second.usage
        assert usage.cache_read_input_tokens and usage.cache_read_input_tokens > 0
        assert usage.input_tokens + usage.cache_read_input_tokens == prompt
    finally:
        await api.close()
        await stack.close()
    await assert_no_leaked_tasks(before)


async def test_thinking_blocks_from_a_reasoning_model(gguf_path: str) -> None:
    """A model with a reasoning parser answers with a thinking block (empty signature) then
    text, whole and streamed; it cannot be told not to think when its template has no
    switch for it."""
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    await stack.add_worker(
        WholePromptEcho(gguf_path), model_name="r1", reasoning_parser="deepseek_r1"
    )
    await stack.wait_for_model("r1")
    api = client(stack)
    try:
        messages: Any = [{"role": "user", "content": "ponder</think>The answer."}]
        out = await api.messages.create(model="r1", max_tokens=200, messages=messages)
        assert [b.type for b in out.content] == ["thinking", "text"]
        thinking = out.content[0]
        assert thinking.type == "thinking" and "user: ponder" in thinking.thinking
        assert thinking.signature == ""
        assert text_of(out).startswith("The answer.") and out.stop_reason == "end_turn"
        kinds = []
        stream = await api.messages.create(
            model="r1", max_tokens=200, messages=messages, stream=True
        )
        async for event in stream:
            delta = event.delta.type if event.type == "content_block_delta" else None
            kinds.append((event.type, delta))
        assert kinds[:3] == [
            ("message_start", None), ("content_block_start", None),
            ("content_block_delta", "thinking_delta"),
        ]  # fmt: skip
        assert ("content_block_delta", "signature_delta") in kinds
        with pytest.raises(anthropic.BadRequestError, match="always reasons"):
            await api.messages.create(
                model="r1", max_tokens=20, messages=messages, thinking={"type": "disabled"}
            )
    finally:
        await api.close()
        await stack.close()
    await assert_no_leaked_tasks(before)


def stream_of(writer: MessageWriter) -> list[dict[str, Any]]:
    assert writer.events is not None
    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    events = []
    for raw in writer.events:
        head, data = raw.decode().split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == "event: " + event["type"]
        adapter.validate_python(event, strict=True)
        events.append(event)
    return events


def test_a_malformed_call_is_text_alike_streamed_and_whole() -> None:
    """Arguments that are not a JSON object make a text block in the stream as in the whole
    message (the client's stream helper would raise on a broken call's partial_json), and
    the message did not stop for a tool."""
    writer = MessageWriter("m", stream=True)
    writer.start(5)
    writer.add(ChoicePiece(content="Calling."))
    writer.add(ChoicePiece(tool_calls=[ToolCallDelta(0, "c", "get_weather", "{city: Oslo}")]))
    final = writer.finish("tool_calls", None, make_usage(5, 9, 0))
    snapshot = None
    buffers: dict[int, bytes] = {}
    for event in stream_of(writer):
        parsed = TypeAdapter(RawMessageStreamEvent).validate_python(event)
        snapshot = accumulate_event(event=parsed, current_snapshot=snapshot, json_bufs=buffers)
    assert snapshot is not None
    message = Message.model_validate(final, strict=True)
    assert [b.type for b in message.content] == ["text", "text"]
    assert message.content[1].text == "{city: Oslo}"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn" == snapshot.stop_reason
    assert [b.model_dump() for b in snapshot.content] == [b.model_dump() for b in message.content]


def test_a_call_streams_whole_once_its_arguments_are_in() -> None:
    writer = MessageWriter("m", stream=True)
    writer.start(5)
    writer.add(ChoicePiece(tool_calls=[ToolCallDelta(0, "c", "get_weather", '{"city": ')]))
    assert writer.events is not None and len(writer.events) == 1  # message_start only
    writer.add(ChoicePiece(tool_calls=[ToolCallDelta(0, arguments='"Rome"}')]))
    writer.finish("tool_calls", None, make_usage(5, 9, 0))
    events = stream_of(writer)
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert events[1]["content_block"]["type"] == "tool_use"
    assert json.loads(events[2]["delta"]["partial_json"]) == {"city": "Rome"}
    assert events[4]["delta"]["stop_reason"] == "tool_use"


async def test_a_body_too_large_and_a_wrong_method_have_anthropic_errors(gguf_path: str) -> None:
    before = set(asyncio.all_tasks())
    stack = await make_stack(max_body_bytes=4096)
    try:
        async with httpx.AsyncClient(base_url=stack.url) as http:
            big = {"model": "echo", "max_tokens": 5,
                   "messages": [{"role": "user", "content": "x" * 8192}]}  # fmt: skip
            r = await http.post("/v1/messages", json=big)
            assert r.status_code == 413
            assert r.json()["error"]["type"] == "request_too_large"
            r = await http.get("/v1/messages/count_tokens")
            assert r.status_code == 405
            assert r.json()["type"] == "error", r.text
    finally:
        await stack.close()
    await assert_no_leaked_tasks(before)
