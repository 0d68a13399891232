"""Anthropic's Messages API request (``POST /v1/messages``, ``/v1/messages/count_tokens``)
and its translation into the chat request that runs it.

Every field is honoured or refused with a 400 naming it, at every depth: content blocks,
``tool_choice``, ``thinking`` and ``metadata`` are structs that refuse unknown fields, and a
block of an unknown ``type`` is refused by its tag. Client tools are checked the same way once
told apart from server tools (``web_search_...``, refused by name).

Translation:

* ``system`` (a string or text blocks) is the first, ``system`` message.
* Assistant ``thinking`` / ``redacted_thinking`` blocks in the history are dropped, as chat
  templates drop earlier turns' reasoning (and their signatures are Claude's).
* ``tool_use`` / ``tool_result`` blocks become the chat template's tool calls and tool
  messages; ``is_error`` prefixes the result with ``Error: ``.
* ``cache_control`` (on blocks and tools, and the top-level one that marks the last
  cacheable block) is accepted: the engines cache every prompt prefix by themselves, so the
  prefix a breakpoint marks is cached without it.
* ``thinking`` ``disabled`` sets the template's ``enable_thinking`` (Qwen3's switch) on a
  model that reasons; a reasoning model whose template has no such switch cannot stop, so the
  request is refused. ``enabled`` is refused: a reasoning budget cannot be held to.
  ``adaptive`` (the model decides whether to think) is ``disabled`` on a model that does not
  reason, and refused, as ``enabled``, on one that does.
* ``output_config.format`` (what the client's ``messages.parse()`` sends) is chat's
  ``response_format`` ``json_schema``: the engine holds the answer to the schema, or the
  request is refused when it cannot. ``output_config.effort`` sets the template's reasoning
  switch as chat's ``reasoning_effort`` does (``llm.reasoning_switch``).
* ``tool_choice.disable_parallel_tool_use`` is chat's ``parallel_tool_calls: false``.
* Tools with ``strict: true`` are chat's strict tools: the schema holds a call's input while
  sampling when ``tool_choice`` forces calls (``any``, or ``tool``) on a model whose engine
  enforces JSON schemas; with ``auto`` the model writes calls in its own markup, unconstrained.

``anthropic-version`` and ``x-api-key`` headers are accepted and not checked: authentication
belongs to the gateway in front of turnout.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

from turnout.errors import RequestError
from turnout.llm.limits import RequestLimits
from turnout.llm.reasoning_switch import reasoning_switch
from turnout.protocols.model import ModelDeploymentCard
from turnout.protocols.openai import ChatCompletionRequest, ChatMessage, Int64

#: The options of every tagged request struct: strict, told apart by `type`.
_TAGGED: dict[str, Any] = {"kw_only": True, "forbid_unknown_fields": True, "tag_field": "type"}


class CacheControlEphemeral(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A prompt-cache breakpoint (served by the engines' automatic prefix caching)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlockParam(msgspec.Struct, tag="text", **_TAGGED):
    text: str
    cache_control: CacheControlEphemeral | None = None
    #: Only null or empty: there are no documents to cite.
    citations: list[Any] | None = None


class ImageBlockParam(msgspec.Struct, tag="image", **_TAGGED):
    """Decoded so it is refused with its reason (no model served here takes images)."""

    source: dict[str, Any]
    cache_control: CacheControlEphemeral | None = None


class ToolUseBlockParam(msgspec.Struct, tag="tool_use", **_TAGGED):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControlEphemeral | None = None


class ToolResultBlockParam(msgspec.Struct, tag="tool_result", **_TAGGED):
    tool_use_id: str
    content: str | list[TextBlockParam | ImageBlockParam] = ""
    is_error: bool | None = None
    cache_control: CacheControlEphemeral | None = None


class ThinkingBlockParam(msgspec.Struct, tag="thinking", **_TAGGED):
    thinking: str
    signature: str


class RedactedThinkingBlockParam(
    msgspec.Struct,
    tag="redacted_thinking",
    **_TAGGED,
):
    data: str


ContentBlockParam = (
    TextBlockParam
    | ImageBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam
)


class InputMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class ToolChoiceAuto(msgspec.Struct, tag="auto", **_TAGGED):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(msgspec.Struct, tag="any", **_TAGGED):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(msgspec.Struct, tag="tool", **_TAGGED):
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(msgspec.Struct, tag="none", **_TAGGED):
    pass


ToolChoiceParam = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingEnabled(msgspec.Struct, tag="enabled", **_TAGGED):
    """Decoded so it is refused with its reason."""

    budget_tokens: int


class ThinkingDisabled(msgspec.Struct, tag="disabled", **_TAGGED):
    pass


class ThinkingAdaptive(msgspec.Struct, tag="adaptive", **_TAGGED):
    """The model decides whether to think (see the module docstring)."""

    display: Literal["summarized", "omitted"] | None = None


ThinkingParam = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive


class JsonOutputFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: str | None = None
    format: JsonOutputFormat | None = None


class ClientTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A client tool; server tools carry a versioned ``type`` and are refused by it."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControlEphemeral | None = None
    strict: bool | None = None


class MessageMetadata(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: The end user's id: chat's ``user``.
    user_id: str | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: list[InputMessage]
    system: str | list[TextBlockParam] | None = None
    #: Loose here so a server tool is refused by its name (client tools: ``ClientTool``).
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    #: Top-level breakpoint: a hint the engines' prefix caching serves without.
    cache_control: CacheControlEphemeral | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest, kw_only=True, forbid_unknown_fields=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
    stop_sequences: list[str] | None = None
    #: Anthropic's range (chat completions' reaches 2).
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    stream: bool = False
    metadata: MessageMetadata | None = None
    #: One tier here, which serves both.
    service_tier: Literal["auto", "standard_only"] | None = None


def to_chat(
    req: CountTokensRequest,
    card: ModelDeploymentCard,
    *,
    max_tokens: int | None = None,
    limits: RequestLimits | None = None,
) -> ChatCompletionRequest:
    """The chat request that runs ``req`` on the model of ``card``. A ``CountTokensRequest``
    renders the same prompt with tool choice ``none``: tools reach the template whatever the
    choice, and counting needs no tool-call parser. ``limits``: the bounds checked here,
    before the translation's work, under this API's field names (the preprocessor checks
    the chat request's again)."""
    if not req.messages:
        raise RequestError("'messages' must not be empty", param="messages")
    if limits is not None:
        limits.check_messages(len(req.messages))
        if req.tools:
            limits.check_tools(len(req.tools))
        if isinstance(req, MessagesRequest):
            limits.check_stop(req.stop_sequences, param="stop_sequences")
    messages: list[ChatMessage] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _text(req.system, "system")
        messages.append(ChatMessage(role="system", content=system))
    for i, message in enumerate(req.messages):
        messages.extend(_message(message, f"messages[{i}]", card.display_name))
    tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(req.tools)] if req.tools else None
    tool_choice = _tool_choice(req.tool_choice, tools)
    parallel = req.tool_choice is None or not getattr(
        req.tool_choice, "disable_parallel_tool_use", False
    )
    fields: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        fields = {
            "response_format": _response_format(req.output_config),
            "max_tokens": req.max_tokens,
            "stop": req.stop_sequences,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "stream": req.stream,
            "user": req.metadata.user_id if req.metadata is not None else None,
        }
    else:
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        if tools:
            tool_choice = "none"
    return ChatCompletionRequest(
        model=req.model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=None if parallel else False,
        chat_template_kwargs=_template_kwargs(req, card),
        **fields,
    )


