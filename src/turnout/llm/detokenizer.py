"""Incremental detokenization: token ids in, text out, never half a character.

Byte-level BPE splits a multi-byte character (an emoji is 4 UTF-8 bytes) across tokens, and
SentencePiece byte-fallback does the same with ``<0xF0>``-style tokens. Decoding each token on
its own would emit U+FFFD replacement characters. The standard remedy (vLLM's detokenizer,
``tokenizers``' ``DecodeStream``) decodes a small window of recent tokens and emits only the
part of the text that is new and does not end in U+FFFD; a window that ends mid-character is
held until the character completes.

We use ``tokenizers.decoders.DecodeStream`` (Rust; ~2 µs a token) and remember the ids fed
since it last produced text, so :meth:`Detokenizer.flush` can release what is still held when
the stream ends mid-character (the result then contains U+FFFD, exactly as ``decode(all)``
would).

Invariant: the concatenation of everything ``step``/``flush`` returned equals
``tokenizer.decode(all ids fed)`` for byte-level tokenizers.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from .tokenizer import Tokenizer

#: Prompt tokens given to the stream as context, so the first output token decodes with
#: the right leading space under SentencePiece-style decoders.
CONTEXT_TOKENS = 4


class Detokenizer:
    """One stream's incremental decoder. Not thread-safe; one per request."""

    __slots__ = ("_inner", "_pending", "_skip_special", "_stream")

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] | None = None,
    ) -> None:
        self._inner = tokenizer.inner
        self._skip_special = skip_special_tokens
        ctx = list(context_ids[-CONTEXT_TOKENS:]) if context_ids else None
        self._stream = DecodeStream(ids=ctx, skip_special_tokens=skip_special_tokens)
        #: Ids fed since the stream last produced text (what ``flush`` must release).
        self._pending: list[int] = []

    def step(self, token_id: int) -> str:
        """Feed one token id; the new text it completes ("" while a character is split)."""
        text = self._stream.step(self._inner, token_id)
        if text is None:
            self._pending.append(token_id)
            return ""
        if self._pending:
            self._pending.clear()
        return text

    def step_many(self, token_ids: Sequence[int]) -> str:
        """Feed several ids at once (one call into Rust)."""
        if not token_ids:
            return ""
        text = self._stream.step(self._inner, list(token_ids))
        if text is None:
            self._pending.extend(token_ids)
            return ""
        if self._pending:
            self._pending.clear()
        return text

    def flush(self) -> str:
        """At the end of the stream: the text of ids still held (an incomplete character
        decodes to U+FFFD). Further steps after a flush start from a clean state."""
        if not self._pending:
            return ""
        text = self._inner.decode(self._pending, skip_special_tokens=self._skip_special)
        self._pending.clear()
        self._stream = DecodeStream(skip_special_tokens=self._skip_special)
        return text


__all__ = ["Detokenizer"]
