"""Structured outputs: what a request says its output must match, compiled and checked.

A request may ask for one of: ``response_format`` ``json_object`` / ``json_schema``,
vLLM's ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (chat and
completions), or, through ``tool_choice`` ``required`` or a named function, a JSON schema of
the tool calls (as vLLM forces them). Each becomes one lark grammar in llguidance's dialect
(:class:`~turnout.protocols.llm.StructuredOutput`), which the engine enforces while sampling.

A JSON schema is first checked against its meta-schema (``jsonschema``), then the grammar
with ``llguidance`` (the library the engines compile it with), so an invalid schema, one that
does not compile, a bad regex or a broken grammar is a 400 naming the field and the problem
before any work is done: llama.cpp, given a grammar it cannot compile, would
otherwise sample freely and answer 200 with text that matches nothing. Checks are cached (by
grammar text, bounded): clients send the same schema again and again.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import msgspec

from turnout.errors import RequestError
from turnout.protocols.llm import StructuredOutput
from turnout.protocols.model import ModelDeploymentCard
from turnout.protocols.openai import ChatCompletionRequest, CompletionRequest

#: Longest schema, regex, grammar or list of choices accepted (characters of its text).
MAX_SOURCE_CHARS = 64 * 1024
_HEADER = "%llguidance {}\n"
_RESPONSE_FORMAT_KEYS = {"type", "json_schema"}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
_encode = msgspec.json.Encoder().encode
#: What OpenAI allows as a response format's name.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def structured_output(
    card: ModelDeploymentCard, req: ChatCompletionRequest | CompletionRequest
) -> StructuredOutput | None:
    """The request's output constraint (None: free text), refused with a 400 naming the
    field when malformed, when it does not compile, or when the model cannot enforce it."""
    asked = _asked(req)
    if len(asked) > 1:
        raise RequestError(
            f"give at most one of {', '.join(param for param, _, _ in asked)}",
            param=asked[1][0],
        )
    if not asked:
        return None
    param, kind, source = asked[0]
    if kind not in card.capabilities.structured_outputs:
        can = ", ".join(card.capabilities.structured_outputs) or "none"
        raise RequestError(
            f"model '{card.display_name}' cannot enforce {kind} output (its engine enforces: "
            f"{can})",
            param=param,
        )
    return StructuredOutput(kind=kind, grammar=_compile(param, kind, source))


def source_chars(req: ChatCompletionRequest | CompletionRequest) -> int:
    """About how many characters of constraint sources (schemas, regexes, grammars, tools)
    ``req`` carries: the preprocessor checks large ones off the event loop (a meta-schema
    check of a schema near ``MAX_SOURCE_CHARS`` takes a few hundred milliseconds)."""
    size = 0
    for value in (req.guided_json, req.guided_regex, req.guided_grammar, req.guided_choice):
        if isinstance(value, str):
            size += len(value)
        elif value is not None:
            size += len(_encode(value))
    if req.response_format is not None:
        size += len(_encode(req.response_format))
    if isinstance(req, ChatCompletionRequest) and req.tools is not None:
        size += len(_encode(req.tools))
    return size


def _asked(req: ChatCompletionRequest | CompletionRequest) -> list[tuple[str, str, Any]]:
    """(param, kind, source) of every constraint the request gives."""
    asked: list[tuple[str, str, Any]] = []
    fmt = _response_format(req.response_format)
    if fmt is not None:
        asked.append(("response_format", *fmt))
    if isinstance(req, ChatCompletionRequest):
        forced = forced_tool_schema(req)
        if forced is not None:
            asked.append(("tool_choice", "json_schema", forced))
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise RequestError(
                    f"'guided_json' is not valid JSON: {exc}", param="guided_json"
                ) from None
        asked.append(("guided_json", "json_schema", schema))
    if req.guided_regex is not None:
        asked.append(("guided_regex", "regex", req.guided_regex))
    if req.guided_choice is not None:
        asked.append(("guided_choice", "choice", req.guided_choice))
    if req.guided_grammar is not None:
        asked.append(("guided_grammar", "grammar", req.guided_grammar))
    return asked


def _response_format(fmt: dict[str, Any] | None) -> tuple[str, Any] | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    unknown = set(fmt) - _RESPONSE_FORMAT_KEYS
    if unknown:
        raise RequestError(
            f"'response_format' has unknown field(s) {sorted(unknown)}", param="response_format"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", {"type": "object"}
    if kind != "json_schema":
        raise RequestError(
            "'response_format.type' must be 'text', 'json_object' or 'json_schema'",
            param="response_format",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise RequestError(
            "'response_format.json_schema' must be an object with a 'name'",
            param="response_format",
        )
    unknown = set(spec) - _JSON_SCHEMA_KEYS
    if unknown:
        raise RequestError(
            f"'response_format.json_schema' has unknown field(s) {sorted(unknown)}",
            param="response_format",
        )
    if not _NAME.fullmatch(spec["name"]):
        raise RequestError(
            "'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-'",
            param="response_format",
        )
    for key, kind in (("strict", bool), ("description", str)):
        if key in spec and not isinstance(spec[key], kind):
            raise RequestError(
                f"'response_format.json_schema.{key}' must be a {kind.__name__}",
                param="response_format",
            )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise RequestError(
            "'response_format.json_schema.schema' must be an object", param="response_format"
        )
    return "json_schema", schema


def forced_tool_schema(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema a ``tool_choice`` that forces calls puts on the output: a named
    function's parameters, or (``required``) an array of calls to any offered tool, each
    ``{"name", "parameters"}``, of one call only when ``parallel_tool_calls`` is false.
    None when the choice forces nothing.

    Either way every call's arguments are held to its tool's ``parameters`` while sampling:
    this is how a tool's ``strict: true`` is honoured (with ``tool_choice`` ``auto`` the
    model writes calls in its own markup, which no grammar here constrains)."""
    choice = req.tool_choice
    if not req.tools or choice in (None, "auto", "none"):
        return None
    tools = [_function(t) for t in req.tools]
    if choice == "required":
        calls = 1 if req.parallel_tool_calls is False else None
        return {
            "type": "array",
            "minItems": 1,
            **({"maxItems": calls} if calls else {}),
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "enum": [fn["name"]]},
                            "parameters": fn.get("parameters") or {"type": "object"},
                        },
                        "required": ["name", "parameters"],
                    }
                    for fn in tools
                ]
            },
        }
    name = named_tool(choice)
    for fn in tools:
        if fn["name"] == name:
            return fn.get("parameters") or {"type": "object"}
    raise RequestError(f"'tool_choice' names '{name}', which 'tools' lacks", param="tool_choice")


