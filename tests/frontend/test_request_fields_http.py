"""Nothing accepted and ignored, over HTTP: a field turnout does not know, or one the model's
engine cannot honour, is a 400 that names it (the official client sees a BadRequestError)."""

from __future__ import annotations

import httpx
import openai
import pytest
from tests.frontend.stack import Stack


@pytest.fixture
def stack(echo_stack: Stack) -> Stack:
    return echo_stack


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"store": True}, "store", None),
        ({"nvext": {"priorty": 2}}, "nvext.priorty", "unknown_parameter"),
        ({"nvext": {"annotations": ["request_id"]}}, "nvext.annotations", "unknown_parameter"),
        ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x",
         "unknown_parameter"),
        ({"logprobs": True}, "logprobs", None),
        ({"min_tokens": 4}, "min_tokens", None),
        ({"response_format": {"type": "json_object"}}, "response_format", None),
        ({"guided_choice": ["a", "b"]}, "guided_choice", None),
        ({"guided_regex": "a+"}, "guided_regex", None),
        ({"guided_choice": "a"}, "guided_choice", None),
        ({"guided_regex": ["a"]}, "guided_regex", None),
    ],
)  # fmt: skip
async def test_unhonoured_fields_are_400s_naming_them(
    stack: Stack, extra: dict[str, object], param: str, code: str | None
) -> None:
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=stack.url) as http:
        r = await http.post("/v1/chat/completions", json={**body, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["code"] == code


async def test_a_body_nested_too_deeply_is_a_400(stack: Stack) -> None:
    """A schema (any free-form object) nested deeper than the decoder recurses is the
    client's error, not the server's."""
    depth = 5000
    schema = '{"type": "array", "items": ' * depth + "{}" + "}" * depth
    body = (
        '{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "guided_json": '
        + schema
        + "}"
    )
    async with httpx.AsyncClient(base_url=stack.url) as http:
        r = await http.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
    assert r.status_code == 400, r.text
    assert "nested" in r.json()["error"]["message"]


async def test_the_official_client_gets_a_bad_request_error(stack: Stack) -> None:
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="no tool-call parser"):
        await api.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hi"}], tools=[tool]
        )
    ok = await api.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "hi"}], tools=[tool],
        tool_choice="none", max_tokens=2,
    )  # fmt: skip
    assert ok.choices[0].finish_reason in ("stop", "length")
    await api.close()


async def test_completions_echo_starts_the_text_with_the_prompt(stack: Stack) -> None:
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    whole = await api.completions.create(
        model="echo", prompt="hello there", max_tokens=2, echo=True
    )
    text = whole.choices[0].text
    assert text.startswith("hello there") and len(text) > len("hello there")
    stream = await api.completions.create(
        model="echo", prompt="hello there", max_tokens=2, echo=True, stream=True
    )
    streamed = "".join([c.choices[0].text async for c in stream if c.choices])
    assert streamed == text
    plain = await api.completions.create(model="echo", prompt="hello there", max_tokens=2)
    assert text == "hello there" + plain.choices[0].text
    await api.close()
