"""The Tokenizer wrapper and the process-wide cache."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from turnout.errors import ConfigError
from turnout.llm.tokenizer import (
    Tokenizer,
    clear_tokenizer_cache,
    file_sha256,
    load_tokenizer,
)
from turnout.protocols.model import TokenizerSource


def test_from_file(small_tokenizer: Tokenizer, small_tokenizer_path: Path) -> None:
    assert small_tokenizer.kind == "hf_tokenizer_json"
    assert small_tokenizer.sha256 == file_sha256(small_tokenizer_path)
    ids = small_tokenizer.encode("hello world")
    assert small_tokenizer.decode(ids) == "hello world"
    assert small_tokenizer.token_to_id("<s>") in small_tokenizer.special_token_ids
    assert small_tokenizer.bos_token_id is None  # no tokenizer_config.json beside it


def test_from_file_reads_bos_eos_beside_it(tmp_path: Path, small_tokenizer_path: Path) -> None:
    shutil.copy(small_tokenizer_path, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}})
    )
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert tok.bos_token_id == tok.token_to_id("<s>") is not None
    assert tok.eos_token_id == tok.token_to_id("</s>") is not None


def test_invalid_tokenizer_file(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=re.escape(str(bad))):
        Tokenizer.from_file(bad)
    with pytest.raises(ConfigError, match=r"nope\.json"):
        Tokenizer.from_file(tmp_path / "nope.json")


def test_load_tokenizer_caches_by_sha(tmp_path: Path, small_tokenizer_path: Path) -> None:
    clear_tokenizer_cache()
    copy = tmp_path / "tokenizer.json"
    shutil.copy(small_tokenizer_path, copy)
    sha = file_sha256(small_tokenizer_path)
    a = load_tokenizer(TokenizerSource(kind="hf_tokenizer_json", path=str(copy), sha256=sha))
    b = load_tokenizer(
        TokenizerSource(kind="hf_tokenizer_json", path=str(small_tokenizer_path), sha256=sha)
    )
    assert a is b  # same content, one tokenizer


def test_load_tokenizer_rejects_changed_file(small_tokenizer_path: Path) -> None:
    clear_tokenizer_cache()
    src = TokenizerSource(kind="hf_tokenizer_json", path=str(small_tokenizer_path), sha256="0" * 64)
    with pytest.raises(ConfigError, match="expects 000000000000"):
        load_tokenizer(src)


def test_load_tokenizer_unknown_kind(small_tokenizer_path: Path) -> None:
    src = TokenizerSource(kind="sentencepiece", path=str(small_tokenizer_path), sha256="x")
    with pytest.raises(ConfigError, match="unknown tokenizer kind 'sentencepiece'"):
        load_tokenizer(src)


def test_load_tokenizer_gguf(gguf_path: Path, smol_tokenizer: Tokenizer) -> None:
    tok = load_tokenizer(smol_tokenizer.source())
    assert tok.sha256 == smol_tokenizer.sha256
    assert tok.kind == "gguf"
    assert load_tokenizer(smol_tokenizer.source()) is tok
