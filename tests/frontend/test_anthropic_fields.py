"""Anthropic's request fields that the ``anthropic`` client (2.16) sends: ``output_config``
(``messages.parse()``'s structured output, and ``effort``), adaptive ``thinking``, the
top-level ``cache_control``, ``strict`` tools as chat's; each honoured, with what it does
checked, or refused with a message that names it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pydantic
import pytest
from tests.frontend.stack import Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.echo import EchoEngine
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.llm import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    StructuredOutput,
)
from turnout.protocols.model import ModelDeploymentCard
from turnout.runtime.context import RequestContext

ANSWER = '{"city": "Paris"}'
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ eos_token }}"
QWEN3_LIKE = (
    "{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}" + PLAIN
)
TOOL: dict[str, Any] = {
    "name": "get_weather",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


class Weather(pydantic.BaseModel):
    city: str


class StructuredEcho(EchoEngine):
    """An engine that enforces JSON schemas (says its card) and answers ``ANSWER``: it keeps
    the constraint of every request, which the tests read."""

    def __init__(self, gguf_path: str) -> None:
        super().__init__(gguf_path)
        self._tokenizer = Tokenizer.from_gguf(gguf_path)
        self.constraints: list[StructuredOutput | None] = []

    def model_card_template(self) -> ModelDeploymentCard:
        card = super().model_card_template()
        caps = msgspec.structs.replace(card.capabilities, structured_outputs=["json_schema"])
        return msgspec.structs.replace(card, capabilities=caps, chat_template=PLAIN)

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        self.constraints.append(request.structured)
        ids = self._tokenizer.encode(ANSWER)
        usage = CompletionUsage(prompt_tokens=len(request.token_ids),
                                completion_tokens=len(ids), cached_tokens=0)  # fmt: skip
        for token in ids[:-1]:
            yield LLMEngineOutput(token_ids=[token])
        yield LLMEngineOutput(token_ids=ids[-1:], finish_reason=FinishReason.EOS, usage=usage)


class TemplatedEcho(EchoEngine):
    def __init__(self, gguf_path: str, template: str) -> None:
        super().__init__(gguf_path)
        self.template = template

    def model_card_template(self) -> ModelDeploymentCard:
        return msgspec.structs.replace(super().model_card_template(), chat_template=self.template)


@pytest.fixture
async def stack(gguf_path: str) -> AsyncIterator[tuple[Stack, StructuredEcho]]:
    """Models ``structured`` (``StructuredEcho``), ``plain`` (an echo, no reasoning, no
    constraints), ``qwen3`` (a reasoning parser and Qwen3's thinking switch)."""
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    engine = StructuredEcho(gguf_path)
    await stack.add_worker(engine, model_name="structured")
    await stack.add_worker(TemplatedEcho(gguf_path, PLAIN), model_name="plain",
                           tool_call_parser="hermes")  # fmt: skip
    await stack.add_worker(TemplatedEcho(gguf_path, QWEN3_LIKE), model_name="qwen3",
                           reasoning_parser="qwen3")  # fmt: skip
    for name in ("structured", "plain", "qwen3"):
        await stack.wait_for_model(name)
    yield stack, engine
    await stack.close()
    await assert_no_leaked_tasks(before)


def user(text: str = "Weather?") -> list[Any]:
    return [{"role": "user", "content": text}]


async def test_anthropic_fields(stack: tuple[Stack, StructuredEcho]) -> None:
    server, engine = stack
    claude = anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0)

    # output_config.format, as messages.parse() sends it: the engine holds the answer to the
    # schema, and the client parses it.
    parsed = await claude.messages.parse(
        model="structured", max_tokens=20, messages=user(), output_format=Weather
    )
    assert parsed.parsed_output == Weather(city="Paris")
    constraint = engine.constraints[-1]
    assert constraint is not None and constraint.kind == "json_schema"
    assert '"city"' in constraint.grammar
    with pytest.raises(anthropic.BadRequestError, match="json_schema"):
        await claude.messages.parse(
            model="plain", max_tokens=20, messages=user(), output_format=Weather
        )

    # Adaptive thinking: a model that does not reason has decided; one that does refuses it.
    plain = await claude.messages.create(
        model="plain", max_tokens=5, messages=user(), thinking={"type": "adaptive"},
        cache_control={"type": "ephemeral"},
    )  # fmt: skip
    assert plain.content
    with pytest.raises(anthropic.BadRequestError, match="'adaptive'"):
        await claude.messages.create(
            model="qwen3", max_tokens=5, messages=user(), thinking={"type": "adaptive"}
        )

    # output_config.effort sets the reasoning switch; a model without one refuses it.
    for thinking, switched in (({"type": "disabled"}, "NOTHINK user"), (None, "user")):
        message = await claude.messages.create(
            model="qwen3", max_tokens=40, messages=user(),
            **({"thinking": thinking} if thinking else {}),
        )  # fmt: skip
        text = "".join(b.text for b in message.content if b.type == "text")
        assert text.startswith(switched), text
    message = await claude.messages.create(
        model="qwen3", max_tokens=40, messages=user(), output_config={"effort": "low"}
    )
    assert "NOTHINK" not in "".join(b.text for b in message.content if b.type == "text")
    with pytest.raises(anthropic.BadRequestError, match="disagree"):
        await claude.messages.create(
            model="qwen3", max_tokens=5, messages=user(), thinking={"type": "disabled"},
            output_config={"effort": "low"},
        )  # fmt: skip
    with pytest.raises(anthropic.BadRequestError, match="no reasoning switch"):
        await claude.messages.create(
            model="plain", max_tokens=5, messages=user(), output_config={"effort": "high"}
        )

    # count_tokens takes them all, and counts the same prompt.
    counted = await claude.messages.count_tokens(
        model="plain", messages=user(), cache_control={"type": "ephemeral"},
        thinking={"type": "adaptive"}, output_config={"format": {
            "type": "json_schema", "schema": Weather.model_json_schema()}},
    )  # fmt: skip
    bare = await claude.messages.count_tokens(model="plain", messages=user())
    assert counted.input_tokens == bare.input_tokens
    await claude.close()


async def test_strict_tools_are_the_same_on_both_apis(stack: tuple[Stack, StructuredEcho]) -> None:
    """A strict tool is accepted on both; when the choice forces it, the engine gets the same
    grammar from either, which holds the call's input to the tool's schema."""
    server, engine = stack
    claude = anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0)
    api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    message = await claude.messages.create(
        model="structured", max_tokens=20, messages=user(), tools=[TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    calls = [b for b in message.content if b.type == "tool_use"]
    assert [c.input for c in calls] == [{"city": "Paris"}]
    from_messages = engine.constraints[-1]
    function = {"name": TOOL["name"], "parameters": TOOL["input_schema"], "strict": True}
    completion = await api.chat.completions.create(
        model="structured", messages=user(), tools=[{"type": "function", "function": function}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    assert completion.choices[0].message.tool_calls
    assert engine.constraints[-1] == from_messages and from_messages is not None
    assert '"additionalProperties": false' in from_messages.grammar
    # With tool_choice auto a strict tool is accepted on both (its calls are the model's).
    auto = await claude.messages.create(
        model="plain", max_tokens=5, messages=user(), tools=[TOOL]
    )
    assert auto.stop_reason in ("end_turn", "max_tokens")
    async with httpx.AsyncClient(base_url=server.url) as http:
        r = await http.post("/v1/chat/completions", json={
            "model": "plain", "max_tokens": 5, "messages": user(),
            "tools": [{"type": "function", "function": function}],
        })  # fmt: skip
    assert r.status_code == 200, r.text
    await claude.close()
    await api.close()