def _message(message: InputMessage, where: str, model: str) -> list[ChatMessage]:
    role, content = message.role, message.content
    if isinstance(content, str):
        return [ChatMessage(role=role, content=content)]
    out: list[ChatMessage] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(block, TextBlockParam):
            if block.citations:
                raise RequestError("citations are not supported", param=f"{at}.citations")
            texts.append(block.text)
        elif isinstance(block, ToolUseBlockParam) and role == "assistant":
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        elif isinstance(block, ToolResultBlockParam) and role == "user":
            result = block.content
            if not isinstance(result, str):
                result = _text(result, f"{at}.content", model)
            out.append(
                ChatMessage(
                    role="tool",
                    tool_call_id=block.tool_use_id,
                    content=f"Error: {result}" if block.is_error else result,
                )
            )
        elif isinstance(block, ThinkingBlockParam | RedactedThinkingBlockParam) and (
            role == "assistant"
        ):
            continue
        elif isinstance(block, ImageBlockParam):
            raise _no_image(model, at)
        else:
            kind = type(block).__struct_config__.tag
            raise RequestError(
                f"content blocks of type {kind!r} are not supported in {role} messages", param=at
            )
    if texts or calls:
        out.append(ChatMessage(role=role, content="".join(texts), tool_calls=calls or None))
    return out


