"""Structured outputs at the preprocessor: what each request field becomes, and every way a
request is refused (malformed, not compiling, not enforceable by the model)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnout.errors import RequestError
from turnout.llm.model_card import load_model_card
from turnout.llm.structured import forced_tool_schema, structured_output
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.model import EndpointId, ModelCapabilities, ModelDeploymentCard
from turnout.protocols.openai import ChatCompletionRequest, CompletionRequest

ALL = ["json_object", "json_schema", "regex", "choice", "grammar"]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def card(gguf_path: Path) -> ModelDeploymentCard:
    card = load_model_card(
        gguf_path, endpoint=EndpointId(namespace="ns", component="c", name="g"), display_name="smol"
    )
    return msgspec.structs.replace(card, capabilities=ModelCapabilities(structured_outputs=ALL))


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


def completion(**fields: Any) -> CompletionRequest:
    return msgspec.convert({"model": "smol", "prompt": "Hi", **fields}, CompletionRequest)


@pytest.mark.parametrize(
    ("fields", "kind", "grammar_has"),
    [
        (
            {"response_format": {"type": "json_object"}},
            "json_object",
            '%json {"type": "object", "x-guidance"',
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n",
                                                                        "schema": SCHEMA,
                                                                        "strict": True}}},
            "json_schema",
            "%json " + json.dumps(SCHEMA)[:-1],
        ),
        ({"guided_json": SCHEMA}, "json_schema", '"required": ["n"]'),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema", '"required": ["n"]'),
        ({"guided_regex": r"\d{4}-\d{2}/x"}, "regex", r"start: /\d{4}-\d{2}\/x/"),
        ({"guided_choice": ["yes", 'say "no"']}, "choice", 'start: "yes" | "say \\"no\\""'),
        ({"guided_grammar": 'start: "a" | "b"'}, "grammar", 'start: "a" | "b"'),
        ({"guided_grammar": 'root ::= "a" | "b"'}, "grammar", '"a"'),
        ({"tools": [TOOL], "tool_choice": "required"}, "json_schema", '"minItems": 1'),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function",
                                              "function": {"name": "get_weather"}}},
            "json_schema",
            '"city"',
        ),
    ],
)  # fmt: skip
def test_each_field_becomes_a_checked_grammar(
    card: ModelDeploymentCard, fields: dict[str, Any], kind: str, grammar_has: str
) -> None:
    out = structured_output(card, chat(**fields))
    assert out is not None and out.kind == kind
    assert out.grammar.startswith("%llguidance {}\n")
    assert grammar_has in out.grammar


def test_free_text_has_no_constraint(card: ModelDeploymentCard) -> None:
    assert structured_output(card, chat()) is None
    assert structured_output(card, chat(response_format={"type": "text"})) is None
    assert structured_output(card, chat(tools=[TOOL], tool_choice="auto")) is None
    assert structured_output(card, completion(guided_choice=["a"])) is not None
    assert structured_output(card, completion(response_format={"type": "text"})) is None
    on_completions = structured_output(card, completion(response_format={"type": "json_object"}))
    assert on_completions is not None and on_completions.kind == "json_object"


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "must be 'text'"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "with a 'name'"),
        ({"response_format": {"type": "json_object", "extra": 1}}, "response_format", "extra"),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": [1]}}},
            "response_format", "must be an object",
        ),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {}, "bogus": 1}}},
            "response_format", "bogus",
        ),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "a b", "schema": {}}}},
            "response_format", "name' must be 1 to 64",
        ),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
            "response_format", "strict' must be a bool",
        ),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
            "response_format", "not a valid JSON schema",
        ),
        ({"guided_json": {"$ref": "#/nowhere"}}, "guided_json", "does not compile"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": {"type": "strnig"}}, "guided_json", r"not a valid JSON schema.*\$\.type"),
        (
            {"guided_json": {"$defs": {"x": {"type": "strnig"}}, "type": "string"}},
            "guided_json", r"not a valid JSON schema: 'strnig' .*\$\['\$defs'\]\.x\.type",
        ),
        ({"guided_json": {"description": 5}}, "guided_json", "not a valid JSON schema"),
        ({"guided_json": {"required": ["a", "a"]}}, "guided_json", "non-unique"),
        ({"guided_json": {"$schema": ["x"]}}, "guided_json", r"'\$schema' must be a string"),
        ({"guided_json": {"type": "string", "pattern": "(x"}}, "guided_json", "does not compile"),
        ({"guided_json": {"type": "string", "format": "bogus"}}, "guided_json", "Unknown format"),
        ({"guided_json": {"not": {"type": "string"}}}, "guided_json", "Unimplemented keys"),
        ({"guided_json": _nested(300)}, "guided_json", "nested too deeply"),
        ({"guided_json": _nested(5000)}, "guided_json", "nested too deeply"),
        (
            {"guided_json": {"enum": [f"value {i}" for i in range(8000)]}},
            "guided_json", "too large",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex", "does not compile"),
        ({"guided_regex": ""}, "guided_regex", "must not be empty"),
        ({"guided_choice": []}, "guided_choice", "non-empty strings"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty strings"),
        ({"guided_grammar": "start: ("}, "guided_grammar", "does not compile"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex", "at most one",
        ),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice", "'tools' lacks",
        ),
        ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice", "must be 'none'"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "each of"),
        ({"guided_regex": "a" * 70000}, "guided_regex", "too large"),
    ],
)  # fmt: skip
def test_bad_constraints_are_refused_naming_the_field(
    card: ModelDeploymentCard, fields: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(RequestError, match=message) as info:
        structured_output(card, chat(**fields))
    assert info.value.param == param


@pytest.mark.parametrize(
    "schema",
    [
        # ECMA-262 patterns Python's re refuses: the meta-schema check leaves them to
        # llguidance, which compiles them.
        {"type": "string", "pattern": "^\\p{L}+$"},
        {"type": "string", "pattern": "(?<year>[0-9]{4})"},
        {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
         "definitions": {"n": {"type": "integer"}},
         "properties": {"a": {"$ref": "#/definitions/n"}}},
        {"type": "string", "format": "email"},
    ],
)  # fmt: skip
def test_valid_schemas_pass(card: ModelDeploymentCard, schema: dict[str, Any]) -> None:
    out = structured_output(card, completion(guided_json=schema))
    assert out is not None and out.kind == "json_schema"


def test_a_model_that_cannot_enforce_it_refuses(card: ModelDeploymentCard) -> None:
    bare = msgspec.structs.replace(card, capabilities=ModelCapabilities())
    with pytest.raises(RequestError, match=r"cannot enforce regex output .*enforces: none"):
        structured_output(bare, completion(guided_regex="a+"))
    with pytest.raises(RequestError) as info:
        structured_output(bare, chat(tools=[TOOL], tool_choice="required"))
    assert info.value.param == "tool_choice"


def test_required_tools_schema_lists_each_tool() -> None:
    other = {"type": "function", "function": {"name": "get_time"}}
    schema = forced_tool_schema(chat(tools=[TOOL, other], tool_choice="required"))
    assert schema is not None
    variants = schema["items"]["anyOf"]
    assert [v["properties"]["name"]["enum"] for v in variants] == [["get_weather"], ["get_time"]]
    assert variants[1]["properties"]["parameters"] == {"type": "object"}


# ---------------------------------------------------------------- what a regex grammar accepts

#: Patterns in the common subset (literals, classes, ``.``, ``\d\w\s``, groups, alternation,
#: ``? * + {m,n}``, anchors, inline flags).
PATTERNS = [
    r"\d{4}-\d{2}-\d{2}",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"[A-Z][a-z]+( [A-Z][a-z]+){0,3}",
    r"(yes|no|maybe)",
    r"\w+@\w+\.(com|org)",
    r"[^\n]{0,10}",
    r"a?b*c+d{2,3}",
    r"\s*x\s*",
    r"^\d+$",
    r"(?i)abc",
    r".{1,5}",
    r"[\d.,]+|-",
]


@pytest.fixture(scope="module")
def matcher_tokenizer(smol_tokenizer: Tokenizer) -> Any:
    import llguidance

    return llguidance.LLTokenizer(smol_tokenizer.inner.to_str())


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_regex_grammar_accepts_what_the_regex_matches(
    card: ModelDeploymentCard,
    smol_tokenizer: Tokenizer,
    matcher_tokenizer: Any,
    pattern: str,
) -> None:
    """Strings that fully match the pattern (by Python's ``re``), as the model's tokens, are
    accepted whole by the grammar the request becomes. ASCII only: the dialect is Rust's
    ``regex`` (llguidance's), whose Unicode ``\\s`` and ``\\w`` differ from Python's at the
    edges (``\\x1c``, ``³``), and SmolLM2's vocabulary cannot spell some 4-byte characters."""
    import llguidance

    out = structured_output(card, completion(guided_regex=pattern))
    assert out is not None
    ascii_text = st.characters(
        codec="ascii", exclude_categories=["Cc"], include_characters="\t\n\r"
    )

    @settings(max_examples=40, deadline=None, database=None)
    @given(st.from_regex(pattern, fullmatch=True, alphabet=ascii_text))
    def accepted(text: str) -> None:
        assert re.fullmatch(pattern, text)
        matcher = llguidance.LLMatcher(matcher_tokenizer, out.grammar)
        ids = smol_tokenizer.encode(text, add_special_tokens=False)
        assert matcher.consume_tokens(ids), matcher.get_error()
        assert matcher.is_accepting(), text

    accepted()


def test_a_regex_grammar_refuses_what_the_regex_does_not_match(
    card: ModelDeploymentCard, smol_tokenizer: Tokenizer, matcher_tokenizer: Any
) -> None:
    import llguidance

    out = structured_output(card, completion(guided_regex=r"\d{4}-\d{2}-\d{2}"))
    assert out is not None
    for text in ("2024-1-01", "2024-01-01x", "abcd-ef-gh"):
        matcher = llguidance.LLMatcher(matcher_tokenizer, out.grammar)
        ids = smol_tokenizer.encode(text, add_special_tokens=False)
        assert not (matcher.consume_tokens(ids) and matcher.is_accepting()), text
