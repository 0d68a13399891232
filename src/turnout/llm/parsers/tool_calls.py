"""Tool calls in a model's text, by model family.

* ``hermes`` (Qwen2.5/3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call.
* ``deepseek_v3``: ``<｜tool▁calls▁begin｜>`` then per call
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` and the arguments in a json code fence
  (V3) or right after the separator (V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}``),
  ``<｜tool▁call▁end｜>``; ``<｜tool▁calls▁end｜>`` closes the list.
* ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (v0.3), or
  ``NAME[ARGS]{...}`` per call, each after its own ``[TOOL_CALLS]`` (tokenizer v11+; ``NAME{...}``
  where the text lacks ``[ARGS]``, a ``[CALL_ID]id`` after the name tolerated); the calls run
  to the end of the output. (vLLM returns v11 calls with broken arguments as calls; here they
  are text, as in every format.)
* ``llama3_json`` (Llama 3.1/3.2): the whole output is ``{"name": ..., "parameters": {...}}``
  (``arguments`` accepted too), optionally after ``<|python_tag|>``, several joined by ``;``.
* ``pythonic`` (Llama 3.2/4): the whole output is a Python list of calls,
  ``[get_weather(city="Paris"), get_time()]``, literal arguments only (optionally inside
  ``<|python_start|>``/``<|python_end|>``).

Only calls to a function the request offered are calls. Anything malformed (bad JSON, an
unknown name, unterminated markup) comes back as text, never as an error. Markup that
delimits a call is held back while streaming until the call is complete, then the call is
emitted whole (one delta: id, name and all its arguments); text around calls streams as it
comes. Arguments are not streamed in fragments: a fragment sent cannot be taken back, so a
call whose JSON then broke would be a call streamed and text whole; waiting for the call's
end keeps the two the same and lets broken calls be text. A block left open at the end of
the output is a call if its contents parse (models often stop on EOS before the closing
tag), else text.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from . import ParsedDelta, ToolCallDelta
from .text import find_first, hold_partial, new_call_id


class ToolCallParser:
    """Base: content in, content and calls out. ``tools`` are the request's function names."""

    #: The markup is made of special tokens: the text must keep them.
    needs_special_tokens = False

    __slots__ = ("_count", "_names", "_space")

    def __init__(self, names: frozenset[str]) -> None:
        self._names = names
        self._count = 0
        #: White space after a call, held until text follows (then it is text) or another
        #: call or the end does (then it is dropped: it separates calls, it is no answer).
        self._space = ""

    def _text(self, out: ParsedDelta, text: str) -> None:
        if not self._count:
            out.content += text
        elif text.isspace():
            self._space += text
        elif text:
            out.content += self._space + text
            self._space = ""

    @property
    def called(self) -> bool:
        return self._count > 0

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        raise NotImplementedError

    def _calls(self, calls: list[tuple[str, Any]] | None, raw: str) -> ParsedDelta:
        """``calls`` as deltas when every one names an offered tool with object arguments;
        else ``raw`` as text."""
        if not calls or any(
            name not in self._names or not isinstance(args, dict) for name, args in calls
        ):
            return ParsedDelta(content=raw)
        deltas = []
        for name, args in calls:
            deltas.append(
                ToolCallDelta(
                    self._count,
                    id=new_call_id(),
                    name=name,
                    arguments=json.dumps(args, ensure_ascii=False),
                )
            )
            self._count += 1
        self._space = ""
        return ParsedDelta(tool_calls=deltas)


