"""Fixtures for the llm tests: a small byte-level BPE tokenizer trained here, and the real
SmolLM2 GGUF tokenizer (loaded once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from turnout.llm.model_card import default_gguf_path
from turnout.llm.tokenizer import Tokenizer

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<stop>"]
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "abc abd abcd stop here STOP now",
    "numbers 123 456 and words words words",
] * 20


def make_small_hf_tokenizer() -> HFTokenizer:
    """Byte-level BPE with a tiny vocabulary: emoji and CJK stay split into byte tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def small_tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("small_tok") / "tokenizer.json"
    make_small_hf_tokenizer().save(str(path))
    return path


@pytest.fixture(scope="session")
def small_tokenizer(small_tokenizer_path: Path) -> Tokenizer:
    return Tokenizer.from_file(small_tokenizer_path)


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="session")
def smol_tokenizer(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)
