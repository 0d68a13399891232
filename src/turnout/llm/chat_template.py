"""Chat templates: HF-compatible Jinja rendering of a message list into a prompt string.

Rendering matches ``transformers``' ``apply_chat_template``: jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, HF's ``tojson`` filter (``ensure_ascii=False``), and the
``raise_exception`` / ``strftime_now`` globals. Templates are model files, so they run
sandboxed: no attribute access to Python internals, no mutation of passed-in data.

A template that fails to compile is the model's fault (``ConfigError`` when the card is
loaded); a template that fails while rendering is, in practice, the request's fault (roles in
the wrong order, an unsupported feature the template rejects with ``raise_exception``), so it
becomes ``RequestError`` (HTTP 400) with the template's own message.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from turnout.errors import ConfigError, RequestError


class TemplateRaised(jinja2.TemplateError):
    """What the template's ``raise_exception(message)`` raises."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's filter, not jinja's: no HTML escaping, non-ASCII kept, indent/separators honoured.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
        keep_trailing_newline=False,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    """One compiled template per distinct source text (cards of one model share it)."""
    return _environment().from_string(source)


def _flatten_content(content: Any, index: int) -> Any:
    """A message's content for the template: a list of parts becomes one string.

    Text parts are concatenated in order with nothing between them; any other part type is
    rejected, naming it, since a text-only model cannot take it.
    """
    if not isinstance(content, list):
        return content
    texts: list[str] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind != "text":
            raise RequestError(
                f"content part of type {kind!r} is not supported; only 'text' parts are",
                param=f"messages.[{index}].content",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError(
                "a 'text' content part needs a string 'text' field",
                param=f"messages.[{index}].content",
            )
        texts.append(text)
    return "".join(texts)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as HF templates expect them: ``content`` a string (``""`` when null, unless
    the message carries tool calls), fields that are ``None`` left out."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg = {k: v for k, v in m.items() if v is not None}
        content = _flatten_content(m.get("content"), i)
        if content is None:
            content = None if m.get("tool_calls") else ""
        msg["content"] = content
        out.append(msg)
    return out


class ChatTemplate:
    """One model's chat template, compiled once."""

    __slots__ = ("_template", "bos_token", "eos_token", "source")

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _compile(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"chat template does not compile (line {e.lineno}): {e}") from e

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and ``content``).

        ``extra`` reaches the template as variables (``chat_template_kwargs``, e.g.
        ``enable_thinking``); it cannot override ``messages`` or the special tokens.
        Raises ``RequestError`` with the template's message when rendering fails.
        """
        context: dict[str, Any] = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **extra,
            "messages": normalize_messages(messages),
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
        }
        try:
            return self._template.render(context)
        except TemplateRaised as e:
            raise RequestError(str(e), param="messages") from e
        except jinja2.TemplateError as e:
            raise RequestError(f"chat template error: {e}", param="messages") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise RequestError(f"chat template error: {e}", param="messages") from e


__all__ = ["ChatTemplate", "normalize_messages"]
