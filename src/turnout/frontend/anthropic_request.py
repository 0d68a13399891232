"""Anthropic's Messages API request (``POST /v1/messages``, ``/v1/messages/count_tokens``)
and its translation into the chat request that runs it.

Every field is honoured or refused with a 400 naming it (unknown fields by the struct).
Assistant ``thinking`` blocks in the history are dropped, as chat templates drop earlier
turns' reasoning; ``tool_use`` / ``tool_result`` blocks become the chat template's tool calls
and tool messages. ``anthropic-version`` and ``x-api-key`` headers are accepted and not
checked: authentication belongs to the gateway in front of turnout.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

from turnout.errors import RequestError
from turnout.protocols.model import ModelDeploymentCard
from turnout.protocols.openai import ChatCompletionRequest, ChatMessage


class InputMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    #: A string, or content blocks (``text``, ``tool_use``, ``tool_result``, ``thinking``).
    content: str | list[dict[str, Any]]


class CountTokensRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: list[InputMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest, kw_only=True, forbid_unknown_fields=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


def to_chat(
    req: CountTokensRequest, card: ModelDeploymentCard, *, max_tokens: int | None = None
) -> ChatCompletionRequest:
    """The chat request that runs ``req`` on the model of ``card``."""
    messages: list[ChatMessage] = []
    if req.system:
        messages.append(ChatMessage(role="system", content=_text(req.system, "system")))
    for message in req.messages:
        messages.extend(_message(message))
    if not req.messages:
        raise RequestError("'messages' must not be empty", param="messages")
    fields: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        if req.service_tier not in (None, "auto", "standard_only"):
            raise RequestError(
                "'service_tier' must be 'auto' or 'standard_only'", param="service_tier"
            )
        user = (req.metadata or {}).get("user_id")
        unknown = set(req.metadata or {}) - {"user_id"}
        if unknown:
            raise RequestError(
                f"'metadata' has unknown field(s) {sorted(unknown)}", param="metadata"
            )
        fields = {
            "max_tokens": req.max_tokens,
            "stop": req.stop_sequences,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "stream": req.stream,
            "user": user if isinstance(user, str) else None,
        }
    elif max_tokens is not None:
        fields["max_tokens"] = max_tokens
    tools = [_tool(t) for t in req.tools] if req.tools else None
    return ChatCompletionRequest(
        model=req.model,
        messages=messages,
        tools=tools,
        tool_choice=_tool_choice(req.tool_choice, bool(tools)),
        chat_template_kwargs=_thinking(req.thinking, card),
        **fields,
    )


def _message(message: InputMessage) -> list[ChatMessage]:
    role, content = message.role, message.content
    if isinstance(content, str):
        return [ChatMessage(role=role, content=content)]
    out: list[ChatMessage] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(
                {
                    "id": _string(block, "id"),
                    "type": "function",
                    "function": {
                        "name": _string(block, "name"),
                        "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False),
                    },
                }
            )
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text(result, "messages")
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append(
                ChatMessage(role="tool", tool_call_id=_string(block, "tool_use_id"), content=text)
            )
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            raise RequestError(
                f"content blocks of type {kind!r} are not supported in {role} messages",
                param="messages",
            )
    if texts or calls:
        out.append(ChatMessage(role=role, content="".join(texts), tool_calls=calls or None))
    return out


def _string(block: dict[str, Any], name: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise RequestError(f"{block.get('type')} blocks need a string '{name}'", param="messages")
    return value


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{param}' must be a string or a list of text blocks", param=param)
    texts = []
    for block in content:
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            kind = block.get("type") if isinstance(block, dict) else None
            raise RequestError(
                f"blocks of type {kind!r} are not supported here (text only)", param=param
            )
        texts.append(block["text"])
    return "".join(texts)


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom") or not isinstance(tool.get("name"), str):
        raise RequestError(
            f"tools of type {tool.get('type')!r} are not supported (client tools with a "
            "'name' and an 'input_schema' only)",
            param="tools",
        )
    fn: dict[str, Any] = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
    if tool.get("description"):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any] | None, has_tools: bool) -> Any:
    if choice is None:
        return None
    if choice.get("disable_parallel_tool_use"):
        raise RequestError(
            "'disable_parallel_tool_use' is not supported (a model may call several tools)",
            param="tool_choice",
        )
    kind = choice.get("type")
    if kind == "none":
        return "none" if has_tools else None
    if not has_tools:
        raise RequestError("'tool_choice' needs 'tools'", param="tool_choice")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(
        '\'tool_choice\' must be {"type": "auto" | "any" | "none"} or '
        '{"type": "tool", "name": ...}',
        param="tool_choice",
    )


def _thinking(thinking: dict[str, Any] | None, card: ModelDeploymentCard) -> dict[str, Any] | None:
    """``thinking``: ``disabled`` asks the template not to think (Qwen3's ``enable_thinking``)
    on a model that reasons; ``enabled`` is refused, since a token budget for the reasoning
    cannot be held to (a model with a reasoning parser returns its thinking regardless)."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "disabled":
        reasons = card.capabilities.reasoning_parser is not None
        return {"enable_thinking": False} if reasons else None
    if kind == "enabled":
        raise RequestError(
            "'thinking' budgets are not enforced by turnout; a model with a reasoning parser "
            "returns its thinking blocks without this field",
            param="thinking",
        )
    raise RequestError("'thinking.type' must be 'enabled' or 'disabled'", param="thinking")
