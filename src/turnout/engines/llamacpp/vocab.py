"""Token bytes from a GGUF vocabulary, to recover the token ids llama.cpp holds back.

llama.cpp never streams the ``logprobs`` entry of a token whose bytes end inside a UTF-8
character; those bytes lead the text of the chunk that completes the character. ``VocabBytes``
maps each token id to its bytes and back, so the engine (``stream``) can rebuild the missing
ids by greedy longest match. Kept apart from the engine: it is pure GGUF-metadata code, with
no llama.cpp or event-loop state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import gguf

from turnout.llm.gguf_tokenizer import read_gguf_metadata

log = logging.getLogger(__name__)


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


class VocabBytes:
    """The bytes of each token and the id of each byte string, to recover held-back tokens.

    Only normal and byte tokens take part (control tokens render as nothing). Supports the
    byte-level BPE (``gpt2``) and SentencePiece (``llama``) vocabularies; for others it is
    empty and recovery is skipped.
    """

    __slots__ = ("_ids", "_max_len", "_pieces")

    def __init__(self, pieces: Iterable[tuple[bytes, int]]) -> None:
        self._pieces: dict[int, bytes] = {}
        self._ids: dict[bytes, int] = {}
        for piece, token_id in pieces:
            self._pieces[token_id] = piece
            if piece and piece not in self._ids:
                self._ids[piece] = token_id
        self._max_len = max(map(len, self._ids), default=0)

    @classmethod
    def from_gguf(cls, path: str | Path) -> VocabBytes:
        meta = read_gguf_metadata(path)
        model = meta.get(gguf.Keys.Tokenizer.MODEL)
        tokens: list[str] = meta.get(gguf.Keys.Tokenizer.LIST) or []
        types: list[int] = meta.get(gguf.Keys.Tokenizer.TOKEN_TYPE) or [1] * len(tokens)
        wanted = (gguf.TokenType.NORMAL, gguf.TokenType.BYTE)
        pieces: list[tuple[bytes, int]] = []
        if model == "gpt2":
            dec = gpt2_byte_decoder()
            for i, (tok, typ) in enumerate(zip(tokens, types, strict=False)):
                if typ in wanted and all(c in dec for c in tok):
                    pieces.append((bytes(dec[c] for c in tok), i))
        elif model == "llama":
            for i, (tok, typ) in enumerate(zip(tokens, types, strict=False)):
                if typ == gguf.TokenType.BYTE and len(tok) == 6 and tok.startswith("<0x"):
                    pieces.append((bytes([int(tok[3:5], 16)]), i))
                elif typ == gguf.TokenType.NORMAL:
                    pieces.append((tok.replace("\u2581", " ").encode(), i))
        else:
            log.info("llamacpp: no byte table for tokenizer model %r", model)
        return cls(pieces)

    def piece(self, token_id: int) -> bytes | None:
        """The bytes ``token_id`` renders as; None for control tokens and unknown models."""
        return self._pieces.get(token_id)

    def fill(self, data: bytes) -> list[int]:
        """Ids whose byte strings concatenate to ``data`` (greedy longest match); ``[]`` when
        some byte has no token."""
        ids: list[int] = []
        pos, end = 0, len(data)
        while pos < end:
            for n in range(min(self._max_len, end - pos), 0, -1):
                token_id = self._ids.get(data[pos : pos + n])
                if token_id is not None:
                    ids.append(token_id)
                    pos += n
                    break
            else:
                return []
        return ids