def _no_image(model: str, where: str) -> RequestError:
    return RequestError(
        f"model '{model}' does not take images (content blocks of type 'image' are refused)",
        param=where,
    )


def _text(blocks: list[Any], param: str, model: str = "") -> str:
    texts = []
    for k, block in enumerate(blocks):
        if isinstance(block, ImageBlockParam):
            raise _no_image(model, f"{param}[{k}]")
        if block.citations:
            raise RequestError("citations are not supported", param=f"{param}[{k}].citations")
        texts.append(block.text)
    return "".join(texts)


def _tool(raw: dict[str, Any], where: str) -> dict[str, Any]:
    kind = raw.get("type")
    if kind not in (None, "custom"):
        raise RequestError(
            f"tools of type {kind!r} are not supported (client tools with a 'name' and an "
            "'input_schema' only)",
            param=where,
        )
    try:
        tool = msgspec.convert(raw, ClientTool)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid tool: {exc}", param=where) from None
    fn: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description:
        fn["description"] = tool.description
    if tool.strict is not None:
        fn["strict"] = tool.strict
    return {"type": "function", "function": fn}


def _tool_choice(choice: ToolChoiceParam | None, tools: list[dict[str, Any]] | None) -> Any:
    if choice is None:
        return None
    if isinstance(choice, ToolChoiceNone):
        return "none" if tools else None
    if not tools:
        raise RequestError("'tool_choice' needs 'tools'", param="tool_choice")
    if isinstance(choice, ToolChoiceAuto):
        return "auto"
    if isinstance(choice, ToolChoiceAny):
        return "required"
    if choice.name not in {t["function"]["name"] for t in tools}:
        raise RequestError(
            f"'tool_choice' names '{choice.name}', which is not one of the tools",
            param="tool_choice.name",
        )
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(config: OutputConfig | None) -> dict[str, Any] | None:
    """``output_config.format`` as chat's ``response_format``."""
    if config is None or config.format is None:
        return None
    schema = config.format.schema
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def _template_kwargs(req: CountTokensRequest, card: ModelDeploymentCard) -> dict[str, Any] | None:
    """The template variables ``thinking`` and ``output_config.effort`` set (see the module
    docstring); a 400 when they set one variable two ways."""
    kwargs = _thinking(req.thinking, card) or {}
    effort = req.output_config.effort if req.output_config is not None else None
    if effort is not None:
        for key, value in reasoning_switch(card, effort, "output_config.effort").items():
            if kwargs.setdefault(key, value) != value:
                raise RequestError(
                    f"'output_config.effort' {effort!r} and 'thinking' disagree on whether the "
                    "model thinks",
                    param="output_config.effort",
                )
    return kwargs or None


def _thinking(thinking: ThinkingParam | None, card: ModelDeploymentCard) -> dict[str, Any] | None:
    """``thinking`` (see the module docstring)."""
    if thinking is None:
        return None
    if isinstance(thinking, ThinkingEnabled):
        raise RequestError(
            "'thinking' budgets are not enforced by turnout; a model with a reasoning parser "
            "returns its thinking blocks without this field",
            param="thinking",
        )
    if isinstance(thinking, ThinkingAdaptive):
        if card.capabilities.reasoning_parser is None:
            return None  # it does not reason: it has decided already
        raise RequestError(
            f"'thinking' 'adaptive' is not supported on model '{card.display_name}', which "
            "reasons as its chat template says: leave 'thinking' out to get its thinking "
            "blocks, or send 'disabled'",
            param="thinking",
        )
    if card.capabilities.reasoning_parser is None:
        return None  # it does not reason: disabled already
    if "enable_thinking" not in (card.chat_template or ""):
        raise RequestError(
            f"model '{card.display_name}' always reasons (its chat template has no "
            "'enable_thinking' switch): thinking cannot be disabled",
            param="thinking",
        )
    return {"enable_thinking": False}
