"""What a model card may announce: the range of each of its numbers, and why.

Whoever can write the discovery store can write a card, and each of a card's numbers sizes
an allocation, a loop or a request somewhere: a context of 2^62 tokens lets 2^40 tokens be
asked of a worker, a KV block of 0 tokens divides by zero in block hashing, a tokenizer
announced at 20 GB is buffered whole. ``card_problem`` says why a card must not be served;
the frontend's model watcher refuses such cards, the standalone KV router skips them, and
a worker refuses to publish one (``llm.model_card``).

Layering: protocols only (routers and frontends import it without the model-loading code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from turnout.protocols.model import ModelDeploymentCard

__all__ = [
    "DEFAULT_MAX_ARTIFACT_BYTES",
    "CardBounds",
    "CardProblem",
    "card_problem",
]

#: The default bound on one artifact a card names (``--max-artifact-bytes``): the largest
#: real tokenizer.json files are about 30 MB (Gemma 3's is 33 MB, Llama 3's 9 MB), so this
#: leaves a factor of 8, while a card announcing gigabytes is refused before a byte moves.
DEFAULT_MAX_ARTIFACT_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class CardBounds:
    """The range of each number a card may announce, and why (the ranges are wide: they
    refuse nonsense, not unusual models).

    * ``context_length`` 1 .. 2^24 (16,777,216) tokens: the longest contexts models ship
      with are 10M tokens (Llama 4 Scout); past the bound, ``max_tokens`` defaults and
      prompt checks stop meaning anything (2^62 would let 2^40 tokens be asked of a worker).
    * ``kv_cache_block_size`` 1 .. 2^16 tokens: vLLM uses 16 by default (1 to 256 for plain
      attention), SGLang's page size is any small number, and hybrid attention/Mamba models
      raise vLLM's to keep pages aligned (672 for Nemotron-Nano-9B-v2, 2,096 and 7,808 on
      Qwen3.5 and GLM deployments); 0 divides by zero in block hashing.
    * ``runtime_config.data_parallel_size`` 1 .. 1,024: the KV router keeps a worker per
      rank of every instance; wide expert-parallel deployments run a few hundred ranks.
    * ``eos_token_ids``: at most 256 ids, each 0 .. 2^31 - 1 (they join every request's
      stop tokens; vocabularies are below 2^18).
    * ``chat_template``: at most 1 MiB of text (real ones are 1 to 30 KB); names and special
      tokens at most 1,024 characters.
    * ``embedding.dimensions`` 1 .. 2^16 (the largest models return 4,096 to 8,192), at most
      64 shorter lengths, each below the full one; tensor specs: at most 64 inputs and
      outputs of at most 16 dimensions.
    * ``runtime_config``'s block, sequence and batch counts 0 .. 2^40;
      ``capabilities.max_top_logprobs`` 0 .. 2^20; ``lora_adapters``: at most 4,096 names.
    * every artifact (the tokenizer): at most ``max_artifact_bytes``.
    """

    max_context_length: int = 1 << 24
    max_kv_block_size: int = 1 << 16
    max_data_parallel_size: int = 1024
    max_eos_token_ids: int = 256
    max_token_id: int = (1 << 31) - 1
    max_template_chars: int = 1 << 20
    max_name_chars: int = 1024
    max_embedding_dimensions: int = 1 << 16
    max_truncations: int = 64
    max_tensors: int = 64
    max_tensor_rank: int = 16
    max_lora_adapters: int = 4096
    max_artifact_bytes: int | None = DEFAULT_MAX_ARTIFACT_BYTES


class CardProblem(NamedTuple):
    """Why a card is refused: the field at fault (``runtime_config.data_parallel_size``) and
    the reason, without the instance (one problem is logged once for all instances)."""

    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"


def _out_of_range(value: object, low: int, high: int) -> str | None:
    if type(value) is not int or not low <= value <= high:
        return f"{value!r} is outside {low}..{high}"
    return None


def card_problem(
    card: ModelDeploymentCard, bounds: CardBounds = CardBounds()
) -> CardProblem | None:
    """The first reason ``card`` must not be served, or None (see ``CardBounds``).

    ``bounds.max_artifact_bytes`` None leaves artifact sizes unchecked (a worker checking its
    own card: the bound is each frontend's to set)."""
    b = bounds
    for name, value in (("display_name", card.display_name), ("bos_token", card.bos_token),
                        ("eos_token", card.eos_token)):  # fmt: skip
        if value is not None and len(value) > b.max_name_chars:
            return CardProblem(name, f"{len(value)} characters; at most {b.max_name_chars}")
    if not card.display_name:
        return CardProblem("display_name", "empty")
    for name, number, high in (
        ("context_length", card.context_length, b.max_context_length),
        ("kv_cache_block_size", card.kv_cache_block_size, b.max_kv_block_size),
        (
            "runtime_config.data_parallel_size",
            card.runtime_config.data_parallel_size,
            b.max_data_parallel_size,
        ),
    ):
        why = _out_of_range(number, 1, high)
        if why is not None:
            return CardProblem(name, why)
    rc = card.runtime_config
    for name, count in (("total_kv_blocks", rc.total_kv_blocks), ("max_num_seqs", rc.max_num_seqs),
                        ("max_num_batched_tokens", rc.max_num_batched_tokens)):  # fmt: skip
        why = None if count is None else _out_of_range(count, 0, 1 << 40)
        if why is not None:
            return CardProblem(f"runtime_config.{name}", why)
    if len(card.eos_token_ids) > b.max_eos_token_ids:
        return CardProblem(
            "eos_token_ids", f"{len(card.eos_token_ids)} ids; at most {b.max_eos_token_ids}"
        )
    for token_id in card.eos_token_ids:
        why = _out_of_range(token_id, 0, b.max_token_id)
        if why is not None:
            return CardProblem("eos_token_ids", why)
    if card.chat_template is not None and len(card.chat_template) > b.max_template_chars:
        return CardProblem(
            "chat_template",
            f"{len(card.chat_template)} characters; at most {b.max_template_chars}",
        )
    if b.max_artifact_bytes is not None:
        for ref in card.artifacts():
            if ref.size > b.max_artifact_bytes:
                return CardProblem(
                    "tokenizer.size",
                    f"{ref.name} of {ref.size} bytes; this frontend takes artifacts of at "
                    f"most {b.max_artifact_bytes} bytes (--max-artifact-bytes)",
                )
    why = _out_of_range(card.capabilities.max_top_logprobs, 0, 1 << 20)
    if why is not None:
        return CardProblem("capabilities.max_top_logprobs", why)
    if len(card.lora_adapters) > b.max_lora_adapters:
        return CardProblem(
            "lora_adapters", f"{len(card.lora_adapters)} names; at most {b.max_lora_adapters}"
        )
    return _spec_problem(card, b)


def _spec_problem(card: ModelDeploymentCard, b: CardBounds) -> CardProblem | None:
    """The embedding and tensor specs' share of ``card_problem``."""
    emb = card.embedding
    if emb is not None:
        why = _out_of_range(emb.dimensions, 1, b.max_embedding_dimensions)
        if why is not None:
            return CardProblem("embedding.dimensions", why)
        if len(emb.truncatable_to) > b.max_truncations:
            return CardProblem(
                "embedding.truncatable_to",
                f"{len(emb.truncatable_to)} lengths; at most {b.max_truncations}",
            )
        for dims in emb.truncatable_to:
            why = _out_of_range(dims, 1, emb.dimensions)
            if why is not None:
                return CardProblem("embedding.truncatable_to", why)
    spec = card.tensor
    if spec is not None:
        for side, tensors in (("inputs", spec.inputs), ("outputs", spec.outputs)):
            if len(tensors) > b.max_tensors:
                return CardProblem(
                    f"tensor.{side}", f"{len(tensors)} tensors; at most {b.max_tensors}"
                )
            for i, t in enumerate(tensors):
                where = f"tensor.{side}[{i}].shape"
                if len(t.shape) > b.max_tensor_rank:
                    return CardProblem(
                        where, f"{len(t.shape)} dimensions; at most {b.max_tensor_rank}"
                    )
                for dim in t.shape:
                    why = _out_of_range(dim, -1, (1 << 31) - 1)
                    if why is not None:
                        return CardProblem(where, why)
    return None
