"""Token bytes from a ``tokenizer.json``, for the ids a llama.cpp server holds back.

llama.cpp's ``/completion`` stream sends one token id per event, and sends no event for a
token whose bytes end inside a UTF-8 character: its bytes lead the text of the event that
completes the character, whose ``tokens`` name only the completing token. The attach engine
rebuilds the missing ids from the text with ``VocabBytes.fill`` (greedy longest match), as the
in-process llama.cpp engine does from the GGUF file. Here the table comes from the
``tokenizer.json`` the frontend uses (whatever ``--tokenizer`` was: a GGUF or an HF folder),
for the two families llama.cpp serves: byte-level BPE and SentencePiece with byte fallback.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from turnout.engines.llamacpp.vocab import VocabBytes, gpt2_byte_decoder

log = logging.getLogger(__name__)

__all__ = ["VocabBytes", "vocab_bytes"]


def _kinds(node: Any) -> set[str]:
    """Every ``type`` named in a (possibly ``Sequence``) pre-tokenizer or decoder node."""
    if not isinstance(node, dict):
        return set()
    found = {str(node.get("type"))}
    for child in node.get("pretokenizers") or node.get("decoders") or []:
        found |= _kinds(child)
    return found


def vocab_bytes(tokenizer_json: bytes) -> VocabBytes:
    """The byte table of a ``tokenizer.json`` (empty for families it does not know)."""
    try:
        spec = json.loads(tokenizer_json)
    except ValueError:
        return VocabBytes(())
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    special = {
        int(t["id"])
        for t in spec.get("added_tokens") or []
        if isinstance(t, dict) and t.get("special") and isinstance(t.get("id"), int)
    }
    entries: list[tuple[str, int]] = []
    if isinstance(vocab, dict):
        entries = [(tok, i) for tok, i in vocab.items() if isinstance(i, int)]
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        entries = [(e[0], i) for i, e in enumerate(vocab) if isinstance(e, list) and e]
    kinds = _kinds(spec.get("decoder")) | _kinds(spec.get("pre_tokenizer"))
    pieces: list[tuple[bytes, int]] = []
    if "ByteLevel" in kinds:
        table = gpt2_byte_decoder()
        for tok, i in entries:
            if i not in special and all(c in table for c in tok):
                pieces.append((bytes(table[c] for c in tok), i))
    elif "ByteFallback" in kinds or "Metaspace" in kinds or model.get("byte_fallback"):
        for tok, i in entries:
            if i in special:
                continue
            if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                try:
                    pieces.append((bytes([int(tok[3:5], 16)]), i))
                except ValueError:
                    continue
            else:
                pieces.append((tok.replace("\u2581", " ").encode(), i))
    else:
        log.info("attach: no byte table for this tokenizer (%s)", ", ".join(sorted(kinds)))
    return VocabBytes(pieces)
