"""The router's fast path to a prompt's sequence hashes, equal to ``hashing.py``'s.

Hashing is most of the cost of a routing decision (an 8K-token prompt is 512 blocks, two
xxh3 calls each), so the router does not go through numpy for a token *list*: converting a
list of Python ints with ``np.asarray`` costs more than hashing it. Instead the list is
packed with ``array('I')`` (native u32, which is little-endian here, checked at import), and
the chain is computed with positional-argument calls. The results are the same numbers as
``hashing.compute_block_hashes`` (a test checks it); anything unusual (numpy input,
multimodal extras, a big-endian host) goes through ``hashing.py`` itself.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

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
    raw = memoryview(array("I", token_ids[: num_blocks * block_size])).cast("B")
    seed = hash_seed(lora_name)
    stride = block_size * 4
    xxh3 = _xxh3
    pack = _pack_pair
    chain_seed = KV_HASH_SEED
    out: list[SequenceHash] = []
    append = out.append
    prev = xxh3(raw[0:stride], seed)
    append(SequenceHash(prev))
    for start in range(stride, num_blocks * stride, stride):
        prev = xxh3(pack(prev, xxh3(raw[start : start + stride], seed)), chain_seed)
        append(prev)  # type: ignore[arg-type]  # NewType call skipped on the hot path
    return out
