"""OpenAI's request fields that agent clients send by default, over HTTP: each honoured, with
what it does checked, or refused with a 400 naming it (``openai_fields.check_openai_fields``,
``llm.reasoning_switch``, ``parallel_tool_calls``, ``prompt_cache_key``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest
from tests.frontend.stack import Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.echo import EchoEngine
from turnout.llm.structured import forced_tool_schema, structured_output
from turnout.protocols.model import ModelDeploymentCard
from turnout.protocols.openai import ChatCompletionRequest, ChatMessage
from turnout.router.mode import RouterMode

TOOLS: list[Any] = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "get_time")
]
TWO_CALLS = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {"city": "Rome"}}</tool_call>'
)
#: Templates with a reasoning switch, as Qwen3's and gpt-oss's spell theirs.
QWEN3_LIKE = (
    "{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ eos_token }}"
)
HARMONY_LIKE = (
    "Reasoning: {{ reasoning_effort | default('medium') }}\n"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ eos_token }}"
)
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ eos_token }}"


class TemplatedEcho(EchoEngine):
    """An echo (the whole rendered prompt back) whose card carries ``template``."""

    def __init__(self, gguf_path: str, template: str) -> None:
        super().__init__(gguf_path)
        self.template = template

    def model_card_template(self) -> ModelDeploymentCard:
        return msgspec.structs.replace(super().model_card_template(), chat_template=self.template)


async def start(gguf_path: str, models: list[tuple[str, str, dict[str, Any]]]) -> Stack:
    """A frontend (round robin, session affinity) and an echo worker per (model, template,
    worker options)."""
    stack = await make_stack(
        router_mode=RouterMode.ROUND_ROBIN, router_session_affinity_ttl_s=60.0
    )
    for name, template, options in models:
        await stack.add_worker(TemplatedEcho(gguf_path, template), model_name=name, **options)
    for name in {name for name, _, _ in models}:
        await stack.wait_for_model(name, instances=sum(m[0] == name for m in models))
    return stack


@pytest.fixture
async def stack(gguf_path: str) -> AsyncIterator[Stack]:
    """Models ``tools`` (hermes calls) and ``plain``."""
    before = set(asyncio.all_tasks())
    stack = await start(
        gguf_path, [("tools", PLAIN, {"tool_call_parser": "hermes"}), ("plain", PLAIN, {})]
    )
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


@pytest.fixture
async def reasoning(gguf_path: str) -> AsyncIterator[Stack]:
    """Models ``qwen3`` and ``harmony`` (reasoning switches, with a reasoning parser),
    ``thinker`` (a reasoning parser, no switch) and ``plain`` (no switch, no reasoning)."""
    before = set(asyncio.all_tasks())
    stack = await start(gguf_path, [
        ("qwen3", QWEN3_LIKE, {"reasoning_parser": "qwen3"}),
        ("harmony", HARMONY_LIKE, {"reasoning_parser": "deepseek_r1"}),
        ("thinker", PLAIN, {"reasoning_parser": "qwen3"}),
        ("plain", PLAIN, {}),
    ])  # fmt: skip
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


@pytest.fixture
async def routing(gguf_path: str) -> AsyncIterator[Stack]:
    """Three workers of model ``plain``."""
    before = set(asyncio.all_tasks())
    stack = await start(gguf_path, [("plain", PLAIN, {})] * 3)
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)


async def post(stack: Stack, body: dict[str, Any], **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        return await http.post("/v1/chat/completions", json=body, headers=headers)


def chat(model: str = "plain", text: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


# ---------------------------------------------------------------- parallel_tool_calls


async def test_parallel_tool_calls_false_keeps_the_first_call(stack: Stack) -> None:
    api = client(stack)
    for stream in (False, True):
        await _check_parallel(api, stream)
    await api.close()


async def _check_parallel(api: openai.AsyncOpenAI, stream: bool) -> None:
    names: dict[bool | None, list[str]] = {}
    for parallel in (None, True, False):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        args = chat("tools", TWO_CALLS)
        out = await api.chat.completions.create(**args, tools=TOOLS, stream=stream, **extra)
        if stream:
            calls = [c async for chunk in out for c in chunk.choices[0].delta.tool_calls or []]
            names[parallel] = [c.function.name for c in calls if c.function and c.function.name]
        else:
            calls = out.choices[0].message.tool_calls or []
            names[parallel] = [c.function.name for c in calls]  # type: ignore[union-attr]
            assert out.choices[0].finish_reason == "tool_calls"
    assert names[None] == names[True] == ["get_weather", "get_time"], stream
    assert names[False] == ["get_weather"], stream


def test_a_forced_required_choice_allows_one_call_when_not_parallel(gguf_path: str) -> None:
    card = TemplatedEcho(gguf_path, PLAIN).model_card_template()
    capabilities = msgspec.structs.replace(card.capabilities, structured_outputs=["json_schema"])
    card = msgspec.structs.replace(card, capabilities=capabilities)

    def request(parallel: bool | None) -> ChatCompletionRequest:
        return ChatCompletionRequest(
            model="m", messages=[ChatMessage(role="user", content="hi")], tools=TOOLS,
            tool_choice="required", parallel_tool_calls=parallel,
        )  # fmt: skip

    assert forced_tool_schema(request(False))["maxItems"] == 1  # type: ignore[index]
    assert "maxItems" not in forced_tool_schema(request(True))  # type: ignore[operator]
    assert "maxItems" not in forced_tool_schema(request(None))  # type: ignore[operator]
    grammar = structured_output(card, request(False))
    assert grammar is not None and '"maxItems": 1' in grammar.grammar


async def test_responses_and_messages_take_one_call_too(stack: Stack) -> None:
    api = client(stack)
    tools: list[Any] = [{"type": "function", "name": n, "parameters": {"type": "object"}}
                        for n in ("get_weather", "get_time")]  # fmt: skip
    out = await api.responses.create(
        model="tools", input=TWO_CALLS, tools=tools, parallel_tool_calls=False
    )
    assert [i.name for i in out.output if i.type == "function_call"] == ["get_weather"]
    assert out.parallel_tool_calls is False
    both = await api.responses.create(model="tools", input=TWO_CALLS, tools=tools)
    assert len([i for i in both.output if i.type == "function_call"]) == 2
    assert both.parallel_tool_calls is True
    await api.close()
    claude = anthropic.AsyncAnthropic(base_url=stack.url, api_key="x", max_retries=0)
    anthropic_tools: list[Any] = [{"name": n, "input_schema": {"type": "object"}}
                                  for n in ("get_weather", "get_time")]  # fmt: skip
    for disable, expected in ((True, 1), (False, 2)):
        message = await claude.messages.create(
            model="tools", max_tokens=200, tools=anthropic_tools,
            tool_choice={"type": "auto", "disable_parallel_tool_use": disable},
            messages=[{"role": "user", "content": TWO_CALLS}],
        )  # fmt: skip
        assert len([b for b in message.content if b.type == "tool_use"]) == expected
    await claude.close()


# ---------------------------------------------------------------- fields that ask nothing


async def test_harmless_fields_are_accepted(stack: Stack) -> None:
    api = client(stack)
    out = await api.chat.completions.create(
        model="plain", messages=[{"role": "user", "content": "hi"}],
        store=False, metadata={"team": "agents"}, modalities=["text"], service_tier="auto",
        safety_identifier="user-hash-1", max_completion_tokens=3,
    )  # fmt: skip
    assert out.service_tier == "default"
    plain = await api.chat.completions.create(
        model="plain", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3
    )
    assert plain.service_tier is None  # a response names a tier only when asked
    for obfuscation in (False, True):
        stream = await api.chat.completions.create(
            model="plain", messages=[{"role": "user", "content": "hi"}], stream=True,
            service_tier="default", max_completion_tokens=3,
            stream_options={"include_usage": True, "include_obfuscation": obfuscation},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        assert {c.service_tier for c in chunks} == {"default"}
        assert chunks[-1].usage is not None
        assert all("obfuscation" not in (c.model_extra or {}) for c in chunks)
    await api.close()


REFUSED = [
        ({"store": True}, "store"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata[...]"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"safety_identifier": "u" * 257}, "safety_identifier"),
        ({"prompt_cache_key": "k" * 257}, "prompt_cache_key"),
        ({"stream_options": {"include_obfuscation": "no"}}, "stream_options.include_obfuscation"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
]  # fmt: skip


async def test_what_cannot_be_honoured_is_a_400_naming_it(stack: Stack) -> None:
    for extra, param in REFUSED:
        r = await post(stack, chat(max_tokens=2, **extra))
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.text)


# ---------------------------------------------------------------- prompt_cache_key


async def test_prompt_cache_key_is_the_routing_session(routing: Stack) -> None:
    """Round robin spreads requests; one ``prompt_cache_key`` keeps them on one worker, as
    ``x-session-id`` does, and the header wins over the body field."""
    nvext = {"extra_fields": ["worker_id"]}

    async def worker(**extra: Any) -> str:
        headers = extra.pop("headers", {})
        r = await post(routing, chat(max_tokens=2, nvext=nvext, **extra), **headers)
        assert r.status_code == 200, r.text
        return str(r.json()["nvext"]["worker_id"])

    spread = {await worker() for _ in range(3)}
    assert len(spread) == 3
    by_key = {await worker(prompt_cache_key="conv-1") for _ in range(4)}
    assert len(by_key) == 1
    by_header = await worker(headers={"x-session-id": "conv-2"})
    assert by_header not in by_key
    both = {
        await worker(prompt_cache_key="conv-1", headers={"x-session-id": "conv-2"})
        for _ in range(3)
    }
    assert both == {by_header}


# ---------------------------------------------------------------- reasoning_effort


SWITCHED = [
        ("qwen3", "none", "NOTHINK user: hi"),
        ("qwen3", "high", "user: hi"),
        ("harmony", "low", "Reasoning: low"),
        ("harmony", "high", "Reasoning: high"),
        ("plain", "none", "user: hi"),  # it does not reason: honoured as it is
]  # fmt: skip


async def _check_switched(reasoning: Stack) -> None:
    for model, effort, says in SWITCHED:
        r = await post(reasoning, chat(model, reasoning_effort=effort, ignore_eos=True,
                                       stop=["\n"]))  # fmt: skip
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        text = (message.get("reasoning_content") or "") + (message.get("content") or "")
        assert text.startswith(says), (model, effort, text)
    api = client(reasoning)
    out = await api.responses.create(
        model="harmony", input="hi", reasoning={"effort": "low"}, max_output_tokens=4
    )
    said = [part.text for item in out.output if item.type == "reasoning"
            for part in item.content or []]  # fmt: skip
    assert "".join(said).startswith("Reasoning: low"), out.output
    await api.close()


UNSWITCHABLE = [
        ("harmony", {"reasoning_effort": "none"}, "reasoning_effort"),
        ("harmony", {"reasoning_effort": "minimal"}, "reasoning_effort"),
        ("thinker", {"reasoning_effort": "none"}, "reasoning_effort"),
        ("plain", {"reasoning_effort": "low"}, "reasoning_effort"),
        ("qwen3", {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
         "reasoning_effort"),
]  # fmt: skip


async def test_reasoning_effort_a_template_cannot_take_is_refused(reasoning: Stack) -> None:
    """Refused on chat naming ``reasoning_effort``, on the Responses API naming
    ``reasoning``; what one can take sets its switch (one stack for both: it is costly)."""
    await _check_switched(reasoning)
    for model, body, param in UNSWITCHABLE:
        r = await post(reasoning, chat(model, max_tokens=2, **body))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        if "chat_template_kwargs" in body:
            continue
        effort = body["reasoning_effort"]
        responses = {"model": model, "input": "hi", "reasoning": {"effort": effort}}
        async with httpx.AsyncClient(base_url=reasoning.url) as http:
            r = await http.post("/v1/responses", json=responses)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "reasoning"
