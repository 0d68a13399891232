"""Structured outputs with the real SmolLM2 model (llama.cpp) through HTTP and the official
client: every answer matches what it was asked to match, whole and streamed; a constraint the
model cannot honour or that does not compile is a 400."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest
from tests.frontend.stack import Stack

from turnout.engines.mocker import MockerEngine

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
TAGS = {
    "type": "object",
    "properties": {
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 2,
            "maxItems": 4,
        },
        "done": {"type": "boolean"},
    },
    "required": ["tags", "done"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture
def stack(smol_stack: Stack) -> Stack:
    return smol_stack


def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)


def ask(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("schema", [PERSON, TAGS], ids=["person", "tags"])
async def test_every_json_schema_answer_parses_and_validates(
    stack: Stack, schema: dict[str, Any]
) -> None:
    api = client(stack)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for seed in (1, 2, 3):
        out = await api.chat.completions.create(
            model="smol", messages=ask("Describe someone."), response_format=fmt,
            temperature=1.0, seed=seed, max_tokens=300,
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
    stream = await api.chat.completions.create(
        model="smol", messages=ask("Describe someone."), response_format=fmt,
        temperature=1.0, seed=4, max_tokens=300, stream=True,
    )  # fmt: skip
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    jsonschema.validate(json.loads(text), schema)
    await api.close()


async def test_json_object_choice_and_regex(stack: Stack) -> None:
    api = client(stack)
    # Any object will do: strings are unbounded, so the prompt asks for a short one (a
    # small model may otherwise write one string until its token limit).
    out = await api.chat.completions.create(
        model="smol", messages=ask('Reply with the JSON object {"ok": true}.'), max_tokens=200,
        response_format={"type": "json_object"}, temperature=0,
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)
    choices = ["red", "green", "blue"]
    for seed in (1, 2):
        out = await api.chat.completions.create(
            model="smol", messages=ask("Pick a colour."), temperature=1.0, seed=seed,
            extra_body={"guided_choice": choices},
        )  # fmt: skip
        assert out.choices[0].message.content in choices
    done = await api.completions.create(
        model="smol", prompt="Today's date:", max_tokens=20,
        extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"},
    )  # fmt: skip
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", done.choices[0].text)
    await api.close()


async def test_streamed_choice_regex_and_json_object(stack: Stack) -> None:
    api = client(stack)

    async def chat_text(**fields: Any) -> tuple[str, str | None]:
        stream = await api.chat.completions.create(
            model="smol", messages=ask(fields.pop("q")), stream=True, **fields
        )
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    choices = ["alpha", "beta gamma", 'say "delta"']
    for seed in (5, 6):
        text, finish = await chat_text(
            q="Pick one.", temperature=1.0, seed=seed, extra_body={"guided_choice": choices}
        )
        assert text in choices and finish == "stop"
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    text, finish = await chat_text(
        q="A phone number?", temperature=1.0, seed=7, extra_body={"guided_regex": phone}
    )
    assert re.fullmatch(phone, text) and finish == "stop", text
    text, finish = await chat_text(
        q='Reply with the JSON object {"ok": true}.', temperature=0, max_tokens=200,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(text), dict) and finish == "stop"
    stream = await api.completions.create(
        model="smol", prompt="The date is", max_tokens=20, stream=True,
        extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"},
    )  # fmt: skip
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", text)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    done = await api.completions.create(
        model="smol", prompt="A JSON object:", max_tokens=30, temperature=0,
        extra_body={"guided_json": json.dumps(schema)},
    )  # fmt: skip
    jsonschema.validate(json.loads(done.choices[0].text), schema)
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    done = await api.completions.create(
        model="smol", prompt="A JSON object:", max_tokens=30, temperature=0,
        extra_body={"response_format": fmt},
    )  # fmt: skip
    jsonschema.validate(json.loads(done.choices[0].text), schema)
    await api.close()


async def test_forced_tool_calls(stack: Stack) -> None:
    api = client(stack)
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    out = await api.chat.completions.create(
        model="smol", messages=ask("Weather in Paris?"), tools=[WEATHER], tool_choice=named,
        max_tokens=100,
    )  # fmt: skip
    calls = out.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
    args = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    stream = await api.chat.completions.create(
        model="smol", messages=ask("Weather in Oslo?"), tools=[WEATHER], tool_choice="required",
        max_tokens=150, stream=True,
    )  # fmt: skip
    names, arguments, finish = [], "", None
    async for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.function and call.function.name:
                names.append(call.function.name)
            arguments += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert names and set(names) == {"get_weather"} and finish == "tool_calls"
    await api.close()


async def test_constraints_that_do_not_compile_are_400s(stack: Stack) -> None:
    api = client(stack)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}},
         "response_format"),
        ({"extra_body": {"guided_regex": "(open"}}, "guided_regex"),
        ({"extra_body": {"guided_choice": ["a"], "guided_regex": "a"}}, "guided_choice"),
        ({"extra_body": {"guided_json": {"type": "object", "required": "name"}}},
         "guided_json"),
        ({"extra_body": {"guided_regex": r"(?=a)b"}}, "guided_regex"),
        ({"extra_body": {"guided_choice": "a"}}, "guided_choice"),
        ({"extra_body": {"guided_json": {"type": "string"}},
          "response_format": {"type": "json_object"}}, "guided_json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format"),
    ]  # fmt: skip
    for fields, param in bad:
        with pytest.raises(openai.BadRequestError) as info:
            await api.chat.completions.create(model="smol", messages=ask("hi"), **fields)
        assert info.value.body["param"] == param  # type: ignore[index]
    await api.close()


async def test_a_model_without_grammars_refuses(
    two_mockers: tuple[Stack, list[MockerEngine]],
) -> None:
    http, _ = two_mockers
    api = client(http)
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(
            model="mock", messages=ask("hi"), response_format={"type": "json_object"}
        )
    assert info.value.body["param"] == "response_format"  # type: ignore[index]
    assert "cannot enforce json_object" in info.value.body["message"]  # type: ignore[index]
    await api.close()
