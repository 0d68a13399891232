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

Templates come from model cards, so from whoever can write the discovery store: each render
runs on a budget (``llm.template_sandbox``) of operations, characters built and time, sized
from the request (``render_budget``), so that no template can hold the event loop or grow the
process, whatever it loops over. A template that exceeds its budget is the model's fault:
``TemplateLimitExceeded`` (HTTP 500). ``probe`` renders a small conversation on a small
budget, so a card whose template spins on any input is refused once, when it is loaded.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NoReturn

import jinja2

from turnout.errors import ConfigError, RequestError, TemplateLimitExceeded

from .template_sandbox import (
    BoundedEnvironment,
    RenderBudget,
    bounded_strftime,
    make_environment,
    rendering,
    weight,
)


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
def _environment() -> BoundedEnvironment:
    env = make_environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False)
    env.bound_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = bounded_strftime(_strftime_now)
    return env


@dataclass(frozen=True, slots=True)
class TemplateLimits:
    """How a render's budget grows with its request (``render_budget``).

    A request's *items* are its messages and tools; its *characters*, those of everything it
    hands the template. Measured on SmolLM2's template and on templates shaped like Qwen2.5's
    and Llama 3.1's (see the tests), over conversations of 300 to 400 messages: 5 to 16
    operations an item, 2.4 times the input's characters built at most, and an output of
    1.4 to 2.4 times the input plus 20 to 30 characters an item. The defaults leave a factor
    of 12 or more on each. The slowest operations (attribute access on a namespace, macro
    calls) take about 2 µs, so a template that ignores its input stops within about 0.25 s
    on a small request, and within about 5 s (in the thread large requests render in) on
    the largest one (10,000 messages, ``--max-messages``).
    """

    ops_base: int = 100_000
    ops_per_item: int = 200
    #: Output (and any one value): this, plus per item, plus a multiple of the input.
    output_base_chars: int = 1 << 20
    output_per_item_chars: int = 1024
    output_per_input_char: int = 4
    #: Characters built in all, as a multiple of the output bound (``a ~ b ~ c`` builds its
    #: intermediate strings too).
    built_factor: int = 8
    #: Wall-clock backstop (the operation count is the bound that should act).
    seconds_base: float = 2.0
    seconds_per_item: float = 0.001


DEFAULT_LIMITS = TemplateLimits()


def render_budget(
    items: int, input_chars: int, limits: TemplateLimits = DEFAULT_LIMITS
) -> RenderBudget:
    """The budget of a render of ``items`` messages and tools of ``input_chars`` in all."""
    output = (
        limits.output_base_chars
        + limits.output_per_item_chars * items
        + limits.output_per_input_char * input_chars
    )
    return RenderBudget(
        ops=limits.ops_base + limits.ops_per_item * items,
        chars=limits.built_factor * output,
        max_value_chars=output,
        deadline=time.monotonic() + limits.seconds_base + limits.seconds_per_item * items,
    )


#: What ``probe`` renders: a system prompt, two user turns around an answer, a tool.
_PROBE_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is the weather in Paris?"},
]
_PROBE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    """One compiled template per distinct source text (cards of one model share it)."""
    return _environment().from_string(source)


def _flatten_content(content: Any, index: int) -> Any:
    """A message's content for the template: a list of parts becomes one string.

    Text parts (and an assistant's ``refusal`` parts, which are what it said) are concatenated
    in order with nothing between them; any other part type is rejected, naming it, since a
    text-only model cannot take it.
    """
    if not isinstance(content, list):
        return content
    texts: list[str] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind not in ("text", "refusal"):
            raise RequestError(
                f"content part of type {kind!r} is not supported; only 'text' parts are",
                param=f"messages.[{index}].content",
            )
        text = part.get(kind)
        if not isinstance(text, str):
            raise RequestError(
                f"a {kind!r} content part needs a string {kind!r} field",
                param=f"messages.[{index}].content",
            )
        texts.append(text)
    return "".join(texts)


class ToolArguments(dict[str, Any]):
    """A replayed tool call's arguments, as both forms templates expect: the object that
    HF-style templates read (``arguments | tojson``, ``arguments | items``, ``is mapping``),
    whose text is the JSON the client sent, for templates that write the arguments as they
    came (``{{ arguments }}``, ``'...' + arguments + '...'``, DeepSeek V3's).

    Arguments that are not a JSON object (malformed, or cut short by a token limit when the
    model wrote them) are an empty object with their text kept, as vLLM makes them: a
    conversation whose history holds them can still go on.
    """

    __slots__ = ("text",)

    def __init__(self, value: dict[str, Any], text: str) -> None:
        super().__init__(value)
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __add__(self, other: object) -> str:
        if isinstance(other, str):
            return self.text + other
        return NotImplemented

    def __radd__(self, other: object) -> str:
        if isinstance(other, str):
            return other + self.text
        return NotImplemented


def tool_arguments(value: Any) -> Any:
    """A tool call's ``arguments`` (JSON text, as OpenAI sends them, or an object, as some
    clients do) as ``ToolArguments``."""
    if isinstance(value, dict):
        try:
            return ToolArguments(value, json.dumps(value, ensure_ascii=False))
        except (TypeError, ValueError, RecursionError):
            return value
    if value is None or value == "":
        return ToolArguments({}, "{}")
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        parsed = None
    return ToolArguments(parsed if isinstance(parsed, dict) else {}, value)


def _tool_calls(calls: Any) -> Any:
    """Calls with their arguments as ``ToolArguments`` (new dicts: the request is not
    changed)."""
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping):
            call = {**call, "function": {**fn, "arguments": tool_arguments(fn.get("arguments"))}}
        out.append(call)
    return out


