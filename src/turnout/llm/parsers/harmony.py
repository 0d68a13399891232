"""gpt-oss's harmony format: reasoning, answer and tool calls as channels of messages.

The prompt ends with ``<|start|>assistant``; the output is a sequence of messages, each a
header (channel, maybe a recipient and a content type) and a body::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city":"Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

(the second message on one line in the text).

``analysis`` is reasoning, ``final`` the answer, ``commentary`` addressed ``to=functions.NAME``
a tool call (its body the JSON arguments); ``commentary`` without a recipient is a preamble
shown as answer text. ``<|call|>`` and ``<|return|>`` are stop tokens (the text seldom has
them); ``<|end|>`` and the next ``<|start|>`` end a message too.

This reads the decoded text (special tokens kept), not token ids: ``openai-harmony``'s token
parser needs its o200k vocabulary, which it downloads on first use, and nothing here may
download at run time (offline, ``load_harmony_encoding(HARMONY_GPT_OSS)`` of openai-harmony
0.0.8 fails at once with ``HarmonyError: error downloading or loading vocab file``; a local
copy would have to be put in place and named by ``TIKTOKEN_ENCODINGS_BASE``). Text that
never reaches a message body (output without harmony markup) is answer text, released at
the end.
"""

from __future__ import annotations

import json
import re

from . import OutputParser, ParsedDelta, ToolCallDelta
from .text import find_first, hold_partial, new_call_id

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", START)
#: Longest header kept while looking for ``<|message|>`` (a model that writes no markup).
MAX_HEADER_CHARS = 512
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


class HarmonyParser(OutputParser):
    """One gpt-oss output; ``names``: the offered functions (empty: no tool calls)."""

    needs_special_tokens = True

    __slots__ = ("_body", "_buf", "_calls", "_channel", "_header", "_names", "_recipient")

    def __init__(self, names: frozenset[str]) -> None:
        self._names = names
        self._buf = ""
        #: In a header: its text so far (None: in a body).
        self._header: str | None = ""
        self._channel = ""
        self._recipient: str | None = None
        #: A tool call's arguments so far.
        self._body: list[str] = []
        self._calls = 0

    @property
    def called_tools(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> ParsedDelta:
        buf = self._buf + text if self._buf else text
        self._buf = ""
        out = ParsedDelta()
        while buf:
            if self._header is not None:
                header = self._header + buf
                i = header.find(MESSAGE)
                if i == -1:
                    if len(header) > MAX_HEADER_CHARS:  # not harmony: plain text
                        self._header = ""
                        out.content += header
                    else:
                        self._header = header
                    return out
                self._open(header[:i])
                buf = header[i + len(MESSAGE) :]
                continue
            i, marker = find_first(buf, ENDS)
            if i == -1:
                cut = hold_partial(buf, ENDS)
                self._body_text(buf[:cut], out)
                self._buf = buf[cut:]
                return out
            self._body_text(buf[:i], out)
            self._close(out)
            buf = buf[i + len(marker) :]
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._header is not None:
            out.content += self._header + self._buf
            self._header = ""
        else:
            self._body_text(self._buf, out)
            self._close(out)
        self._buf = ""
        return out

    def _open(self, header: str) -> None:
        match = _CHANNEL.search(header)
        self._channel = match.group(1) if match else ""
        recipient = _RECIPIENT.search(header)
        self._recipient = recipient.group(1) if recipient else None
        self._header = None
        self._body = []

    def _is_call(self) -> bool:
        return self._recipient is not None and self._recipient.startswith("functions.")

    def _body_text(self, text: str, out: ParsedDelta) -> None:
        if not text:
            return
        if self._is_call():
            self._body.append(text)
        elif self._channel == "analysis":
            out.reasoning += text
        else:
            out.content += text

    def _close(self, out: ParsedDelta) -> None:
        """The message ends: a tool call's arguments are read."""
        if self._header is None and self._is_call():
            assert self._recipient is not None
            name = self._recipient.removeprefix("functions.")
            raw = "".join(self._body)
            try:
                args = json.loads(raw)
            except ValueError:
                args = None
            if name in self._names and isinstance(args, dict):
                out.tool_calls.append(
                    ToolCallDelta(
                        self._calls,
                        id=new_call_id(),
                        name=name,
                        arguments=json.dumps(args, ensure_ascii=False),
                    )
                )
                self._calls += 1
            else:
                out.content += raw
        self._header = ""
        self._recipient = None
        self._channel = ""
        self._body = []
