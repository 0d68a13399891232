"""``/v1/responses`` through the official openai client against a real stack: string and
item input, streamed semantic events, the token limit, tool items, refusals, a client that
leaves (every body and event checked strictly by the suite's conformance hook)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from tests.frontend.stack import Stack

from turnout.frontend.openai.choice_output import ChoicePiece
from turnout.frontend.openai.chunk_writer import make_usage
from turnout.frontend.responses.api import ResponseWriter
from turnout.frontend.responses.request import ResponsesRequest
from turnout.llm.parsers import ToolCallDelta

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture
def stack(whole_prompt_stack: Stack) -> Stack:
    return whole_prompt_stack


def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)


async def test_string_input_whole(stack: Stack) -> None:
    api = client(stack)
    out = await api.responses.create(model="echo", input="Hello there", max_output_tokens=200)
    assert out.status == "completed" and out.object == "response"
    assert out.id.startswith("resp_")
    assert "Hello there" in out.output_text  # the echo answers with the templated prompt
    assert out.usage is not None and out.usage.input_tokens > 0
    assert out.usage.output_tokens > 0
    assert [item.type for item in out.output] == ["message"]
    await api.close()


async def test_items_and_instructions_reach_the_template(stack: Stack) -> None:
    api = client(stack)
    out = await api.responses.create(
        model="echo",
        instructions="Be terse.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "What is up?"}]},
            {"role": "assistant", "content": "Not much."},
            {"role": "developer", "content": "Mind the rules."},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"role": "user", "content": "And now?"},
        ],
        max_output_tokens=400,
        extra_body={},
    )
    text = out.output_text
    for piece in ("Be terse.", "What is up?", "Not much.", "Mind the rules.", "sunny", "And now?"):
        assert piece in text
    await api.close()


async def test_streamed_events_in_order(stack: Stack) -> None:
    api = client(stack)
    stream = await api.responses.create(model="echo", input="Stream me", stream=True)
    kinds: list[str] = []
    text = ""
    final: Any = None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final is not None and final.output_text == text and "Stream me" in text
    numbers = []  # sequence numbers count up from 0 (checked on the raw events below)
    async with httpx.AsyncClient(base_url=stack.url) as http:
        body = {"model": "echo", "input": "x", "stream": True}
        async with http.stream("POST", "/v1/responses", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    numbers.append(json.loads(line[5:])["sequence_number"])
    assert numbers == list(range(len(numbers)))
    await api.close()


async def test_the_stream_helper_gives_the_final_response(stack: Stack) -> None:
    api = client(stack)
    async with api.responses.stream(model="echo", input="helper") as stream:
        final = await stream.get_final_response()
    assert final.status == "completed" and "helper" in final.output_text
    await api.close()


async def test_the_token_limit_makes_it_incomplete(stack: Stack) -> None:
    api = client(stack)
    out = await api.responses.create(model="echo", input="a b c d e f", max_output_tokens=3)
    assert out.status == "incomplete"
    assert out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.usage is not None and out.usage.output_tokens == 3
    await api.close()


async def test_tool_calls_become_function_call_items(stack: Stack) -> None:
    api = client(stack)
    out = await api.responses.create(model="tools", input="Weather? " + CALL, tools=[TOOL])
    calls = [item for item in out.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    await api.close()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "conversation": {"id": "conv_1", "x": 1}}, "conversation"),
        (
            {"input": "hi", "previous_response_id": "resp_1", "conversation": "conv_1"},
            "conversation",
        ),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": [{"type": "computer_call"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": "hi", "reasoning": {"effort": "low", "summary": "auto"}}, "reasoning"),
        ({"input": "hi", "service_tier": "flex"}, "service_tier"),
        ({"input": "hi", "prompt_cache_key": "k" * 257}, "prompt_cache_key"),
        (
            {"input": "hi", "stream_options": {"include_usage": True}},
            "stream_options.include_usage",
        ),
    ],
)
async def test_what_it_cannot_honour_is_a_400_naming_it(
    stack: Stack, body: dict[str, Any], param: str
) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        r = await http.post("/v1/responses", json={"model": "echo", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_unknown_model_is_a_404(stack: Stack) -> None:
    api = client(stack)
    with pytest.raises(openai.NotFoundError):
        await api.responses.create(model="nope", input="hi")
    await api.close()


def test_the_writer_orders_reasoning_text_and_calls() -> None:
    """Reasoning, answer and two calls: one item each, events valid and in order."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    request = ResponsesRequest(model="m", input="hi", tools=[TOOL])
    writer = ResponseWriter(request, stream=True)
    writer.start()
    for piece in (
        ChoicePiece(reasoning="Let me "),
        ChoicePiece(reasoning="think."),
        ChoicePiece(content="Calling."),
        ChoicePiece(tool_calls=[ToolCallDelta(0, "call_a", "get_weather", '{"city": "A"}')]),
        ChoicePiece(tool_calls=[ToolCallDelta(1, "call_b", "get_weather", '{"city": ')]),
        ChoicePiece(tool_calls=[ToolCallDelta(1, arguments='"B"}')]),
    ):
        writer.add(piece)
    final = writer.finish("tool_calls", make_usage(5, 7, 2))
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    events = []
    assert writer.events is not None
    for raw in writer.events:
        head, data = raw.decode().split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == "event: " + event["type"]
        adapter.validate_python(event, strict=True)
        events.append(event["type"])
    response = Response.model_validate(final, strict=True)
    assert [i.type for i in response.output] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    assert response.output[0].content[0].text == "Let me think."  # type: ignore[union-attr,index]
    assert response.output[3].arguments == '{"city": "B"}'  # type: ignore[union-attr]
    assert events.count("response.output_item.added") == 4
    assert events.count("response.function_call_arguments.delta") == 3
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens == 2


async def test_a_tool_round_trip_renders_with_the_models_own_template(echo_stack: Stack) -> None:
    """SmolLM2's template concatenates message content: a replayed call must not be null
    (the template would fail on it), and the tool's output reaches the prompt."""
    async with httpx.AsyncClient(base_url=echo_stack.url) as http:

        async def round_trip(output: str) -> Any:
            r = await http.post("/v1/responses", json={
                "model": "echo", "max_output_tokens": 5,
                "input": [
                    {"role": "user", "content": "Weather?"},
                    {"type": "function_call", "call_id": "c1", "name": "get_weather",
                     "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": output},
                ],
            })  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()

        short = await round_trip("sunny")
        long = await round_trip("sunny and warm all day long, with a light breeze")
    assert short["usage"]["output_tokens"] == 5
    assert [item["type"] for item in short["output"]] == ["message"]
    # The tool's output is rendered into the prompt: a longer one makes a longer prompt.
    assert long["usage"]["input_tokens"] > short["usage"]["input_tokens"]
