"""Incremental detokenization never emits half a character."""

from __future__ import annotations

import pytest

from turnout.llm.detokenizer import Detokenizer
from turnout.llm.tokenizer import Tokenizer

TEXTS = [
    "hello 😀 world",
    "你好，世界",  # noqa: RUF001
    "👨‍👩‍👧 family and 🏳️‍🌈 flag",
    "mixed: abc 日本語 😀😀 def",
    "plain ascii only",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("which", ["small", "smol"])
def test_stream_equals_decode_all(
    text: str, which: str, small_tokenizer: Tokenizer, smol_tokenizer: Tokenizer
) -> None:
    tok = small_tokenizer if which == "small" else smol_tokenizer
    ids = tok.encode(text)
    det = Detokenizer(tok)
    pieces = [det.step(i) for i in ids]
    pieces.append(det.flush())
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == tok.decode(ids) == text


def test_multibyte_really_is_split(small_tokenizer: Tokenizer) -> None:
    """The small tokenizer has no merges for emoji: each byte is its own token, so the
    stream must hold three of the four tokens back."""
    ids = small_tokenizer.encode("😀")
    assert len(ids) == 4
    det = Detokenizer(small_tokenizer)
    assert [det.step(i) for i in ids] == ["", "", "", "😀"]


def test_step_many(smol_tokenizer: Tokenizer) -> None:
    text = "chunks of 😀 emoji 你好"
    ids = smol_tokenizer.encode(text)
    det = Detokenizer(smol_tokenizer)
    out = [det.step_many(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(out) + det.flush() == text
    assert det.step_many([]) == ""


def test_skip_special_tokens(smol_tokenizer: Tokenizer) -> None:
    ids = smol_tokenizer.encode("<|im_start|>Hi<|im_end|> there")
    skipping = Detokenizer(smol_tokenizer, skip_special_tokens=True)
    keeping = Detokenizer(smol_tokenizer, skip_special_tokens=False)
    assert "".join(skipping.step(i) for i in ids) == "Hi there"
    assert "".join(keeping.step(i) for i in ids) == "<|im_start|>Hi<|im_end|> there"


def test_flush_releases_an_incomplete_character(small_tokenizer: Tokenizer) -> None:
    ids = small_tokenizer.encode("a😀")
    det = Detokenizer(small_tokenizer)
    assert "".join(det.step(i) for i in ids[:-1]) == "a"  # the emoji lacks its last byte
    tail = det.flush()
    assert tail and set(tail) == {"\ufffd"}
    assert "a" + tail == small_tokenizer.decode(ids[:-1])
    assert det.flush() == ""


@pytest.mark.parametrize("prompt", ["The answer is", "<|im_start|>user\nQ?<|im_end|>\n"])
def test_context_ids_do_not_leak_into_output(smol_tokenizer: Tokenizer, prompt: str) -> None:
    det = Detokenizer(smol_tokenizer, context_ids=smol_tokenizer.encode(prompt))
    out = smol_tokenizer.encode(" 42 😀")
    assert "".join(det.step(i) for i in out) == " 42 😀"
