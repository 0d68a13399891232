"""Tool-call and reasoning parsers: the structure a model writes into its text.

A model's card names its formats (``--tool-call-parser``, ``--reasoning-parser`` on the
worker); the frontend makes one :class:`OutputParser` per response choice and feeds it the
detokenized text as it streams. Out come answer text, reasoning text and tool calls
(:class:`ParsedDelta`). Reasoning is split off first; tool calls are read from what remains.

Parsers never raise on model output: what does not parse comes back as answer text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .reasoning import ThinkTags
    from .tool_calls import ToolCallParser


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of one tool call: its first piece has the id and name, every piece may add
    argument text (JSON)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class OutputParser:
    """One response choice's parser; text goes in as it is decoded."""

    __slots__ = ()

    #: The formats' markup is made of special tokens, which the text must then keep.
    needs_special_tokens: bool = False

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        """The output ended: whatever was held back."""
        raise NotImplementedError

    @property
    def called_tools(self) -> bool:
        raise NotImplementedError


class _Chain(OutputParser):
    """Reasoning split off first, then tool calls read from the answer text."""

    __slots__ = ("_reasoning", "_tools", "needs_special_tokens")

    def __init__(self, reasoning: ThinkTags | None, tools: ToolCallParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self.needs_special_tokens = tools is not None and tools.needs_special_tokens

    def feed(self, text: str) -> ParsedDelta:
        if self._reasoning is None:
            return self._answer(text, "", final=False)
        reasoning, answer = self._reasoning.feed(text)
        return self._answer(answer, reasoning, final=False)

    def finish(self) -> ParsedDelta:
        reasoning, answer = self._reasoning.finish() if self._reasoning else ("", "")
        return self._answer(answer, reasoning, final=True)

    def _answer(self, text: str, reasoning: str, *, final: bool) -> ParsedDelta:
        tools = self._tools
        if tools is None:
            return ParsedDelta(content=text, reasoning=reasoning)
        out = tools.feed(text) if text else ParsedDelta()
        if final:
            tail = tools.finish()
            out.content += tail.content
            out.tool_calls.extend(tail.tool_calls)
        out.reasoning = reasoning
        return out

    @property
    def called_tools(self) -> bool:
        return self._tools is not None and self._tools.called


def _names(tools: list[dict[str, Any]] | None) -> frozenset[str]:
    names = set()
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return frozenset(names)


TOOL_CALL_PARSERS = ("deepseek_v3", "harmony", "hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSERS = ("deepseek_r1", "harmony", "qwen3")


def check_parser_names(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Raise ``ValueError`` naming an unknown parser and the known ones."""
    for kind, name, known in (
        ("tool-call", tool_call_parser, TOOL_CALL_PARSERS),
        ("reasoning", reasoning_parser, REASONING_PARSERS),
    ):
        if name is not None and name not in known:
            raise ValueError(f"unknown {kind} parser {name!r} (known: {', '.join(known)})")


def make_output_parser(
    *,
    tool_call_parser: str | None,
    reasoning_parser: str | None,
    tools: list[dict[str, Any]] | None,
) -> OutputParser | None:
    """The parser of one response choice; None when there is nothing to parse (plain text).

    Tool calls are looked for only when ``tools`` are offered (and only calls to them count).
    ``harmony`` is one format for reasoning, answer and calls: either name gives the one parser
    of all three, even without ``tools`` (its channel markup is never the answer; tool calls
    then come back as text).
    """
    check_parser_names(tool_call_parser, reasoning_parser)
    names = _names(tools)
    if "harmony" in (tool_call_parser, reasoning_parser):
        from .harmony import HarmonyParser

        return HarmonyParser(names if tool_call_parser == "harmony" else frozenset())
    tool_call_parser = tool_call_parser if names else None
    if tool_call_parser is None and reasoning_parser is None:
        return None
    reasoning = None
    if reasoning_parser is not None:
        from .reasoning import ThinkTags

        reasoning = ThinkTags(opens_in_prompt=reasoning_parser == "deepseek_r1")
    parser = None
    if tool_call_parser is not None:
        from .tool_calls import TOOL_CALL_PARSER_CLASSES

        parser = TOOL_CALL_PARSER_CLASSES[tool_call_parser](names)
    return _Chain(reasoning, parser)
