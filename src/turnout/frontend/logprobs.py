"""Per-token log probabilities in OpenAI's two shapes, built from decoded deltas.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``. Completions (legacy):
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``. Each token's text is its own
decoding (a token that ends inside a UTF-8 character shows the replacement character; its
``bytes`` are those of that text). A log probability an engine could not give (not finite) is
reported as -9999.0, as vLLM does, so the body stays valid JSON for strict clients.
"""

from __future__ import annotations

import math
from typing import Any

from turnout.llm.backend import DecodedDelta
from turnout.llm.tokenizer import Tokenizer

#: What a non-finite log probability (-inf, or none given) is reported as.
FLOOR = -9999.0


class LogprobsBuilder:
    """Collects one choice's token log probabilities, delta by delta."""

    __slots__ = ("_is_chat", "_offset", "_tokenizer", "offsets", "tokens", "values")

    def __init__(self, tokenizer: Tokenizer, *, is_chat: bool, text_offset: int = 0) -> None:
        self._tokenizer = tokenizer
        self._is_chat = is_chat
        #: Characters of response text before the next token (completions' ``text_offset``).
        self._offset = text_offset
        self.tokens: list[str] = []
        self.values: list[float] = []
        self.offsets: list[int] = []

    def add(self, delta: DecodedDelta) -> dict[str, Any] | None:
        """Take a delta's tokens; their log probs in the response's shape (None: none)."""
        ids = delta.token_ids
        lps = delta.log_probs
        if not ids or lps is None:
            self._offset += len(delta.text)
            return None
        start = len(self.tokens)
        for tid, lp in zip(ids, lps, strict=False):
            text = self._tokenizer.decode([tid], skip_special_tokens=False)
            self.tokens.append(text)
            self.values.append(lp if math.isfinite(lp) else FLOOR)
            self.offsets.append(self._offset)
            self._offset += len(text)
        return self._shape(start)

    def whole(self) -> dict[str, Any]:
        """Every token so far, in the response's shape."""
        return self._shape(0)

    def _shape(self, start: int) -> dict[str, Any]:
        tokens = self.tokens[start:]
        values = self.values[start:]
        if self._is_chat:
            return {
                "content": [
                    {"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, v in zip(tokens, values, strict=True)
                ]
            }
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": None,
            "text_offset": self.offsets[start:],
        }
