"""One choice's output between the decoder and a response writer.

A plain choice (no parser, no log probabilities) is text and nothing else: writers take the
decoded text directly, the per-token fast path. Anything more (reasoning and tool calls parsed
out of the text, log probabilities) goes through :class:`ChoiceOutput`, which turns decoded
deltas into :class:`ChoicePiece` s for streamed writers and remembers what it has said for
whole responses and for the finish reason (``tool_calls`` once a call was made).

Every surface (chat completions, completions, the Responses API, Anthropic messages) writes
its own shape from the same pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from turnout.frontend.models.pipeline import TokensPipeline
from turnout.frontend.openai.logprobs import LogprobsBuilder
from turnout.llm.backend import DecodedDelta
from turnout.llm.parsers import OutputParser, ParsedDelta, ToolCallDelta, make_output_parser
from turnout.llm.parsers.forced import NamedToolOutput, RequiredToolsOutput
from turnout.llm.structured import named_tool
from turnout.protocols.llm import FinishReason, PreprocessedRequest
from turnout.protocols.model import ModelCapabilities
from turnout.protocols.openai import ChatCompletionRequest, CompletionRequest


@dataclass(slots=True)
class ChoicePiece:
    """What one decoded delta adds to a choice, ready for a writer."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: dict[str, Any] | None = None

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.logprobs)


@dataclass(slots=True)
class ToolCall:
    """A whole tool call, as a non-streamed response reports it."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class WholeChoice:
    """One finished choice of a whole (not streamed) response."""

    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def output_parser(
    capabilities: ModelCapabilities,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
) -> OutputParser | None:
    """The parser a chat request's output needs on this model (None: plain text).

    A ``tool_choice`` that forces calls makes the engine write them as JSON (see
    ``llm.structured``), read as such. Otherwise tool calls are parsed in the model's own
    format when the request offers tools and does not say ``none``; reasoning whenever the
    model has a reasoning parser."""
    if tools and tool_choice == "required":
        return RequiredToolsOutput(tools)
    if tools and isinstance(tool_choice, dict):
        return NamedToolOutput(named_tool(tool_choice))
    parse_tools = bool(tools) and tool_choice != "none"
    # gpt-oss writes every answer in harmony's channels: its parser always runs (without
    # tools its calls are text), or the analysis markup would become the answer.
    keep = parse_tools or capabilities.tool_call_parser == "harmony"
    return make_output_parser(
        tool_call_parser=capabilities.tool_call_parser if keep else None,
        reasoning_parser=capabilities.reasoning_parser,
        tools=tools if parse_tools else None,
    )


class ChoiceOutput:
    """One choice's parser and log probabilities, and everything it has said so far (only
    with ``keep``: a streamed choice is written as it goes, and keeping its whole text and
    log probabilities would cost memory in proportion to its length for nothing).
    ``single_call`` (``parallel_tool_calls: false``): the first call the model writes is the
    choice's only one, later ones are dropped (as vLLM does)."""

    __slots__ = ("_calls", "_content", "_keep", "_reasoning", "_single", "logprobs", "parser")

    def __init__(
        self,
        parser: OutputParser | None,
        logprobs: LogprobsBuilder | None,
        *,
        keep: bool = True,
        single_call: bool = False,
    ) -> None:
        self.parser = parser
        self.logprobs = logprobs
        self._keep = keep
        self._single = single_call
        self._content: list[str] = []
        self._reasoning: list[str] = []
        #: Calls by index: id, name, argument fragments.
        self._calls: dict[int, tuple[str, str, list[str]]] = {}

    @property
    def plain(self) -> bool:
        """Text only: writers may take the decoded text as it is."""
        return self.parser is None and self.logprobs is None

    def take(self, delta: DecodedDelta) -> ChoicePiece:
        """A decoded delta's share of the response (may be empty: text held by a parser)."""
        logprobs = self.logprobs.add(delta) if self.logprobs is not None else None
        if self.parser is None:
            if delta.text and self._keep:
                self._content.append(delta.text)
            return ChoicePiece(content=delta.text, logprobs=logprobs)
        piece = self._record(self.parser.feed(delta.text) if delta.text else ParsedDelta())
        piece.logprobs = logprobs
        return piece

    def end(self) -> ChoicePiece:
        """The stream has ended: what the parser still held."""
        if self.parser is None:
            return ChoicePiece()
        return self._record(self.parser.finish())

    def finish_reason(self, reason: FinishReason) -> str:
        """OpenAI's name for how the choice ended: ``tool_calls`` when it called a tool and
        stopped on its own."""
        if reason in (FinishReason.STOP, FinishReason.EOS) and self._calls:
            return "tool_calls"
        return reason.to_openai()

    def whole(self, reason: FinishReason, prefix: str = "") -> WholeChoice:
        """The finished choice; ``prefix`` starts its text (completions' ``echo``)."""
        return WholeChoice(
            text=prefix + "".join(self._content),
            finish_reason=self.finish_reason(reason),
            logprobs=self.logprobs.whole() if self.logprobs is not None else None,
            reasoning="".join(self._reasoning),
            tool_calls=[
                ToolCall(call_id, name, "".join(args))
                for _, (call_id, name, args) in sorted(self._calls.items())
            ],
        )

    def _record(self, parsed: ParsedDelta) -> ChoicePiece:
        keep = self._keep
        if parsed.content and keep:
            self._content.append(parsed.content)
        if parsed.reasoning and keep:
            self._reasoning.append(parsed.reasoning)
        if self._single and parsed.tool_calls:
            parsed.tool_calls = [call for call in parsed.tool_calls if call.index == 0]
        for call in parsed.tool_calls:
            known = self._calls.get(call.index)
            if known is None:
                known = self._calls[call.index] = (call.id or "", call.name or "", [])
            if keep:
                known[2].append(call.arguments)
        return ChoicePiece(parsed.content, parsed.reasoning, parsed.tool_calls)


def choice_output(
    pipeline: TokensPipeline,
    request: ChatCompletionRequest | CompletionRequest,
    pre: PreprocessedRequest,
    *,
    text_offset: int = 0,
    keep: bool = True,
) -> ChoiceOutput:
    """A fresh output stage for one choice of ``request``: the model's parsers (chat only)
    and the log probabilities it asked for. A parser that reads the model's special tokens
    has them kept in the decoded text of ``pre``. ``keep``: the choice is answered whole at
    its end (``ChoiceOutput.whole``), so what it says is kept."""
    parser = None
    single_call = False
    if isinstance(request, ChatCompletionRequest):
        single_call = request.parallel_tool_calls is False
        parser = output_parser(pipeline.card.capabilities, request.tools, request.tool_choice)
        if parser is not None and parser.needs_special_tokens:
            pre.output_options = msgspec.structs.replace(
                pre.output_options, skip_special_tokens=False
            )
    logprobs = None
    if pre.output_options.logprobs is not None:
        logprobs = LogprobsBuilder(
            pipeline.preprocessor.tokenizer,
            is_chat=pipeline.is_chat,
            text_offset=text_offset,
            keep=keep,
        )
    return ChoiceOutput(parser, logprobs, keep=keep, single_call=single_call)
