"""Block hashing: a wire format shared by workers (their KV events) and routers (their index),
so both name blocks alike. It lives below both layers: engines need not import the router.

A prompt is cut into blocks of ``block_size`` tokens; a trailing partial block is not hashed
(engines cache only full blocks).

* local block hash: ``xxh3_64(tokens as little-endian u32 [+ extra bytes], seed)``, where the
  seed is ``KV_HASH_SEED``, or derived from it, the LoRA adapter's name and the request's
  cache salt (vLLM's ``cache_salt``): the same tokens under another adapter or another tenant's
  salt hash apart, so no router credits one partition with another's cache. ``extra`` carries
  multimodal item hashes that belong to a block.
* sequence hash: the first block's sequence hash is its local hash; every later one is
  ``xxh3_64(parent_sequence_hash as u64 LE ++ local_hash as u64 LE, KV_HASH_SEED)``. It
  names the whole prefix up to and including the block.

::

    tokens   [t0 .. t15][t16 .. t31][t32 .. t40]      block_size = 16
    local        L0         L1        (partial: not hashed)
    sequence     S0=L0      S1=h(S0,L1)

Hashing is most of the cost of a KV routing decision (an 8K-token prompt is 512 blocks, two
xxh3 calls each), so the common case is tuned: a token *list* is packed with
``array('I').fromlist`` (converting a list of Python ints with ``np.asarray`` costs more than
hashing it), local hashes run with the loop in C (``map`` over cached slice objects), and the
chain is one iteration of two C calls per block. The chain is sequential (each hash takes its
parent's) and the local hashes are one C call each, so what is left is the interpreter's
per-block dispatch: about 0.1 us a block each. numpy arrays, multimodal extras and big-endian
hosts take the plain path.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from itertools import islice, repeat
from typing import cast

import numpy as np
import xxhash

from turnout.protocols.kv import LocalBlockHash, SequenceHash

KV_HASH_SEED = 1337

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack
#: ``array('I')`` is native-endian; the fast packing is valid only where that is little-endian.
_ARRAY_IS_LE_U32 = sys.byteorder == "little" and array("I").itemsize == 4


def hash_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The seed for local block hashes: each adapter and each cache salt is its own hash space.

    Without a salt the seed depends on the adapter alone (``KV_HASH_SEED``, or the adapter
    name hashed under it), so every unsalted request of an adapter shares one space; a
    salted key spells out the adapter name's length, so no (adapter, salt) split of the same
    bytes can meet another.
    """
    if not cache_salt:
        if not lora_name:
            return KV_HASH_SEED
        return _xxh3(lora_name.encode(), seed=KV_HASH_SEED)
    lora = (lora_name or "").encode()
    key = b"salt\x00%d\x00%s%s" % (len(lora), lora, cache_salt.encode())
    return _xxh3(key, seed=KV_HASH_SEED)


def _pack_tokens(token_ids: Sequence[int] | np.ndarray, count: int) -> bytes:
    """At least the first ``count`` tokens as little-endian u32 bytes (OverflowError or
    ValueError when an id does not fit in u32). A list is packed whole, its partial block
    too: ``array.fromlist`` runs a third faster than building the array from a slice."""
    if _ARRAY_IS_LE_U32 and not isinstance(token_ids, np.ndarray):
        packed = array("I")
        if type(token_ids) is list:
            packed.fromlist(token_ids)
        else:
            packed.extend(token_ids[:count])
        return packed.tobytes()
    return np.asarray(token_ids[:count], dtype="<u4").tobytes()


_slices: dict[int, list[slice]] = {}


def _block_slices(stride: int, num_blocks: int) -> list[slice]:
    """``[slice(0, stride), slice(stride, 2 * stride), ...]``, ``num_blocks`` long; one list
    per stride is kept and grown, so a prompt costs a list slice, not new slice objects."""
    cached = _slices.get(stride)
    if cached is None or len(cached) < num_blocks:
        size = max(num_blocks, 2 * len(cached) if cached else 1024)
        cached = _slices[stride] = [slice(i * stride, (i + 1) * stride) for i in range(size)]
    return cached[:num_blocks]


def compute_local_block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
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
    raw = _pack_tokens(token_ids, num_blocks * block_size)
    seed = hash_seed(lora_name, cache_salt)
    stride = block_size * 4
    if block_extra is None:
        # ``LocalBlockHash`` is an ``int`` at run time: no wrapping per block on this path.
        return cast(
            list[LocalBlockHash],
            list(map(_xxh3, map(raw.__getitem__, _block_slices(stride, num_blocks)), repeat(seed))),
        )
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
    if not local_hashes:
        return []
    xxh3, pack, seed = _xxh3, _pack_pair, KV_HASH_SEED
    first = local_hashes[0] if parent is None else xxh3(pack(parent, local_hashes[0]), seed)
    prev = first
    # A comprehension appends without a method call per block.
    out = [prev := xxh3(pack(prev, local), seed) for local in islice(local_hashes, 1, None)]
    out.insert(0, first)
    return cast(list[SequenceHash], out)  # ``SequenceHash`` is an ``int`` at run time


def compute_block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    block_extra: Sequence[bytes | None] | None = None,
) -> tuple[list[LocalBlockHash], list[SequenceHash]]:
    """Both hash lists for a prompt, in one call."""
    local = compute_local_block_hashes(
        token_ids, block_size, lora_name=lora_name, cache_salt=cache_salt, block_extra=block_extra
    )
    return local, compute_sequence_hashes(local)


def compute_seq_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    block_extra: Sequence[bytes | None] | None = None,
) -> list[SequenceHash]:
    """The sequence hashes of a prompt's full blocks (what the router looks up)."""
    return compute_block_hashes(
        token_ids, block_size, lora_name=lora_name, cache_salt=cache_salt, block_extra=block_extra
    )[1]
