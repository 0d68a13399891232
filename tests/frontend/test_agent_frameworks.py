"""Agent frameworks' own loops, unmodified, against a real frontend: two tool rounds, then the
final answer (``scripted.ScriptedToolEngine``: a hermes-markup model that answers only once
each turn has come back whole). Each framework replays the assistant's tool-call turn as its
own serializer writes it (``content: null``, arguments as JSON text, ``tool`` messages with
their ids), so a loop finishes only when turnout renders every shape it sends.

openai-agents runs on its chat-completions model here; its Responses model, chaining turns by
``previous_response_id`` through the response store, runs in ``test_responses_stored``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from tests.frontend.scripted import CITIES, TOOL, ScriptedToolEngine, final_answer
from tests.frontend.stack import Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

#: What the tool says of each city, and so what the final answer must carry.
WEATHER = {"Paris": "sunny, 24 C", "Rome": "rain, 18 C"}
EXPECTED = final_answer([WEATHER[c] for c in CITIES])


def get_weather(city: str) -> str:
    """The weather in a city."""
    return WEATHER[city]


@pytest.fixture
async def stack(gguf_path: str) -> AsyncIterator[tuple[Stack, ScriptedToolEngine]]:
    """Model ``agent``: the scripted tool-calling engine, hermes tool calls."""
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    engine = ScriptedToolEngine(gguf_path)
    await stack.add_worker(engine, model_name="agent", tool_call_parser="hermes")
    await stack.wait_for_model("agent")
    yield stack, engine
    await stack.close()
    await assert_no_leaked_tasks(before)


def _check_rounds(engine: ScriptedToolEngine) -> None:
    """Three requests: two that ended in a call, the last with both results."""
    assert len(engine.prompts) == 3, engine.prompts
    assert all("MISSED" not in p for p in engine.prompts)


async def test_openai_agents_chat_model(stack: tuple[Stack, ScriptedToolEngine]) -> None:
    import agents
    from openai import AsyncOpenAI

    server, engine = stack
    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        model=agents.OpenAIChatCompletionsModel(model="agent", openai_client=client),
        tools=[agents.function_tool(get_weather)],
    )
    result = await agents.Runner.run(agent, "Weather in Paris, then Rome?")
    assert result.final_output == EXPECTED
    _check_rounds(engine)
    await client.close()


async def test_langchain_openai_bind_tools(stack: tuple[Stack, ScriptedToolEngine]) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    server, engine = stack
    weather = tool(get_weather)
    chat = ChatOpenAI(model="agent", base_url=server.url + "/v1", api_key="x", max_retries=0)
    llm = chat.bind_tools([weather])
    messages: list = [HumanMessage("Weather in Paris, then Rome?")]
    for _ in range(3):
        reply = await llm.ainvoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            output = await weather.ainvoke(call["args"])
            messages.append(ToolMessage(output, tool_call_id=call["id"], name=call["name"]))
    assert messages[-1].content == EXPECTED
    _check_rounds(engine)
    await chat.root_async_client.close()


async def test_pydantic_ai_agent(stack: tuple[Stack, ScriptedToolEngine]) -> None:
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    server, engine = stack
    # Its own client, closed here (the provider's default is a process-wide one, left open).
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    model = OpenAIChatModel("agent", provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, tools=[get_weather], instructions="Answer with the weather.")
    result = await agent.run("Weather in Paris, then Rome?")
    assert result.output == EXPECTED
    _check_rounds(engine)
    # Its replayed call: the arguments it sent back are the ones the model wrote.
    assert json.dumps({"city": CITIES[0]}) in engine.prompts[1]
    assert TOOL in engine.prompts[2]
    await client.close()
