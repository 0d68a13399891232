"""The Responses API's request (``POST /v1/responses``), and its translation into the chat
request that runs it.

``store`` (OpenAI's default: true), ``previous_response_id`` and ``conversation`` are the
response store's (``frontend.responses.history``): a chained request runs as if its input held the
chain's (or the conversation's) items before its own. Every field is honoured or refused with
a 400 naming it; unknown fields are refused by the struct.
"""

from __future__ import annotations

from typing import Any

import msgspec

from turnout.errors import RequestError
from turnout.llm.limits import RequestLimits
from turnout.protocols.openai import ChatCompletionRequest, ChatMessage, Int64

#: Message roles of input items, and the chat role each becomes.
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesStreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: turnout pads no event, whichever is asked (see chat's ``StreamOptions``).
    include_obfuscation: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    #: A string (one user message) or a list of items: messages, function calls and their
    #: outputs, reasoning (dropped: earlier turns' reasoning is not replayed to the model,
    #: as chat templates drop it).
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    #: None: OpenAI's default, true (stored when the frontend has a store).
    store: bool | None = None
    previous_response_id: str | None = None
    #: A conversation id, or ``{"id": ...}`` (``responses.history.conversation_of``).
    conversation: str | dict[str, Any] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    top_logprobs: Int64 | None = None
    #: As chat's (``openai_fields.check_openai_fields``); ``prompt_cache_key`` is the routing
    #: session key, as chat's.
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    stream_options: ResponsesStreamOptions | None = None


def to_chat(req: ResponsesRequest, limits: RequestLimits | None = None) -> ChatCompletionRequest:
    """The chat request that runs ``req``; a 400 naming the field for what it cannot honour.
    ``limits``: the bounds checked here, before the translation's work, under this API's
    field names (the preprocessor checks the chat request's again)."""
    _refuse_unsupported(req)
    if limits is not None:
        if isinstance(req.input, list):
            limits.check_messages(len(req.input), param="input")
        if req.tools:
            limits.check_tools(len(req.tools))
    messages: list[ChatMessage] = []
    if req.instructions:
        messages.append(ChatMessage(role="system", content=req.instructions))
    if isinstance(req.input, str):
        messages.append(ChatMessage(role="user", content=req.input))
    else:
        messages.extend(_messages(req.input))
    if not messages:
        raise RequestError("'input' must not be empty", param="input")
    tools = [_tool(t) for t in req.tools] if req.tools else None
    return ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stream=req.stream,
        user=req.user,
        tools=tools,
        tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req.text),
        reasoning_effort=(req.reasoning or {}).get("effort"),
        metadata=req.metadata,
        service_tier=req.service_tier,
        safety_identifier=req.safety_identifier,
    )


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.reasoning and any(v is not None for k, v in req.reasoning.items() if k != "effort"):
        raise RequestError(
            "'reasoning' takes an 'effort' only (chat's 'reasoning_effort'): summaries are not "
            "written, a model's reasoning comes back whole",
            param="reasoning",
        )
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise RequestError("'reasoning.effort' must be a string", param="reasoning")
    if req.truncation not in (None, "disabled"):
        raise RequestError("'truncation' must be 'disabled'", param="truncation")
    if req.include:
        raise RequestError(f"'include' {req.include} is not supported", param="include")
    if req.top_logprobs:
        raise RequestError("'top_logprobs' is not supported on /v1/responses", param="top_logprobs")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise RequestError("'max_output_tokens' must be at least 1", param="max_output_tokens")


def _messages(items: list[dict[str, Any]]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role", ""))
            if role is None:
                raise RequestError(
                    f"input message role {item.get('role')!r} is not one of {sorted(_ROLES)}",
                    param="input",
                )
            out.append(ChatMessage(role=role, content=_text(item.get("content"))))
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id"),
                "type": "function",
                "function": {"name": _field(item, "name"), "arguments": _field(item, "arguments")},
            }
            last = out[-1] if out else None
            if (
                last is not None
                and last.role == "assistant"
                and last.tool_calls
                and not last.content
            ):
                last.tool_calls.append(call)  # parallel calls of one turn
            else:
                # Empty text rather than null: templates (SmolLM2's) concatenate content.
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                ChatMessage(
                    role="tool",
                    tool_call_id=_field(item, "call_id"),
                    content=output if isinstance(output, str) else _text(output),
                )
            )
        elif kind == "reasoning":
            continue
        else:
            raise RequestError(f"input items of type {kind!r} are not supported", param="input")
    return out


def _field(item: dict[str, Any], name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise RequestError(f"{item.get('type')} items need a string '{name}'", param="input")
    return value


def _text(content: Any) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError("message content must be a string or a list of parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(
                f"content parts of type {kind!r} are not supported (text only)", param="input"
            )
        texts.append(part["text"])
    return "".join(texts)


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise RequestError(
            f"tools of type {tool.get('type')!r} are not supported (function tools only, "
            "with a 'name')",
            param="tools",
        )
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(
        "'tool_choice' must be 'none', 'auto', 'required' or "
        '{"type": "function", "name": ...}',
        param="tool_choice",
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (the model's capabilities decide)."""
    if not text:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise RequestError(f"'text' has unknown field(s) {sorted(unknown)}", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise RequestError("'text.verbosity' is not supported", param="text")
    fmt = text.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise RequestError(f"'text.format' type {fmt.get('type')!r} is not supported", param="text")
