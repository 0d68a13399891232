"""Records how agent frameworks replay a tool-call turn: the chat request each sends once
its tool has run, captured by a stand-in server, written to ``<framework>.json`` here.

Each framework runs its own documented loop against the stand-in, which answers the first
request with an assistant turn that calls ``get_weather`` (``content: null``, as turnout and
OpenAI answer; or with text beside the call: ``--with-text``) and records the next one: the
user message, the assistant's turn as the framework serialized it back, and the ``tool``
message. Run it in an environment that has the frameworks (litellm and LlamaIndex pull in
another ``openai`` than the tests use, so they are recorded from a venv of their own)::

    python tests/data/replay/record.py openai-agents langchain pydantic-ai
    /tmp/venv/bin/python tests/data/replay/record.py litellm llama-index

Not a test: ``tests/frontend/test_replay_shapes.py`` replays the recordings.
"""

from __future__ import annotations

import asyncio
import http.server
import importlib.metadata
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
RESULT = "sunny, 24 C"
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def get_weather(city: str) -> str:
    """The weather in a city."""
    return RESULT


class StandIn(http.server.BaseHTTPRequestHandler):
    """Answers chat requests: a tool call until a tool result comes back, then text."""

    bodies: list[dict[str, Any]] = []
    text: str | None = None

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        StandIn.bodies.append(body)
        if any(m.get("role") == "tool" for m in body["messages"]):
            message: dict[str, Any] = {"role": "assistant", "content": "Sunny."}
            reason = "stop"
        else:
            message = {"role": "assistant", "content": StandIn.text, "tool_calls": [CALL]}
            reason = "tool_calls"
        out = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": reason}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


async def openai_agents(url: str) -> None:
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=url, api_key="x")
    model = agents.OpenAIChatCompletionsModel(model="m", openai_client=client)
    agent = agents.Agent(name="a", model=model, tools=[agents.function_tool(get_weather)])
    await agents.Runner.run(agent, "Weather in Paris?")


async def langchain(url: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    weather = tool(get_weather)
    llm = ChatOpenAI(model="m", base_url=url, api_key="x").bind_tools([weather])
    messages: list[Any] = [HumanMessage("Weather in Paris?")]
    reply = await llm.ainvoke(messages)
    messages.append(reply)
    for call in reply.tool_calls:
        output = weather.invoke(call["args"])
        messages.append(ToolMessage(output, tool_call_id=call["id"], name=call["name"]))
    await llm.ainvoke(messages)


async def pydantic_ai(url: str) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("m", provider=OpenAIProvider(base_url=url, api_key="x"))
    await Agent(model, tools=[get_weather]).run("Weather in Paris?")


async def litellm(url: str) -> None:
    # Its price list from the package, not fetched from the network at import.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm as lite

    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    reply = await lite.acompletion(
        model="openai/m", api_base=url, api_key="x", messages=messages, tools=TOOLS
    )
    message = reply.choices[0].message
    messages.append(message)
    for call in message.tool_calls:
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "name": call.function.name,
             "content": get_weather(**json.loads(call.function.arguments))}
        )  # fmt: skip
    await lite.acompletion(
        model="openai/m", api_base=url, api_key="x", messages=messages, tools=TOOLS
    )


async def llama_index(url: str) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(
        model="m", api_base=url, api_key="x", is_chat_model=True, is_function_calling_model=True
    )
    tool = FunctionTool.from_defaults(fn=get_weather)
    history = [ChatMessage(role="user", content="Weather in Paris?")]
    reply = await llm.achat_with_tools([tool], chat_history=history)
    history.append(reply.message)
    for call in llm.get_tool_calls_from_response(reply, error_on_no_tool_call=False):
        history.append(
            ChatMessage(
                role="tool",
                content=str(tool(**call.tool_kwargs)),
                additional_kwargs={"tool_call_id": call.tool_id, "name": call.tool_name},
            )
        )
    await llm.achat_with_tools([tool], chat_history=history)


FRAMEWORKS = {
    "openai-agents": (openai_agents, "openai-agents"),
    "langchain": (langchain, "langchain-openai"),
    "pydantic-ai": (pydantic_ai, "pydantic-ai-slim"),
    "litellm": (litellm, "litellm"),
    "llama-index": (llama_index, "llama-index-llms-openai-like"),
}


def main(names: list[str]) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    for name in names:
        run, package = FRAMEWORKS[name]
        recorded = {}
        for shape, text in (("null_content", None), ("with_text", "Let me check.")):
            StandIn.bodies.clear()
            StandIn.text = text
            asyncio.run(run(url))
            recorded[shape] = StandIn.bodies[-1]
        out = {
            "framework": package,
            "version": importlib.metadata.version(package),
            "recorded_by": "tests/data/replay/record.py",
            "requests": recorded,
        }
        (HERE / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n")
        print(name, out["version"])
    server.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:] or list(FRAMEWORKS))
