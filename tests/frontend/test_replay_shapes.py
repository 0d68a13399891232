"""Tool-call turns as clients replay them: whatever turnout answered, and what each agent
framework's own serializer sends back (``tests/data/replay/*.json``, recorded by ``record.py``
there from openai-agents, LangChain, pydantic-ai, litellm and LlamaIndex), renders through
templates of every kind and runs over HTTP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tests.frontend.stack import Stack
from tests.llm.templates import LLAMA_LIKE, QWEN_LIKE

from turnout.llm.chat_template import ChatTemplate

REPLAY = Path(__file__).parent.parent / "data" / "replay"
RECORDINGS = sorted(REPLAY.glob("*.json"))
#: (framework, shape, request) of every recording.
RECORDED = [
    pytest.param(request, id=f"{path.stem}-{shape}")
    for path in RECORDINGS
    for shape, request in json.loads(path.read_text())["requests"].items()
]
#: DeepSeek V3's way: the tool-call branch is chosen by ``content is none``, the arguments
#: written as the text they came as, by concatenation.
DEEPSEEK_LIKE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m['content'] is none %}<calls>"
    "{% for t in m['tool_calls'] %}{{ t['function']['name'] + '```json\\n' "
    "+ t['function']['arguments'] + '\\n```' }}{% endfor %}</calls>"
    "{% elif m['role'] == 'tool' %}<out>{{ m['content'] }}</out>"
    "{% else %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% for t in m['tool_calls'] or [] %}{{ t['function']['arguments'] }}{% endfor %}"
    "{% endif %}{% endfor %}"
)


def test_every_framework_is_recorded() -> None:
    assert {p.stem for p in RECORDINGS} == {
        "langchain", "litellm", "llama-index", "openai-agents", "pydantic-ai"
    }  # fmt: skip


@pytest.mark.parametrize("request_body", RECORDED)
@pytest.mark.parametrize("source", [QWEN_LIKE, LLAMA_LIKE], ids=["qwen", "llama"])
def test_recorded_turns_render_with_object_arguments(
    request_body: dict[str, Any], source: str
) -> None:
    """Templates that write ``arguments | tojson`` get the object, not its text quoted."""
    text = ChatTemplate(source).render(request_body["messages"], tools=request_body.get("tools"))
    assert '{"city": "Paris"}' in text and '\\"city\\"' not in text
    assert "sunny, 24 C" in text and "None" not in text


@pytest.mark.parametrize("request_body", RECORDED)
def test_recorded_turns_render_for_templates_that_test_null(request_body: dict[str, Any]) -> None:
    """A template that picks its tool-call branch on null content gets null for a turn with
    no text, and the arguments as the text the client sent."""
    text = ChatTemplate(DEEPSEEK_LIKE).render(request_body["messages"])
    calls = [m for m in request_body["messages"] if m.get("tool_calls")]
    sent = calls[0]["tool_calls"][0]["function"]["arguments"]
    if calls[0].get("content"):
        assert f"<assistant>{calls[0]['content']}{sent}" in text
    else:
        assert f"<calls>get_weather```json\n{sent}\n```</calls>" in text
    assert "<out>sunny, 24 C</out>" in text


@pytest.mark.parametrize(
    ("arguments", "as_text", "as_object"),
    [
        ('{"city": "Paris"}', '{"city": "Paris"}', {"city": "Paris"}),
        ("", "{}", {}),
        (None, "{}", {}),
        ('{"city": "Par', '{"city": "Par', {}),  # cut short: the text stays, the object is {}
        ("[1, 2]", "[1, 2]", {}),
        ({"city": "Paris"}, '{"city": "Paris"}', {"city": "Paris"}),  # an object, as sent
    ],
)
def test_arguments_are_both_object_and_text(
    arguments: Any, as_text: str, as_object: dict[str, Any]
) -> None:
    source = (
        "{% for m in messages %}{% for t in m.tool_calls or [] %}"
        "{{ t.function.arguments }}|{{ t.function.arguments | tojson }}|"
        "{{ t.function.arguments is mapping }}{% endfor %}{% endfor %}"
    )
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    text = ChatTemplate(source).render([{"role": "assistant", "tool_calls": [call]}])
    assert text == f"{as_text}|{json.dumps(as_object)}|True"


@pytest.fixture
def stack(whole_prompt_stack: Stack) -> Stack:
    return whole_prompt_stack


@pytest.mark.parametrize("request_body", RECORDED)
async def test_recorded_requests_run(stack: Stack, request_body: dict[str, Any]) -> None:
    """Each framework's second request, as it sent it (model aside), is answered."""
    async with httpx.AsyncClient(base_url=stack.url) as http:
        r = await http.post("/v1/chat/completions", json={**request_body, "model": "tools"})
    assert r.status_code == 200, r.text
    echoed = r.json()["choices"][0]["message"]["content"]
    assert '"arguments": {"city": "Paris"}' in echoed and "sunny, 24 C" in echoed


async def test_whatever_turnout_answers_can_be_sent_back(stack: Stack) -> None:
    """Answers with a call (with the text before it, and without: OpenAI's ``content:
    null``) and a refusal, replayed as the openai client holds them (every field, nulls
    included)."""
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    replies = []
    for prompt in (call, "Let me look. " + call):
        first = await api.chat.completions.create(
            model="tools", messages=[{"role": "user", "content": prompt}], tools=[tool]
        )
        replies.append(first.choices[0].message)
    assert all(reply.tool_calls for reply in replies)
    sent = [reply.model_dump() for reply in replies]
    sent.append({**sent[0], "content": None})
    for reply, dumped in zip([*replies, replies[0]], sent, strict=True):
        calls = reply.tool_calls or []
        messages: list[Any] = [
            {"role": "user", "content": "Weather?"},
            dumped,
            *({"role": "tool", "tool_call_id": c.id, "name": "get_weather", "content": "sunny"}
              for c in calls),
        ]  # fmt: skip
        again = await api.chat.completions.create(model="tools", messages=messages, tools=[tool])
        text = again.choices[0].message.content or ""
        assert '"arguments": {"city": "Paris"}' in text
        assert 'tool: sunny' in text
    refused = await api.chat.completions.create(
        model="echo",
        messages=[
            {"role": "user", "content": "Something bad."},
            {"role": "assistant", "content": None, "refusal": "I can't help with that."},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "Nor that."}]},
            {"role": "user", "content": "Fine."},
        ],
    )
    text = refused.choices[0].message.content or ""
    assert "assistant: I can't help with that." in text and "assistant: Nor that." in text
    await api.close()
