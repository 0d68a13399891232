"""Conditional disaggregation: whether a request skips the prefill stage and runs whole on
its decode worker, and why (``LocalReason``, also the metric label).

Two questions, asked by the prefill router in this order:

1. ``before_routing``: reasons that need no routing decision. One output token only (the
   prefill worker would produce all of it), a LoRA adapter (prefill workers serve base
   models), a request pinned to an instance, a structured output (its grammar must see every
   token it constrains on one engine; a decode worker would start it afresh after the
   prefill worker's first token), or prefill workers whose card differs from the model's (a
   KV handle would not fit).
2. ``after_routing``: the prompt tokens the chosen decode worker does not hold yet are fewer
   than ``min_tokens``: a short prompt, or a later turn of a conversation whose context the
   decode worker caches (``overlap_blocks`` of the prompt, from the KV router's choice).

``None`` from both: the request is disaggregated.
"""

from __future__ import annotations

import enum
import logging

from turnout.protocols.llm import PreprocessedRequest

__all__ = ["BypassPolicy", "LocalReason"]

log = logging.getLogger("turnout.router.prefill_router")


class LocalReason(enum.StrEnum):
    """Why an active prefill router let a request run whole on its decode worker."""

    SHORT = "short_prompt"
    CACHED = "cached_on_decode"
    ONE_TOKEN = "max_tokens_1"
    LORA = "lora"
    PINNED = "pinned"
    #: A structured output: its grammar must see every token it constrains on one engine (a
    #: decode worker would start it afresh after the prefill worker's first token).
    STRUCTURED = "structured_output"
    CARD_MISMATCH = "card_mismatch"
    NO_PREFILL_WORKER = "no_prefill_worker"
    NO_HANDLE = "no_handle"
    KV_RETRIES_EXHAUSTED = "kv_retries_exhausted"


class BypassPolicy:
    """One model's bypass rules (see the module docstring). ``checksum``: the model's card
    checksum, which its prefill workers' must equal; ``block_size``: its KV block size."""

    def __init__(self, *, model: str, checksum: str, block_size: int, min_tokens: int) -> None:
        self.model = model
        self.checksum = checksum
        self.block_size = block_size
        self.min_tokens = min_tokens
        self._warned_mismatch = False

    def before_routing(
        self, request: PreprocessedRequest, prefill_checksum: str
    ) -> LocalReason | None:
        """A reason to run ``request`` whole that needs no routing decision, or None."""
        if request.stop_conditions.max_tokens == 1:
            return LocalReason.ONE_TOKEN
        if request.lora_name:
            return LocalReason.LORA
        if request.backend_instance_id is not None:
            return LocalReason.PINNED
        if request.structured is not None:
            return LocalReason.STRUCTURED
        if prefill_checksum != self.checksum:
            if not self._warned_mismatch:
                self._warned_mismatch = True
                log.warning(
                    "model %s: its prefill workers publish card checksum %s, its decode workers "
                    "%s (tokenizer, template or block size differ): requests run on the "
                    "decode workers alone",
                    self.model,
                    prefill_checksum,
                    self.checksum,
                )
            return LocalReason.CARD_MISMATCH
        return None

    def after_routing(
        self, request: PreprocessedRequest, overlap_blocks: int
    ) -> LocalReason | None:
        """``SHORT``/``CACHED`` when the prompt tokens the decode worker lacks (it holds
        ``overlap_blocks`` of the prompt) are fewer than ``min_tokens``, else None."""
        prompt = len(request.token_ids)
        if prompt - overlap_blocks * self.block_size >= self.min_tokens:
            return None
        return LocalReason.SHORT if prompt < self.min_tokens else LocalReason.CACHED