#: A template that tells null content apart from empty text (DeepSeek V3's picks its
#: tool-call branch on ``message['content'] is none``).
_TESTS_NULL_CONTENT = re.compile(
    r"""content['"]?\]?\s*(?:is\s+(?:not\s+)?none|[!=]=\s*none)\b""", re.IGNORECASE
)


def tests_null_content(source: str) -> bool:
    """Whether the template ``source`` tests a message's content for null."""
    return _TESTS_NULL_CONTENT.search(source) is not None


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], *, keep_null_content: bool = False
) -> list[dict[str, Any]]:
    """Messages as HF templates expect them, whatever shape a client replays them in:

    * ``content`` a string. An assistant turn with tool calls and no text (OpenAI's
      ``content: null``, or ``""``) has ``""`` (Jinja writes null as ``None``, and templates
      that concatenate content fail on it), or null for a template that tests for it
      (``keep_null_content``: it picks its tool-call branch on null). A turn that carries
      only a ``refusal`` has that as its content: it is what the model said.
    * tool calls' ``arguments`` as ``ToolArguments`` (objects that write as their JSON text).
    * fields that are null left out; ``tool_call_id`` and ``name`` kept.
    """
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg = {k: v for k, v in m.items() if v is not None and k != "refusal"}
        content = _flatten_content(m.get("content"), i)
        refusal = m.get("refusal")
        if not content and isinstance(refusal, str) and refusal:
            content = refusal
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"])
            content = (content or None) if keep_null_content else (content or "")
        elif content is None:
            content = ""
        msg["content"] = content
        out.append(msg)
    return out


class ChatTemplate:
    """One model's chat template, compiled once."""

    __slots__ = ("_null_content", "_template", "bos_token", "eos_token", "source")

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        #: The template tells null content apart from empty text (``normalize_messages``).
        self._null_content = tests_null_content(source)
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
        Raises ``RequestError`` with the template's message when rendering fails, and
        ``TemplateLimitExceeded`` when the template passes the budget ``render_budget``
        gives a request of this size.
        """
        normalized = normalize_messages(messages, keep_null_content=self._null_content)
        context: dict[str, Any] = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **extra,
            "messages": normalized,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
        }
        items = len(normalized) + (len(tools) if tools else 0)
        input_chars = _input_chars(normalized)
        if tools:
            input_chars += _json_chars(tools)
        if extra:
            input_chars += _json_chars(extra)
        return self._render(context, render_budget(items, input_chars))

    def probe(self) -> None:
        """Render a small conversation, with and without a tool, on the budget of a small
        request: ``TemplateLimitExceeded`` when the template passes it (it would on every
        request). Any other failure is the probe's, not the template's (a template may
        refuse a system message, or tools), and passes."""
        for tools in (None, _PROBE_TOOLS):
            context: dict[str, Any] = {
                "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or "",
                "messages": normalize_messages(
                    _PROBE_MESSAGES, keep_null_content=self._null_content
                ),
                "add_generation_prompt": True,
                "tools": tools,
            }
            try:
                self._render(context, render_budget(len(_PROBE_MESSAGES), 200))
            except (RequestError, ConfigError):
                continue

    def _render(self, context: dict[str, Any], budget: RenderBudget) -> str:
        """Render under ``budget``, piece by piece, the output's length checked as it grows."""
        parts: list[str] = []
        total = 0
        limit = budget.max_value_chars
        try:
            with rendering(budget):
                for part in self._template.generate(context):
                    total += len(part)
                    if total > limit:
                        raise TemplateLimitExceeded(
                            f"the chat template writes more than {limit} characters for a "
                            "request of this size"
                        )
                    parts.append(part)
        except TemplateLimitExceeded:
            raise
        except RecursionError as e:
            raise TemplateLimitExceeded("the chat template recurses too deeply") from e
        except OverflowError as e:  # the sandbox's range bound, or a number too large
            raise TemplateLimitExceeded(f"the chat template went out of bounds: {e}") from e
        except MemoryError as e:
            raise TemplateLimitExceeded("the chat template ran out of memory") from e
        except TemplateRaised as e:
            raise RequestError(_short(str(e)), param="messages") from e
        except jinja2.TemplateError as e:
            raise RequestError(f"chat template error: {_short(str(e))}", param="messages") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise RequestError(f"chat template error: {_short(str(e))}", param="messages") from e
        return "".join(parts)


#: ``weight`` of the request's own data: measured whole (it is bounded by the body's size).
_UNBOUNDED = 1 << 62
#: The longest template error message passed on to the client.
_MAX_MESSAGE_CHARS = 1000


def _input_chars(messages: list[dict[str, Any]]) -> int:
    """The characters of ``messages``: their strings, and the weight of anything else (tool
    calls), without walking what is plain text."""
    total = 0
    for message in messages:
        for value in message.values():
            total += len(value) if type(value) is str else weight(value, _UNBOUNDED)
    return total


def _json_chars(value: Any) -> int:
    """The length of ``value`` as JSON (it came as JSON: encoding it is the quickest way to
    measure it), else its ``weight``."""
    try:
        return len(json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError):
        return weight(value, _UNBOUNDED)


def _short(message: str) -> str:
    if len(message) <= _MAX_MESSAGE_CHARS:
        return message
    return message[:_MAX_MESSAGE_CHARS] + "..."


__all__ = [
    "DEFAULT_LIMITS",
    "ChatTemplate",
    "TemplateLimits",
    "ToolArguments",
    "normalize_messages",
    "render_budget",
    "tests_null_content",
    "tool_arguments",
]
