"""``card_problem``: every number a card announces is held to the range real models use, and
a worker refuses to publish a card frontends would refuse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tests.llm.conftest import make_small_hf_tokenizer

from turnout.errors import ConfigError
from turnout.llm.model_card import load_model_card
from turnout.protocols.card_bounds import CardBounds, card_problem
from turnout.protocols.model import (
    ArtifactRef,
    EndpointId,
    ModelCapabilities,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
    RuntimeConfig,
)
from turnout.protocols.unary import DataType, EmbeddingSpec, TensorModelSpec, TensorSpec

EP = EndpointId(namespace="ns", component="backend", name="generate")
GOOD = ModelDeploymentCard(
    display_name="m",
    endpoint=EP,
    instance_id=1,
    model_type=ModelType.Chat,
    model_input=ModelInput.Tokens,
    tokenizer=ArtifactRef(name="tokenizer.json", kind="hf", sha256="ab" * 32, size=9_000_000),
    chat_template="{{ messages }}",
)


def tensor(shape: list[int]) -> TensorModelSpec:
    spec = TensorSpec(name="x", datatype=next(iter(DataType)), shape=shape)
    return TensorModelSpec(inputs=[spec], outputs=[spec])


CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("good", {}, None),
    ("10M context", {"context_length": 10_000_000}, None),
    ("hybrid block", {"kv_cache_block_size": 7808}, None),
    ("context 0", {"context_length": 0}, "context_length"),
    ("context 2^62", {"context_length": 2**62}, "context_length"),
    ("block 0", {"kv_cache_block_size": 0}, "kv_cache_block_size"),
    ("block -16", {"kv_cache_block_size": -16}, "kv_cache_block_size"),
    ("block 2^17", {"kv_cache_block_size": 1 << 17}, "kv_cache_block_size"),
    ("dp 0", {"runtime_config": RuntimeConfig(data_parallel_size=0)}, "runtime_config"),
    ("dp 2^20", {"runtime_config": RuntimeConfig(data_parallel_size=1 << 20)}, "runtime_config"),
    ("blocks -1", {"runtime_config": RuntimeConfig(total_kv_blocks=-1)}, "runtime_config"),
    ("eos many", {"eos_token_ids": list(range(1000))}, "eos_token_ids"),
    ("eos negative", {"eos_token_ids": [-1]}, "eos_token_ids"),
    ("template 2 MiB", {"chat_template": "x" * (2 << 20)}, "chat_template"),
    ("name empty", {"display_name": ""}, "display_name"),
    ("name long", {"display_name": "m" * 5000}, "display_name"),
    ("eos token long", {"eos_token": "e" * 5000}, "eos_token"),
    (
        "tokenizer 20 GB",
        {"tokenizer": ArtifactRef(name="t", kind="hf", sha256="ab" * 32, size=20 << 30)},
        "tokenizer.size",
    ),
    (
        "logprobs negative",
        {"capabilities": ModelCapabilities(logprobs=True, max_top_logprobs=-1)},
        "capabilities",
    ),
    ("lora many", {"lora_adapters": [f"a{i}" for i in range(5000)]}, "lora_adapters"),
    ("embedding 0", {"embedding": EmbeddingSpec(dimensions=0)}, "embedding.dimensions"),
    (
        "embedding cut longer",
        {"embedding": EmbeddingSpec(dimensions=384, truncatable_to=[512])},
        "embedding.truncatable_to",
    ),
    ("tensor rank 100", {"tensor": tensor([1] * 100)}, "tensor.inputs[0].shape"),
    ("tensor dim -5", {"tensor": tensor([-5])}, "tensor.inputs[0].shape"),
    ("tensor any length", {"tensor": tensor([-1, 3])}, None),
]


@pytest.mark.parametrize(
    ("changes", "field"), [(c, f) for _, c, f in CASES], ids=[i for i, _, _ in CASES]
)
def test_each_field_is_held_to_its_range(changes: dict[str, Any], field: str | None) -> None:
    card = msgspec.structs.replace(GOOD, **changes)
    problem = card_problem(card)
    if field is None:
        assert problem is None, problem
    else:
        assert problem is not None and problem.field.startswith(field), problem


def test_the_artifact_bound_is_the_callers() -> None:
    card = msgspec.structs.replace(
        GOOD, tokenizer=ArtifactRef(name="t", kind="hf", sha256="ab" * 32, size=64 << 20)
    )
    assert card_problem(card, CardBounds(max_artifact_bytes=32 << 20)) is not None
    assert card_problem(card, CardBounds(max_artifact_bytes=None)) is None
    problem = card_problem(card, CardBounds(max_artifact_bytes=32 << 20))
    assert problem is not None and "--max-artifact-bytes" in str(problem)


def test_a_worker_refuses_to_publish_a_card_frontends_would_refuse(tmp_path: Path) -> None:
    d = tmp_path / "model"
    d.mkdir()
    make_small_hf_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 2**40}))
    with pytest.raises(ConfigError, match="context_length"):
        load_model_card(d, endpoint=EP)
    # An explicit context length wins over the file's, and is checked too.
    assert load_model_card(d, endpoint=EP, context_length=4096).context_length == 4096
    with pytest.raises(ConfigError, match="kv_cache_block_size"):
        load_model_card(d, endpoint=EP, context_length=4096, kv_cache_block_size=1 << 20)
