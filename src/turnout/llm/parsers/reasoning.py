"""Reasoning in think tags: ``<think>...</think>`` before the answer.

* ``deepseek_r1``: DeepSeek-R1's chat template opens ``<think>`` in the prompt, so its output
  starts inside the reasoning and only ``</think>`` appears (a ``<think>`` it writes anyway
  is dropped). Output that never closes the tag is all reasoning (as vLLM reads it: the
  model was cut off while thinking).
* ``qwen3``: Qwen3 writes ``<think>`` itself when it thinks (with thinking disabled, its
  template puts an empty ``<think></think>`` in the prompt); output that does not start with
  the tag (after white space) is all answer.

Streamed, a tag split across deltas is held back until it is known to be one.
"""

from __future__ import annotations

from .text import hold_partial

OPEN = "<think>"
CLOSE = "</think>"

_DECIDING, _THINKING, _ANSWER = 0, 1, 2


class ThinkTags:
    """Splits one output into reasoning and answer; ``feed``/``finish`` return
    ``(reasoning, answer)``."""

    __slots__ = ("_buf", "_opens_in_prompt", "_state")

    def __init__(self, *, opens_in_prompt: bool) -> None:
        #: The template opened the tag: output without one starts in reasoning.
        self._opens_in_prompt = opens_in_prompt
        self._state = _DECIDING
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        if self._state == _ANSWER:
            return "", text
        buf = self._buf + text if self._buf else text
        self._buf = ""
        if self._state == _DECIDING:
            stripped = buf.lstrip()
            if len(stripped) < len(OPEN) and OPEN.startswith(stripped):
                self._buf = buf  # may still become the opening tag
                return "", ""
            if stripped.startswith(OPEN):
                buf = stripped[len(OPEN) :]
            elif not self._opens_in_prompt:
                self._state = _ANSWER
                return "", buf
            self._state = _THINKING
        i = buf.find(CLOSE)
        if i != -1:
            self._state = _ANSWER
            return buf[:i], buf[i + len(CLOSE) :]
        cut = hold_partial(buf, (CLOSE,))
        self._buf = buf[cut:]
        return buf[:cut], ""

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        thinking = self._state == _THINKING or (self._state == _DECIDING and self._opens_in_prompt)
        return (buf, "") if thinking else ("", buf)