def named_tool(choice: Any) -> str:
    """The function a named ``tool_choice`` (``{"type": "function", "function": {"name"}}``)
    forces; a 400 for any other shape."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return fn["name"]
    raise RequestError(
        "'tool_choice' must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def _function(tool: Any) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or tool.get("type") != "function" or not fn.get("name"):
        raise RequestError(
            'each of \'tools\' must be {"type": "function", "function": {"name", ...}}',
            param="tools",
        )
    return fn


def _compile(param: str, kind: str, source: Any) -> str:
    if kind in ("json_object", "json_schema"):
        if not isinstance(source, dict):
            raise RequestError(f"'{param}' must be a JSON schema object", param=param)
        try:
            text = json.dumps(source, ensure_ascii=False, sort_keys=True)
        except RecursionError:
            raise RequestError(f"'{param}' is nested too deeply", param=param) from None
        _bound(param, text)
        problem = _schema_problem(text)
        if problem:
            raise RequestError(f"'{param}' is not a valid JSON schema: {problem}", param=param)
        if "x-guidance" not in source:
            # Compact JSON (no white space between tokens), as OpenAI writes it: with free
            # white space, small models fill their token budget with tabs and newlines.
            source = {**source, "x-guidance": {"whitespace_flexible": False}}
        body = "start: %json " + json.dumps(source, ensure_ascii=False)
    elif kind == "regex":
        import llguidance

        if not source:
            raise RequestError(f"'{param}' must not be empty", param=param)
        body = "start: /" + llguidance.regex_to_lark(source) + "/"
    elif kind == "choice":
        if not source or not all(isinstance(c, str) and c for c in source):
            raise RequestError(f"'{param}' must be a list of non-empty strings", param=param)
        body = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in source)
    else:
        body = _grammar_body(source)
    _bound(param, body)
    grammar = _HEADER + body
    problem = grammar_problem(grammar)
    if problem:
        raise RequestError(f"'{param}' does not compile: {problem}", param=param)
    return grammar


def _bound(param: str, text: str) -> None:
    if len(text) > MAX_SOURCE_CHARS:
        raise RequestError(
            f"'{param}' is too large ({len(text)} characters; at most {MAX_SOURCE_CHARS})",
            param=param,
        )


def _grammar_body(source: str) -> str:
    """A grammar in llguidance's lark (with or without its header), or GBNF (``::=``)."""
    text = source.strip()
    if text.startswith("%llguidance"):
        return text.split("\n", 1)[1] if "\n" in text else ""
    if "::=" in text:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            return gbnf_to_lark(text)
        except Exception as exc:  # the converter raises whatever its parser does
            raise RequestError(
                f"'guided_grammar' is not valid GBNF: {exc}", param="guided_grammar"
            ) from None
    return text


@functools.lru_cache(maxsize=256)
def _schema_problem(text: str) -> str:
    """What makes the schema in ``text`` (canonical JSON) invalid against its meta-schema
    (``$schema``, by default draft 2020-12), with where; "" when it is valid.

    llguidance compiles only what a schema's root reaches and reads only the keywords it
    enforces, so it passes schemas that are not valid (a misspelt type in an unused
    ``$defs`` entry, a number as a ``description``, duplicate ``required`` names); the
    meta-schema catches those. ``format`` is not checked here: the meta-schema's ``regex``
    format would judge ``pattern`` by Python's ``re``, which refuses valid ECMA-262 patterns
    (``\\p{L}``, ``(?<name>...)``); llguidance compiles patterns with its own engine."""
    import jsonschema

    schema = json.loads(text)
    if not isinstance(schema.get("$schema", ""), str):
        return "'$schema' must be a string"
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    check = validator(validator.META_SCHEMA, format_checker=None)
    try:
        error = jsonschema.exceptions.best_match(check.iter_errors(schema))
    except RecursionError:
        return "it is nested too deeply"
    return "" if error is None else f"{error.message} (at {error.json_path})"


@functools.lru_cache(maxsize=256)
def grammar_problem(grammar: str) -> str:
    """llguidance's complaint about ``grammar`` ("" when it compiles). Engines that compile
    grammars with llguidance check what they are sent with it too: the frontend may run
    another llguidance, or none (a client of the request plane)."""
    import llguidance

    return llguidance.LLMatcher.validate_grammar(grammar).strip()
