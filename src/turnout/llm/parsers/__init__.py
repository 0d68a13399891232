"""Tool-call and reasoning parsers: the structure a model writes into its text.

Contract only, for now: the parsers themselves arrive with their own module; until then no
model has one, and :func:`make_output_parser` has nothing to make.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of one tool call: its first piece names it, the rest add argument text."""

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
    """One response's parser; text goes in as it is decoded."""

    needs_special_tokens: bool = False

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        raise NotImplementedError

    @property
    def called_tools(self) -> bool:
        raise NotImplementedError


TOOL_CALL_PARSERS: tuple[str, ...] = ()
REASONING_PARSERS: tuple[str, ...] = ()


def check_parser_names(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
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
    return None
