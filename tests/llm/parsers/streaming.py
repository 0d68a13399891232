"""Running a parser over an output, whole or in chunks, and checking that every way of
streaming it gives the whole output's result."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from turnout.llm.parsers import make_output_parser

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time")
]
WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"tz": "Europe/Oslo"})


@dataclass
class Result:
    content: str = ""
    reasoning: str = ""
    calls: list[tuple[str, Any]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    called: bool = False


def run(
    chunks: list[str],
    tool: str | None = None,
    reasoning: str | None = None,
    tools: list[dict[str, Any]] | None = TOOLS,
) -> Result:
    """Feed ``chunks`` then finish; the deltas put together (each call's arguments parsed)."""
    parser = make_output_parser(tool_call_parser=tool, reasoning_parser=reasoning, tools=tools)
    assert parser is not None
    out = Result()
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for delta in [*(parser.feed(c) for c in chunks), parser.finish()]:
        out.content += delta.content
        out.reasoning += delta.reasoning
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index not in names, "a call's id comes once"
                names[call.index] = call.name or ""
                out.ids.append(call.id)
            args.setdefault(call.index, []).append(call.arguments)
    assert sorted(names) == list(range(len(names))), "indexes are 0, 1, ..."
    out.calls = [(names[i], json.loads("".join(args[i]))) for i in sorted(names)]
    out.called = parser.called_tools
    return out


def every_split(
    text: str,
    tool: str | None = None,
    reasoning: str | None = None,
    tools: list[dict[str, Any]] | None = TOOLS,
) -> Result:
    """The whole-text result, checked equal to streaming it one character at a time and to
    every split in two."""
    whole = run([text], tool, reasoning, tools)
    chars = run(list(text), tool, reasoning, tools)
    assert (chars.content, chars.reasoning, chars.calls) == (
        whole.content,
        whole.reasoning,
        whole.calls,
    )
    for i in range(1, len(text)):
        split = run([text[:i], text[i:]], tool, reasoning, tools)
        assert (split.content, split.reasoning, split.calls) == (
            whole.content,
            whole.reasoning,
            whole.calls,
        ), f"split at {i}: {text[:i]!r} | {text[i:]!r}"
    return whole