def _json_call(body: str, args_keys: tuple[str, ...] = ("arguments",)) -> tuple[str, Any] | None:
    """``{"name": ..., "arguments": {...}}`` as (name, arguments); None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            return obj["name"], args
    return obj["name"], {}


def _merge(a: ParsedDelta, b: ParsedDelta) -> None:
    a.content += b.content
    a.tool_calls.extend(b.tool_calls)


# ---------------------------------------------------------------- delimited blocks


class _Blocks(ToolCallParser):
    """Calls in blocks between a start and an end marker, text around them."""

    START: str = ""
    END: str = ""
    #: Markers dropped wherever they appear outside blocks (a list's own brackets).
    FRAMING: tuple[str, ...] = ()

    __slots__ = ("_block", "_buf", "_markers")

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self._buf = ""
        #: Inside a block: its text so far (None: outside).
        self._block: str | None = None
        self._markers = (self.START, *self.FRAMING)

    def feed(self, text: str) -> ParsedDelta:
        buf = self._buf + text if self._buf else text
        self._buf = ""
        out = ParsedDelta()
        while buf:
            if self._block is None:
                i, marker = find_first(buf, self._markers)
                if i == -1:
                    cut = hold_partial(buf, self._markers)
                    self._text(out, buf[:cut])
                    self._buf = buf[cut:]
                    return out
                self._text(out, buf[:i])
                buf = buf[i + len(marker) :]
                if marker == self.START:
                    self._block = ""
            else:
                # Search only where the end marker can newly be: a long block is not
                # rescanned on every delta.
                seen = max(len(self._block) - len(self.END) + 1, 0)
                block = self._block + buf
                j = block.find(self.END, seen)
                if j == -1:
                    self._block = block
                    return out
                self._block = None
                buf = block[j + len(self.END) :]
                _merge(out, self._read(block[:j], self.START + block[: j + len(self.END)]))
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._text(out, self._buf)
        self._buf = ""
        if self._block is not None:
            block, self._block = self._block, None
            _merge(out, self._read(block, self.START + block))
        return out

    def _read(self, body: str, raw: str) -> ParsedDelta:
        raise NotImplementedError


class HermesParser(_Blocks):
    START = "<tool_call>"
    END = "</tool_call>"
    needs_special_tokens = True  # some tokenizers make the tags special tokens

    __slots__ = ()

    def _read(self, body: str, raw: str) -> ParsedDelta:
        call = _json_call(body.strip())
        return self._calls([call] if call else None, raw)


class DeepSeekV3Parser(_Blocks):
    START = "<｜tool▁call▁begin｜>"
    END = "<｜tool▁call▁end｜>"
    FRAMING = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    SEP = "<｜tool▁sep｜>"
    needs_special_tokens = True

    __slots__ = ()

    def _read(self, body: str, raw: str) -> ParsedDelta:
        head, sep, rest = body.partition(self.SEP)
        if not sep:
            return ParsedDelta(content=raw)
        if head.strip() == "function":  # V3: "function<sep>NAME\n```json\n{...}\n```"
            name, _, rest = rest.partition("\n")
            rest = rest.strip()
            if rest.startswith("```"):
                rest = rest.removeprefix("```json").removeprefix("```").removesuffix("```")
        else:  # V3.1: "NAME<sep>{...}"
            name = head
        try:
            args = json.loads(rest)
        except ValueError:
            return ParsedDelta(content=raw)
        return self._calls([(name.strip(), args)], raw)


# ---------------------------------------------------------------- calls to the end


class _Trailing(ToolCallParser):
    """Text until a trigger, then calls to the end of the output, read when it ends."""

    TRIGGERS: tuple[str, ...] = ()
    #: The trigger must open the output (after white space): Llama's JSON and list forms.
    AT_START_ONLY = False

    __slots__ = ("_buf", "_seen_text", "_tail")

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self._buf = ""
        self._tail: str | None = None
        self._seen_text = False

    def feed(self, text: str) -> ParsedDelta:
        if self._tail is not None:
            self._tail += text
            return ParsedDelta()
        buf = self._buf + text if self._buf else text
        self._buf = ""
        if self.AT_START_ONLY:
            if self._seen_text:
                return ParsedDelta(content=buf)
            stripped = buf.lstrip()
            if not stripped:
                self._buf = buf
                return ParsedDelta()
            for trigger in self.TRIGGERS:
                if stripped.startswith(trigger):
                    self._tail = buf  # as written: it is the text if it holds no calls
                    return ParsedDelta()
                if trigger.startswith(stripped):
                    self._buf = buf
                    return ParsedDelta()
            self._seen_text = True
            return ParsedDelta(content=buf)
        i, _ = find_first(buf, self.TRIGGERS)
        if i != -1:
            self._tail = buf[i:]
            return ParsedDelta(content=buf[:i])
        cut = hold_partial(buf, self.TRIGGERS)
        self._buf = buf[cut:]
        return ParsedDelta(content=buf[:cut])

    def finish(self) -> ParsedDelta:
        if self._tail is None:
            buf, self._buf = self._buf, ""
            return ParsedDelta(content=buf)
        tail, self._tail = self._tail, None
        return self._calls(self._read(tail), tail)

    def _read(self, tail: str) -> list[tuple[str, Any]] | None:
        raise NotImplementedError


class MistralParser(_Trailing):
    TRIGGERS = ("[TOOL_CALLS]",)
    needs_special_tokens = True

    __slots__ = ()

    def _read(self, tail: str) -> list[tuple[str, Any]] | None:
        calls: list[tuple[str, Any]] = []
        for part in tail.split("[TOOL_CALLS]"):
            part = part.strip()
            if not part:
                continue
            if part[0] in "[{":  # v0.3: a JSON list of {"name", "arguments"}
                items = _json_value(part)
                if items is None:
                    return None
                for item in items if isinstance(items, list) else [items]:
                    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                        return None
                    calls.append((item["name"], item.get("arguments", {})))
                continue
            call = _mistral_v11_call(part)
            if call is None:
                return None
            calls.append(call)
        return calls


def _json_value(text: str) -> Any:
    """The JSON value ``text`` holds (None when it holds none, or more than one)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _mistral_v11_call(part: str) -> tuple[str, Any] | None:
    """``NAME[ARGS]{...}`` (tokenizer v11+) as (name, arguments). The ``[ARGS]`` token may be
    missing from the text (a tokenizer that does not have it as a token writes ``NAME{...}``)
    and a ``[CALL_ID]id`` may sit between name and arguments (v13)."""
    head, sep, args = part.partition("[ARGS]")
    if not sep:
        i = part.find("{")
        if i <= 0:
            return None
        head, args = part[:i], part[i:]
    name = head.partition("[CALL_ID]")[0].strip()
    if not name or any(c.isspace() for c in name):
        return None
    value = _json_value(args)
    return None if value is None else (name, value)


class Llama3JsonParser(_Trailing):
    TRIGGERS = ("<|python_tag|>", "{")
    AT_START_ONLY = True

    __slots__ = ()

    def _read(self, tail: str) -> list[tuple[str, Any]] | None:
        text = tail.strip().removeprefix("<|python_tag|>").strip()
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(text):
            try:
                obj, end = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            call = _json_call(json.dumps(obj), ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            pos = end
            while pos < len(text) and text[pos] in " \t\n;":
                pos += 1
        return calls


class PythonicParser(_Trailing):
    TRIGGERS = ("<|python_start|>", "[")
    AT_START_ONLY = True

    __slots__ = ()

    def _read(self, tail: str) -> list[tuple[str, Any]] | None:
        text = tail.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError:
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                return None
            if node.args:  # positional arguments have no names to give
                return None
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
            calls.append((node.func.id, args))
        return calls


TOOL_CALL_PARSER_CLASSES: dict[str, type[ToolCallParser]] = {
    "deepseek_v3": DeepSeekV3Parser,
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}
