"""The GGUF tokenizer: metadata reading, agreement with llama.cpp, errors."""

from __future__ import annotations

import importlib.util
import json
import time
import urllib.request
from pathlib import Path

import gguf
import numpy as np
import pytest

from turnout.errors import ConfigError
from turnout.llm.gguf_tokenizer import build_gguf_tokenizer, read_gguf_metadata
from turnout.llm.tokenizer import Tokenizer

# Ids from llama.cpp's own /tokenize (add_special=false, parse_special=true) on the SmolLM2
# GGUF, recorded with xllamacpp; test_agrees_with_llamacpp_live re-checks them when it can.
_FULLWIDTH_COMMA = "\uff0c"
LLAMACPP_IDS: dict[str, list[int]] = {
    "Hello world": [19556, 905],
    " leading space": [2899, 1898],
    "trailing space ": [4861, 4966, 1898, 216],
    "numbers 1234567890 and 3.14159": [
        *[28707, 216, 33, 34, 35, 36, 37, 38, 39, 40, 41, 32, 284],
        *[216, 35, 30, 33, 36, 33, 37, 41],
    ],
    "emoji 😀👍🏽 family 👨‍👩‍👧": [
        *[391, 33777, 40303, 218, 10813, 235, 231, 10813, 233, 138],
        *[1564, 15107, 235, 118, 321, 231, 10813, 235, 119, 321, 231, 10813, 235, 117],
    ],
    f"CJK 你好{_FULLWIDTH_COMMA}世界 日本語のテキスト": [
        *[51, 58, 59, 216, 18645, 250, 48392, 138, 12831, 7906],
        *[240, 178, 239, 230, 17097, 241, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391],
        *[251, 10391, 134, 11100, 226],
    ],
    "<|im_start|>user\nHi<|im_end|>\n": [1, 4093, 198, 26843, 2, 198],
}

MORE_TEXTS = [
    "Ünïcödé façade naïve",
    "tabs\tand\nnewlines\n\n  indented",
    "code: def f(x):\n    return x**2  # comment",
    "I'm can't we've they'll she'd",
    "   ",
    "a" * 50,
    "mixed123abc!!!???",
]


def test_loads_fast(gguf_path: Path) -> None:
    start = time.perf_counter()
    tok = Tokenizer.from_gguf(gguf_path)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"loading the GGUF tokenizer took {elapsed:.2f}s"
    assert tok.vocab_size == 49152
    assert len(tok.sha256) == 64


def test_ids_and_special_tokens(smol_tokenizer: Tokenizer) -> None:
    assert smol_tokenizer.bos_token_id == 1
    assert smol_tokenizer.eos_token_id == 2
    assert smol_tokenizer.token_to_id("<|im_end|>") == 2
    assert smol_tokenizer.id_to_token(1) == "<|im_start|>"
    # The 17 control tokens of the file (ids 0..16) are the special ones.
    assert smol_tokenizer.special_token_ids == frozenset(range(17))


@pytest.mark.parametrize("text", list(LLAMACPP_IDS))
def test_matches_recorded_llamacpp_ids(smol_tokenizer: Tokenizer, text: str) -> None:
    assert smol_tokenizer.encode(text) == LLAMACPP_IDS[text]


@pytest.mark.parametrize("text", list(LLAMACPP_IDS) + MORE_TEXTS)
def test_round_trip(smol_tokenizer: Tokenizer, text: str) -> None:
    ids = smol_tokenizer.encode(text)
    assert smol_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_skip_special_tokens_in_decode(smol_tokenizer: Tokenizer) -> None:
    ids = smol_tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert smol_tokenizer.decode(ids) == "user\nHi"
    assert smol_tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("xllamacpp") is None, reason="needs xllamacpp")
def test_agrees_with_llamacpp_live(gguf_path: Path, smol_tokenizer: Tokenizer) -> None:
    """Ask llama.cpp itself (its server's /tokenize, on 127.0.0.1) to tokenize the texts."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(gguf_path)
    params.n_ctx = 256
    params.n_parallel = 1
    params.cpuparams.n_threads = 1
    params.warmup = False
    server = xllamacpp.Server(params)
    try:
        for text in [*LLAMACPP_IDS, *MORE_TEXTS]:
            body = {"content": text, "add_special": False, "parse_special": True}
            req = urllib.request.Request(
                server.listening_address + "/tokenize",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=30) as resp:
                expected = json.loads(resp.read())["tokens"]
            assert smol_tokenizer.encode(text) == expected, text
    finally:
        del server


# ------------------------------------------------------------------ metadata reader


def _write_gguf(path: Path, fill: dict[str, object]) -> None:
    w = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in fill.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)  # type: ignore[arg-type]
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_metadata_reader_matches_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(
        path,
        {
            "x.u32": 7,
            "x.f32": 0.5,
            "x.flag": True,
            "x.name": "héllo ✓",
            "x.strs": ["a", "b c", "😀"],
            "x.ints": [1, -2, 3],
        },
    )
    mine = read_gguf_metadata(path)
    reader = gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        theirs = field.contents()
        assert mine[key] == pytest.approx(theirs) if isinstance(theirs, float) else theirs, key
    assert mine["general.architecture"] == "llama"
    assert mine["x.strs"] == ["a", "b c", "😀"]


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ConfigError, match="not a GGUF file"):
        read_gguf_metadata(bad)
    with pytest.raises(ConfigError, match=r"missing\.gguf"):
        read_gguf_metadata(tmp_path / "missing.gguf")


def test_truncated_gguf(tmp_path: Path, gguf_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with gguf_path.open("rb") as f:
        cut.write_bytes(f.read(4096))
    with pytest.raises(ConfigError, match="truncated"):
        read_gguf_metadata(cut)


def test_spm_tokenizer_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    _write_gguf(
        path,
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "▁a"],
        },
    )
    with pytest.raises(ConfigError, match="'llama' is not supported"):
        Tokenizer.from_gguf(path)


def test_tiny_gpt2_gguf(tmp_path: Path) -> None:
    """A hand-made byte-level vocabulary: merges apply, control tokens are special, BOS is
    added when the file says so."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    tokens = ["<|bos|>", "<|eos|>", *alphabet, "ab", "abc"]
    types = [3, 3] + [1] * (len(alphabet) + 2)
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "no-such-pre",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["a b", "ab c"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
    }
    inner, info = build_gguf_tokenizer(meta)
    abc = tokens.index("abc")
    assert inner.encode("abc", add_special_tokens=False).ids == [abc]
    assert inner.encode("abc").ids == [0, abc]
    assert inner.decode([0, abc, 1]) == "abc"
    assert info.eos_token_id == 1
    assert info.add_bos
