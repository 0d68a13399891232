"""Reasoning in think tags: ``<think>...</think>`` before the answer.

* ``deepseek_r1``: DeepSeek-R1's chat template opens ``<think>`` in the prompt, so its output
  starts inside the reasoning and only ``</think>`` appears (a ``<think>`` it writes anyway
  is dropped). Output that never closes the tag is all reasoning (as vLLM reads it: the
  model was cut off while thinking).
* ``qwen3``: Qwen3 writes ``<think>`` itself when it thinks (with thinking disabled, its
  template puts an empty ``<think></think>`` in the prompt); output that does not start with
  the tag (after white space) is all answer, streamed as it comes.

  vLLM's newer ``qwen3`` parser also reads text before a ``</think>`` that was never opened as
  reasoning, for the Thinking-2507 models whose template opens the tag in the prompt. It can
  only do so whole: streamed, text before the ``</think>`` has gone out already, and vLLM's
  stream and whole answer then disagree (its stream calls it reasoning, its whole answer
  content when no ``</think>`` follows). Here a stream and a whole answer always agree, and a
  plain answer must not wait for the end to know it has no ``</think>``; so ``qwen3`` keeps
  to the opening tag, and models whose template opens it (Qwen3-*-Thinking-2507, QwQ) take
  ``deepseek_r1``, which starts inside the reasoning.

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
