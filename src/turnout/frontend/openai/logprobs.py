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
    """Collects one choice's token log probabilities, delta by delta (all of them with
    ``keep``, for ``whole``; else only each delta's own)."""

    __slots__ = (
        "_is_chat", "_keep", "_offset", "_tokenizer", "offsets", "tokens", "tops", "values",
    )  # fmt: skip

    def __init__(
        self, tokenizer: Tokenizer, *, is_chat: bool, text_offset: int = 0, keep: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._keep = keep
        self._is_chat = is_chat
        #: Characters of response text before the next token (completions' ``text_offset``).
        self._offset = text_offset
        self.tokens: list[str] = []
        self.values: list[float] = []
        self.offsets: list[int] = []
        #: Per token: its alternatives as (text, log prob), most likely first.
        self.tops: list[list[tuple[str, float]]] = []

    def add(self, delta: DecodedDelta) -> dict[str, Any] | None:
        """Take a delta's tokens; their log probs in the response's shape (None: none)."""
        ids = delta.token_ids
        lps = delta.log_probs
        if not ids or lps is None:
            self._offset += len(delta.text)
            return None
        if not self._keep:
            self.tokens.clear()
            self.values.clear()
            self.offsets.clear()
            self.tops.clear()
        start = len(self.tokens)
        tops = delta.top_logprobs or ()
        for i, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
            text = self._text(tid)
            self.tokens.append(text)
            self.values.append(_finite(lp))
            self.offsets.append(self._offset)
            self._offset += len(text)
            alts = tops[i] if i < len(tops) else ()
            self.tops.append([(self._text(a), _finite(v)) for a, v in alts])
        return self._shape(start)

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def whole(self) -> dict[str, Any]:
        """Every token so far, in the response's shape."""
        return self._shape(0)

    def _shape(self, start: int) -> dict[str, Any]:
        tokens = self.tokens[start:]
        values = self.values[start:]
        tops = self.tops[start:]
        if self._is_chat:
            return {
                "content": [
                    {
                        "token": t,
                        "logprob": v,
                        "bytes": list(t.encode()),
                        "top_logprobs": [
                            {"token": a, "logprob": av, "bytes": list(a.encode())} for a, av in alts
                        ],
                    }
                    for t, v, alts in zip(tokens, values, tops, strict=True)
                ]
            }
        return {
            "tokens": tokens,
            "token_logprobs": values,
            # Completions' alternatives are a {text: log prob} map per token (texts that
            # decode alike merge, as OpenAI's do).
            "top_logprobs": [dict(alts) for alts in tops] if any(tops) else None,
            "text_offset": self.offsets[start:],
        }


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR
