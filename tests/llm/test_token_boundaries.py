"""Boundary tokens: which added tokens make clean cuts, and which tokenizers have none."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from tests.llm.tokenizer_zoo import ZOO
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from turnout.llm.token_boundaries import TokenBoundaries, find_boundaries
from turnout.llm.tokenizer import Tokenizer


def boundaries(tok: Tokenizer) -> TokenBoundaries:
    found = tok.boundaries
    assert isinstance(found, TokenBoundaries), found
    return found


def test_smollm2_cuts_after_its_special_tokens(smol_tokenizer: Tokenizer) -> None:
    found = boundaries(smol_tokenizer)
    assert found.ids["<|im_start|>"] == 1 and found.ids["<|im_end|>"] == 2
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert found.cuts(text) == [12, 29, 42]


def test_hostile_tokens_are_left_out() -> None:
    """Of ``HOSTILE_TOKENS``, those that another token contains or overlaps from the left,
    that strip the whitespace after them, end in whitespace, are matched after
    normalization, or end in a word character while a single-word token exists."""
    found = boundaries(ZOO["hostile"]())
    hostile = {c for c in found.ids if c not in ("<s>", "</s>", "<stop>", "<|im_start|>")}
    assert hostile == {"<|a|>", "<|c|>", "<|e|>", "<|i|>", "<|im_end|>", "x<|d|>"}


def test_llama3_tokens() -> None:
    found = boundaries(ZOO["llama3"]())
    assert {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"} <= set(found.ids)


def _bpe(configure: Callable[[HFTokenizer], None]) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.add_special_tokens(["<|im_end|>"])
    configure(tok)
    return tok


@pytest.mark.parametrize(
    ("configure", "reason"),
    [
        (lambda t: setattr(t, "encode_special_tokens", True), "encode_special_tokens"),
        (lambda t: t.enable_truncation(16), "truncates or pads"),
        (lambda t: t.enable_padding(length=16), "truncates or pads"),
        (lambda t: setattr(t, "model", models.BPE(dropout=0.1)), "dropout"),
        (
            lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace(prepend_scheme="first")),
            "first piece",
        ),
        (
            lambda t: setattr(
                t,
                "pre_tokenizer",
                pre_tokenizers.Sequence(
                    [pre_tokenizers.Digits(), pre_tokenizers.Metaspace(prepend_scheme="first")]
                ),
            ),
            "first piece",
        ),
    ],
)
def test_refused(configure: Callable[[HFTokenizer], None], reason: str) -> None:
    found = find_boundaries(_bpe(configure))
    assert isinstance(found, str) and reason in found


def test_no_added_token_no_cut() -> None:
    found = find_boundaries(HFTokenizer(models.BPE()))
    assert isinstance(found, str) and "no added token" in found


def test_metaspace_always_is_piecewise() -> None:
    tok = _bpe(lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace()))
    assert isinstance(find_boundaries(tok), TokenBoundaries)


def test_computed_once(smol_tokenizer: Tokenizer) -> None:
    assert smol_tokenizer.boundaries is smol_tokenizer.boundaries
