"""The Tokenizer wrapper, and loading a tokenizer from bytes that must match their reference."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from turnout.errors import ConfigError
from turnout.llm.artifacts import make_ref
from turnout.llm.tokenizer import KIND_HF, Tokenizer, load_tokenizer


def test_from_file(small_tokenizer: Tokenizer, small_tokenizer_path: Path) -> None:
    assert small_tokenizer.kind == "hf_tokenizer_json"
    assert small_tokenizer.sha256 == hashlib.sha256(small_tokenizer_path.read_bytes()).hexdigest()
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


def test_load_tokenizer_from_bytes_matching_ref(small_tokenizer_path: Path) -> None:
    data = small_tokenizer_path.read_bytes()
    ref = make_ref("tokenizer.json", KIND_HF, data)
    tok = load_tokenizer(ref, data, bos_token="<s>", eos_token="</s>")
    assert (tok.sha256, tok.size) == (ref.sha256, ref.size)
    assert tok.ref() == ref
    assert tok.bos_token_id == tok.token_to_id("<s>") is not None
    assert tok.eos_token_id == tok.token_to_id("</s>") is not None
    assert tok.encode("hello world") == Tokenizer.from_file(small_tokenizer_path).encode(
        "hello world"
    )


def test_load_tokenizer_rejects_other_bytes(small_tokenizer_path: Path) -> None:
    data = small_tokenizer_path.read_bytes()
    ref = make_ref("tokenizer.json", KIND_HF, data)
    tampered = data.replace(b"hello", b"jello")
    with pytest.raises(ConfigError, match=f"card names {ref.size} bytes with sha256"):
        load_tokenizer(ref, tampered)
    with pytest.raises(ConfigError, match="card names"):
        load_tokenizer(ref, data + b" ")  # same prefix, other size


def test_load_tokenizer_unknown_kind(small_tokenizer_path: Path) -> None:
    data = small_tokenizer_path.read_bytes()
    ref = make_ref("tokenizer.model", "sentencepiece", data)
    with pytest.raises(ConfigError, match="unknown tokenizer kind 'sentencepiece'"):
        load_tokenizer(ref, data)


def test_gguf_tokenizer_is_its_json(smol_tokenizer: Tokenizer) -> None:
    """A GGUF's tokenizer is named by the sha of the tokenizer.json built from it, and those
    bytes rebuild the same tokenizer (what a frontend gets from a worker)."""
    data = smol_tokenizer.inner.to_str().encode()
    assert smol_tokenizer.sha256 == hashlib.sha256(data).hexdigest()
    assert smol_tokenizer.kind == "hf_tokenizer_json"
    tok = load_tokenizer(smol_tokenizer.ref(), data)
    text = "Hello, world! 12345 <|im_start|>user\nçava? 🙂"
    assert tok.encode(text) == smol_tokenizer.encode(text)
