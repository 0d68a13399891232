"""The mocker's output tokens: deterministic stand-ins for a model's samples.

A sampler is a policy apart from the scheduler: the scheduler asks it for the token at each
output position and then applies the stop rules (EOS, stop token ids, ``min_tokens``,
``max_tokens``) itself, so a test can plug in a sampler that emits a stop token on purpose.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import xxhash

from turnout.engines.mocker.request import MockRequest

_MASK = (1 << 64) - 1
#: The splitmix64 increment: one output position's step in the token sequence.
_GOLDEN = 0x9E3779B97F4A7C15


def token_seed(seed: int, prompt_token_ids: list[int], original_len: int | None = None) -> int:
    """A request's token seed: the engine seed mixed with its prompt (one hash, at admission).

    A request that continues a migrated one (``original_len``: how many leading tokens are
    the client's prompt; the rest were generated before the move) gets the seed of the
    original request shifted by the positions already produced, so it goes on with exactly
    the tokens the interrupted run would have produced next.
    """
    if original_len is None or not 0 < original_len <= len(prompt_token_ids):
        original_len = len(prompt_token_ids)
    raw = np.asarray(prompt_token_ids[:original_len], dtype="<u4").tobytes()
    base = xxhash.xxh3_64_intdigest(raw, seed=seed & _MASK)
    return (base + (len(prompt_token_ids) - original_len) * _GOLDEN) & _MASK


class TokenSampler(Protocol):
    def next_token(self, request: MockRequest) -> int:
        """The token at output position ``request.num_output`` (not yet appended)."""
        ...


class HashTokenSampler:
    """``splitmix64(token_seed + position) % vocab_size``: the same prompt and seed give the
    same output on every worker and every run.

    It never emits an EOS or stop token by chance; it emits the first EOS id as the last
    token of a request that set no ``max_tokens`` (unless ``ignore_eos``), which is when a
    model would stop on its own.
    """

    __slots__ = ("_vocab_size",)

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size

    def next_token(self, request: MockRequest) -> int:
        position = request.num_output
        if (
            request.eos_at_end
            and not request.ignore_eos
            and request.eos_token_ids
            and position + 1 >= request.max_tokens
        ):
            return min(request.eos_token_ids)
        # splitmix64 finaliser: cheap, well mixed, pure integer arithmetic.
        z = (request.token_seed + (position + 1) * _GOLDEN) & _MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        token = (z ^ (z >> 31)) % self._vocab_size
        eos = request.eos_token_ids
        stop = request.stop_token_ids
        # The config guarantees the vocabulary is not all EOS; stop ids may still cover it,
        # so the walk is bounded by vocab_size.
        for _ in range(self._vocab_size):
            if token not in eos and token not in stop:
                return token
            token = (token + 1) % self._vocab_size
        return token
