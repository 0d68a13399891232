"""Model cards from Hugging Face directories and GGUF files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest

from turnout.errors import ConfigError
from turnout.llm.artifacts import LOCAL_ARTIFACTS
from turnout.llm.model_card import default_gguf_path, load_model_card
from turnout.llm.tokenizer import Tokenizer, load_tokenizer
from turnout.protocols.model import (
    ArtifactRef,
    EndpointId,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
    RuntimeConfig,
)

EP = EndpointId(namespace="ns", component="backend", name="generate")


def _added(i: int, content: str) -> dict[str, Any]:
    return {
        "id": i,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


TOKENIZER_JSON = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [_added(0, "<s>"), _added(1, "</s>"), _added(2, "<|eot|>")],
    "normalizer": None,
    "pre_tokenizer": {"type": "Whitespace"},
    "post_processor": None,
    "decoder": None,
    "model": {
        "type": "WordLevel",
        "vocab": {"<s>": 0, "</s>": 1, "<|eot|>": 2, "hello": 3, "world": 4, "[UNK]": 5},
        "unk_token": "[UNK]",
    },
}
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def write_model(d: Path, **files: Any) -> Path:
    """An HF model directory; each keyword is a file name (dots as '_'), None to omit."""
    d.mkdir(parents=True, exist_ok=True)
    defaults: dict[str, Any] = {
        "tokenizer.json": TOKENIZER_JSON,
        "tokenizer_config.json": {
            "bos_token": "<s>",
            "eos_token": {"content": "</s>", "special": True, "__type": "AddedToken"},
            "chat_template": TEMPLATE,
            "model_max_length": 1000000000000000019884624838656,
        },
        "config.json": {"max_position_embeddings": 2048, "eos_token_id": 1},
        "generation_config.json": {"eos_token_id": [1, 2]},
    }
    for key, value in files.items():
        defaults[key.replace("_json", ".json").replace("_jinja", ".jinja")] = value
    for name, content in defaults.items():
        if content is None:
            continue
        text = content if isinstance(content, str) else json.dumps(content)
        (d / name).write_text(text)
    return d


def test_hf_directory(tmp_path: Path) -> None:
    d = write_model(tmp_path / "tiny-model")
    card = load_model_card(d, endpoint=EP, instance_id=7)
    assert card.display_name == "tiny-model"
    assert card.endpoint == EP
    assert card.instance_id == 7
    assert card.model_type == ModelType.Chat | ModelType.Completions
    assert card.model_input is ModelInput.Tokens
    assert card.chat_template == TEMPLATE
    assert card.context_length == 2048
    assert card.eos_token_ids == [1, 2]  # generation_config.json wins over config.json
    assert (card.bos_token, card.eos_token) == ("<s>", "</s>")
    assert card.tokenizer is not None
    assert card.tokenizer.kind == "hf_tokenizer_json"
    data = (d / "tokenizer.json").read_bytes()
    assert card.tokenizer == ArtifactRef(
        name="tokenizer.json",
        kind="hf_tokenizer_json",
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
    )
    assert LOCAL_ARTIFACTS.get(card.tokenizer.sha256) == data  # the worker can serve it
    tok = load_tokenizer(card.tokenizer, data, eos_token=card.eos_token)
    assert tok.encode("hello world") == [3, 4]
    assert tok.eos_token_id == 1


def test_hf_fallbacks(tmp_path: Path) -> None:
    """No generation_config: config.json's eos; no context in config: default, since the
    tokenizer's model_max_length is HF's 'unknown' sentinel."""
    d = write_model(tmp_path / "m", generation_config_json=None, config_json={"eos_token_id": 2})
    card = load_model_card(d, endpoint=EP)
    assert card.eos_token_ids == [2]
    assert card.context_length == 4096
    d1 = write_model(
        tmp_path / "m1", config_json={"text_config": {"max_position_embeddings": 1024}}
    )
    assert load_model_card(d1, endpoint=EP).context_length == 1024  # multimodal-style config
    d2 = write_model(tmp_path / "m2", generation_config_json=None, config_json=None)
    assert load_model_card(d2, endpoint=EP).eos_token_ids == [1]  # the tokenizer's eos token


def test_hf_arguments_win(tmp_path: Path) -> None:
    d = write_model(tmp_path / "m")
    rc = RuntimeConfig(total_kv_blocks=100)
    card = load_model_card(
        d,
        endpoint=EP,
        display_name="served-name",
        model_type=ModelType.Completions,
        context_length=512,
        kv_cache_block_size=32,
        runtime_config=rc,
    )
    assert (card.display_name, card.context_length, card.kv_cache_block_size) == (
        "served-name",
        512,
        32,
    )
    assert card.model_type == ModelType.Completions
    assert card.runtime_config.total_kv_blocks == 100


def test_chat_template_list_and_files(tmp_path: Path) -> None:
    listed = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    cfg = {"eos_token": "</s>", "chat_template": listed}
    d = write_model(tmp_path / "a", tokenizer_config_json=cfg)
    assert load_model_card(d, endpoint=EP).chat_template == "D"

    d = write_model(tmp_path / "b", chat_template_json={"chat_template": "J"})
    assert load_model_card(d, endpoint=EP).chat_template == "J"
    (d / "chat_template.jinja").write_text("JINJA")
    assert load_model_card(d, endpoint=EP).chat_template == "JINJA"

    cfg = {"chat_template": [{"name": "tool_use", "template": "T"}]}
    d = write_model(tmp_path / "c", tokenizer_config_json=cfg)
    with pytest.raises(ConfigError, match="without a 'default'"):
        load_model_card(d, endpoint=EP)


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({"tokenizer_json": None}, "no tokenizer.json"),
        ({"config_json": "{oops"}, "invalid JSON in .*config.json"),
        ({"tokenizer_config_json": "[1, 2]"}, "tokenizer_config.json: expected a JSON object"),
        ({"generation_config_json": {"eos_token_id": "x"}}, "generation_config.json: eos_token_id"),
        ({"tokenizer_json": "{}"}, "invalid tokenizer file .*tokenizer.json"),
    ],
)
def test_hf_bad_files(tmp_path: Path, files: dict[str, Any], match: str) -> None:
    d = write_model(tmp_path / "bad", **files)
    with pytest.raises(ConfigError, match=match):
        load_model_card(d, endpoint=EP)


def test_missing_and_odd_paths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_model_card(tmp_path / "nothing", endpoint=EP)
    odd = tmp_path / "weights.bin"
    odd.write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"weights\.bin: expected"):
        load_model_card(odd, endpoint=EP)


def test_gguf_card(gguf_path: Path, smol_tokenizer: Tokenizer) -> None:
    card = load_model_card(gguf_path, endpoint=EP)
    assert card.display_name == "SmolLM2-135M-Instruct.Q4_1"  # the file's stem
    assert card.context_length == 8192
    assert card.eos_token_ids == [2]
    assert (card.bos_token, card.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert card.chat_template is not None and "<|im_start|>" in card.chat_template
    assert card.tokenizer is not None
    # The artifact is the tokenizer.json built from the GGUF's metadata, not the GGUF file.
    assert card.tokenizer.kind == "hf_tokenizer_json"
    assert card.tokenizer.sha256 == smol_tokenizer.sha256
    data = LOCAL_ARTIFACTS.get(card.tokenizer.sha256)
    assert data is not None and len(data) == card.tokenizer.size
    assert hashlib.sha256(data).hexdigest() == card.tokenizer.sha256
    assert card.tokenizer.size < gguf_path.stat().st_size // 10
    assert load_model_card(gguf_path, endpoint=EP, display_name="smol").display_name == "smol"


_real_sha256 = hashlib.sha256


class _CountingSha:
    """Stands in for ``hashlib.sha256``, adding up the bytes hashed."""

    hashed = 0

    def __init__(self, data: bytes = b"") -> None:
        self._h = _real_sha256()
        self.update(data)

    def update(self, data: bytes) -> None:
        _CountingSha.hashed += len(data)
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def test_gguf_card_reads_only_the_header(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building a GGUF card hashes only the tokenizer JSON it produces, never the weights: on
    a file padded (sparsely) to 64 GiB it hashes the same few MB as on the original, and the
    card names the JSON's sha, which is independent of the padding."""
    big = tmp_path / "padded.gguf"
    shutil.copy(gguf_path, big)
    os.truncate(big, 1 << 36)
    expected = load_model_card(gguf_path, endpoint=EP).tokenizer
    monkeypatch.setattr(hashlib, "sha256", _CountingSha)
    _CountingSha.hashed = 0
    card = load_model_card(big, endpoint=EP)
    # Hashed: the JSON, once, for its reference; not one byte of the weights.
    assert card.tokenizer == expected
    assert expected is not None and _CountingSha.hashed == expected.size < 10 << 20


