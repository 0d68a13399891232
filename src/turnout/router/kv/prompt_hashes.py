"""The router's fast path to a prompt's sequence hashes, equal to ``hashing.py``'s.

Hashing is most of the cost of a routing decision (an 8K-token prompt is 512 blocks, two
xxh3 calls each), so the router does not go through numpy for a token *list*: converting a
list of Python ints with ``np.asarray`` costs more than hashing it. Instead the list is
packed with ``array('I')`` (native u32, which is little-endian here, checked at import), and
local hashes are computed by ``map`` over cached slice objects (the loop runs in C), and
the chain with positional-argument calls. The results are the same numbers as
``hashing.compute_block_hashes`` (a test checks it); anything unusual (numpy input,
multimodal extras, a big-endian host) goes through ``hashing.py`` itself.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from itertools import repeat

import numpy as np
import xxhash

from turnout.protocols.kv import SequenceHash
from turnout.router.kv.hashing import (
    KV_HASH_SEED,
    compute_local_block_hashes,
    compute_sequence_hashes,
    hash_seed,
)

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack
_FAST = sys.byteorder == "little" and array("I").itemsize == 4


def compute_prompt_seq_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    lora_name: str | None = None,
    block_extra: Sequence[bytes | None] | None = None,
) -> list[SequenceHash]:
    """Sequence hashes of the full blocks of ``token_ids`` (a trailing partial block is not
    hashed), as ``hashing.compute_block_hashes(...)[1]`` computes them."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not _FAST or block_extra is not None or isinstance(token_ids, np.ndarray):
        local = compute_local_block_hashes(
            token_ids, block_size, lora_name=lora_name, block_extra=block_extra
        )
        return compute_sequence_hashes(local)
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    # array('I') raises OverflowError for ids outside u32, as numpy does.
    raw = array("I", token_ids[: num_blocks * block_size]).tobytes()
    xxh3 = _xxh3
    # Local hashes with the loop in C: map over cached slice objects.
    block_hashes: list[int] = list(
        map(
            xxh3,
            map(raw.__getitem__, _block_slices(block_size * 4, num_blocks)),
            repeat(hash_seed(lora_name)),
        )
    )
    pack = _pack_pair
    chain_seed = KV_HASH_SEED
    prev = block_hashes[0]
    out: list[SequenceHash] = [SequenceHash(prev)]
    append = out.append
    for i in range(1, num_blocks):
        prev = xxh3(pack(prev, block_hashes[i]), chain_seed)
        append(prev)  # type: ignore[arg-type]  # NewType call skipped on the hot path
    return out


_slices: dict[int, list[slice]] = {}


def _block_slices(stride: int, num_blocks: int) -> list[slice]:
    """``[slice(0, stride), slice(stride, 2 * stride), ...]``, ``num_blocks`` long; one
    list per stride is kept and grown, so a prompt costs a list slice, not new objects."""
    cached = _slices.get(stride)
    if cached is None or len(cached) < num_blocks:
        size = max(num_blocks, 2 * len(cached) if cached else 1024)
        cached = _slices[stride] = [slice(i * stride, (i + 1) * stride) for i in range(size)]
    return cached[:num_blocks]
