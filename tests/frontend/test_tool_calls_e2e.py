"""Tool calls and reasoning through HTTP: echo workers announce parsers in their cards; the
echo engine streams the prompt back, so a user message written in a model's format comes back
as that model's output would, and the frontend must read it (bodies and chunks checked
strictly by the suite's conformance hook)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from tests.frontend.stack import Stack, echo_engine, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.worker import Worker
from turnout.errors import ConfigError

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
async def stack(gguf_path: str) -> AsyncIterator[Stack]:
    """Model ``tools`` (hermes tool calls), model ``r1`` (deepseek_r1 reasoning)."""
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    await stack.add_worker(echo_engine(gguf_path), model_name="tools", tool_call_parser="hermes")
    await stack.add_worker(echo_engine(gguf_path), model_name="r1", reasoning_parser="deepseek_r1")
    await stack.wait_for_model("tools")
    await stack.wait_for_model("r1")
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)


def say(content: str) -> dict[str, Any]:
    """Chat arguments that make the echo answer with the templated prompt up to the end of
    ``content``: past the system turn's end token, stopped by a sentinel after the text."""
    return {
        "messages": [{"role": "user", "content": content + " END"}],
        "stop": ["END"],
        "extra_body": {"ignore_eos": True},
    }


async def test_a_tool_call_comes_back_as_a_call(stack: Stack) -> None:
    api = client(stack)
    out = await api.chat.completions.create(
        model="tools",
        **say("Weather? " + CALL),
        tools=TOOLS,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function"
    assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert calls[0].id.startswith("call_")
    assert "Weather?" in (choice.message.content or "")  # the text before the call
    assert "<tool_call>" not in (choice.message.content or "")
    await api.close()


async def test_a_streamed_tool_call_assembles_to_the_same_call(stack: Stack) -> None:
    api = client(stack)
    stream = await api.chat.completions.create(
        model="tools",
        **say("Weather? " + CALL),
        tools=TOOLS,
        stream=True,
    )
    content, args, names, ids, finish = "", "", [], [], None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            assert call.index == 0
            if call.id:
                ids.append(call.id)
                names.append(call.function.name if call.function else None)
            args += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and len(ids) == 1
    assert json.loads(args) == {"city": "Paris"}
    assert finish == "tool_calls"
    assert "Weather?" in content and "<tool_call>" not in content
    await api.close()


async def test_tool_choice_none_and_no_tools_leave_the_text_alone(stack: Stack) -> None:
    api = client(stack)
    for extra in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        out = await api.chat.completions.create(model="tools", **say(CALL), **extra)
        choice = out.choices[0]
        assert choice.message.tool_calls is None
        assert '"name": "get_weather"' in (choice.message.content or "")
        assert choice.finish_reason == "stop"
    await api.close()


async def test_a_call_to_a_tool_not_offered_is_text(stack: Stack) -> None:
    api = client(stack)
    bad = CALL.replace("get_weather", "launch_rockets")
    out = await api.chat.completions.create(model="tools", **say(bad), tools=TOOLS)
    assert out.choices[0].message.tool_calls is None
    assert "launch_rockets" in (out.choices[0].message.content or "")
    assert out.choices[0].finish_reason == "stop"
    await api.close()


async def test_every_choice_is_parsed(stack: Stack) -> None:
    api = client(stack)
    out = await api.chat.completions.create(
        model="tools",
        **say(CALL),
        tools=TOOLS,
        n=2,
    )
    assert [c.finish_reason for c in out.choices] == ["tool_calls", "tool_calls"]
    ids = {c.message.tool_calls[0].id for c in out.choices if c.message.tool_calls}
    assert len(ids) == 2
    await api.close()


async def test_reasoning_comes_apart_from_the_answer(stack: Stack) -> None:
    api = client(stack)
    message = "thinking hard</think>The answer is 4."
    out = await api.chat.completions.create(model="r1", **say(message))
    msg = out.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]  # type: ignore[index]
    assert reasoning.endswith("thinking hard") and "</think>" not in reasoning
    assert (msg.content or "").startswith("The answer is 4.")
    stream = await api.chat.completions.create(model="r1", **say(message), stream=True)
    streamed_reasoning, streamed_content = "", ""
    async for chunk in stream:
        delta = chunk.choices[0].delta
        streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        streamed_content += delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, msg.content)
    await api.close()


async def test_tools_on_a_model_without_a_parser_are_refused(stack: Stack) -> None:
    api = client(stack)
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(model="r1", **say("hi"), tools=TOOLS)
    assert info.value.body["param"] == "tools"  # type: ignore[index]
    await api.close()


async def test_an_unknown_parser_stops_the_worker(stack: Stack, gguf_path: str) -> None:
    with pytest.raises(ConfigError, match="unknown tool-call parser 'hermes2'"):
        Worker(stack.runtime, echo_engine(gguf_path), stack.workers[0].endpoint,
               tool_call_parser="hermes2")  # fmt: skip


def test_the_worker_command_refuses_an_unknown_parser(tmp_path: Any) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "turnout", "worker", "--engine", "echo",
         "--reasoning-parser", "deepthink", "--store", "file",
         "--store-path", str(tmp_path / "d.sqlite")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "unknown reasoning parser 'deepthink'" in proc.stderr
    assert "Traceback" not in proc.stderr
