"""Block hashing shared by the router and the engines (the mocker), so both name blocks alike.

A prompt is cut into blocks of ``block_size`` tokens; a trailing partial block is not hashed
(engines cache only full blocks).

* local block hash: ``xxh3_64(tokens as little-endian u32 [+ extra bytes], seed)``, where the
  seed is ``KV_HASH_SEED``, or derived from it and the LoRA adapter's name, so the same tokens
  under an adapter hash apart. ``extra`` carries multimodal item hashes that belong to a block.
* sequence hash: the first block's sequence hash is its local hash; every later one is
  ``xxh3_64(parent_sequence_hash as u64 LE ++ local_hash as u64 LE, seed)``. It names the
  whole prefix up to and including the block.

::

    tokens   [t0 .. t15][t16 .. t31][t32 .. t40]      block_size = 16
    local        L0         L1        (partial: not hashed)
    sequence     S0=L0      S1=h(S0,L1)
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

from turnout.protocols.kv import LocalBlockHash, SequenceHash

KV_HASH_SEED = 1337

_xxh3 = xxhash.xxh3_64_intdigest
_pair = struct.Struct("<QQ")


def hash_seed(lora_name: str | None = None) -> int:
    """The seed for local block hashes: adapters get their own hash space."""
    if not lora_name:
        return KV_HASH_SEED
    return _xxh3(lora_name.encode(), seed=KV_HASH_SEED)


def compute_local_block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    lora_name: str | None = None,
    block_extra: Sequence[bytes | None] | None = None,
) -> list[LocalBlockHash]:
    """Local hash of each full block of ``token_ids``.

    ``block_extra[i]``, when given and not None, is mixed into block ``i`` (multimodal items).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    raw = np.asarray(token_ids[: num_blocks * block_size], dtype="<u4").tobytes()
    seed = hash_seed(lora_name)
    stride = block_size * 4
    if block_extra is None:
        return [
            LocalBlockHash(_xxh3(raw[i : i + stride], seed=seed))
            for i in range(0, len(raw), stride)
        ]
    out: list[LocalBlockHash] = []
    for b in range(num_blocks):
        chunk = raw[b * stride : (b + 1) * stride]
        extra = block_extra[b] if b < len(block_extra) else None
        out.append(LocalBlockHash(_xxh3(chunk + extra if extra else chunk, seed=seed)))
    return out


def compute_sequence_hashes(
    local_hashes: Sequence[int], parent: int | None = None
) -> list[SequenceHash]:
    """Chain local hashes into sequence hashes, optionally continuing from ``parent``."""
    out: list[SequenceHash] = []
    prev = parent
    for local in local_hashes:
        seq = local if prev is None else _xxh3(_pair.pack(prev, local), seed=KV_HASH_SEED)
        out.append(SequenceHash(seq))
        prev = seq
    return out


def compute_block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    lora_name: str | None = None,
    block_extra: Sequence[bytes | None] | None = None,
) -> tuple[list[LocalBlockHash], list[SequenceHash]]:
    """Both hash lists for a prompt, in one call."""
    local = compute_local_block_hashes(
        token_ids, block_size, lora_name=lora_name, block_extra=block_extra
    )
    return local, compute_sequence_hashes(local)