def test_card_json_names_no_path(tmp_path: Path, gguf_path: Path) -> None:
    for source in (write_model(tmp_path / "hf-model"), gguf_path):
        card = load_model_card(source, endpoint=EP)
        raw = json.loads(msgspec.json.encode(card))
        assert set(raw["tokenizer"]) == {"name", "kind", "sha256", "size"}
        assert str(source) not in json.dumps(raw)  # nothing of the worker's disk
        assert msgspec.json.decode(msgspec.json.encode(card), type=ModelDeploymentCard) == card


def test_card_from_an_older_worker_is_rejected_clearly() -> None:
    """Cards from workers that named a tokenizer by path lack the artifact fields: they do
    not decode, and the error names the field."""
    old = {
        "display_name": "m",
        "endpoint": {"namespace": "ns", "component": "c", "name": "g"},
        "instance_id": 1,
        "model_type": 3,
        "model_input": "tokens",
        "tokenizer": {"kind": "gguf", "path": "/models/m.gguf", "sha256": "ab" * 32},
    }
    with pytest.raises(
        msgspec.ValidationError, match=r"missing required field .* - at `\$\.tokenizer`"
    ):
        msgspec.json.decode(json.dumps(old), type=ModelDeploymentCard)


def test_checksum_follows_the_artifact_content(tmp_path: Path) -> None:
    a = load_model_card(write_model(tmp_path / "m"), endpoint=EP)
    moved = tmp_path / "elsewhere" / "m"
    shutil.copytree(tmp_path / "m", moved)
    b = load_model_card(moved, endpoint=EP)
    assert a.checksum() == b.checksum()  # same bytes, another path
    other = dict(TOKENIZER_JSON, model={**TOKENIZER_JSON["model"], "unk_token": "hello"})
    c = load_model_card(write_model(tmp_path / "x" / "m", tokenizer_json=other), endpoint=EP)
    assert c.checksum() != a.checksum()


def test_default_gguf_path() -> None:
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000
