"""Output of a request whose ``tool_choice`` forces tool calls.

With ``tool_choice`` ``required`` or a named function, the engine's structured output makes
the model write JSON and nothing else (the preprocessor turns the choice into a JSON schema,
as vLLM does), so the output is read as calls rather than searched for a model's markup:

* a named function: the whole output is that function's arguments, streamed as they come;
* ``required``: the output is a JSON array of ``{"name", "parameters"}``, one per call, read
  when it is complete (a partial array says nothing reliable about a call's end).
"""

from __future__ import annotations

import json
from typing import Any

from . import OutputParser, ParsedDelta, ToolCallDelta
from .text import new_call_id


class NamedToolOutput(OutputParser):
    """The output is the arguments of one call to ``name``."""

    __slots__ = ("_id", "_name", "_started")

    def __init__(self, name: str) -> None:
        self._name = name
        self._id = new_call_id()
        self._started = False

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        return ParsedDelta(tool_calls=[self._piece(text)])

    def finish(self) -> ParsedDelta:
        if self._started:
            return ParsedDelta()
        return ParsedDelta(tool_calls=[self._piece("{}")])

    def _piece(self, arguments: str) -> ToolCallDelta:
        if self._started:
            return ToolCallDelta(0, arguments=arguments)
        self._started = True
        return ToolCallDelta(0, id=self._id, name=self._name, arguments=arguments)

    @property
    def called_tools(self) -> bool:
        return self._started


class RequiredToolsOutput(OutputParser):
    """The output is a JSON array of calls, each ``{"name": ..., "parameters": {...}}``.

    Output that is not such an array (the token limit cut it, say) comes back as text."""

    __slots__ = ("_called", "_names", "_parts")

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self._names = {fn.get("name") for t in tools if isinstance(fn := t.get("function"), dict)}
        self._parts: list[str] = []
        self._called = False

    def feed(self, text: str) -> ParsedDelta:
        self._parts.append(text)
        return ParsedDelta()

    def finish(self) -> ParsedDelta:
        text = "".join(self._parts)
        self._parts.clear()
        calls = _read_calls(text, self._names)
        if calls is None:
            return ParsedDelta(content=text)
        self._called = bool(calls)
        return ParsedDelta(
            tool_calls=[
                ToolCallDelta(i, id=new_call_id(), name=name, arguments=arguments)
                for i, (name, arguments) in enumerate(calls)
            ]
        )

    @property
    def called_tools(self) -> bool:
        return self._called


def _read_calls(text: str, names: set[Any]) -> list[tuple[str, str]] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        params = item.get("parameters", {})
        if not isinstance(params, dict):
            return None
        calls.append((item["name"], json.dumps(params, ensure_ascii=False)))
    return calls
