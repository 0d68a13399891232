"""Block hashing: the tuned paths give the numbers of a plain reference implementation."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from turnout.protocols.block_hashing import (
    KV_HASH_SEED,
    compute_block_hashes,
    compute_seq_hashes,
    compute_sequence_hashes,
    hash_seed,
)


def reference(tokens: list[int], block_size: int, lora: str | None) -> tuple[list[int], list[int]]:
    seed = KV_HASH_SEED if not lora else xxhash.xxh3_64_intdigest(lora.encode(), seed=KV_HASH_SEED)
    local = []
    for b in range(len(tokens) // block_size):
        block = tokens[b * block_size : (b + 1) * block_size]
        local.append(xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *block), seed=seed))
    seq: list[int] = []
    for h in local:
        seq.append(
            h
            if not seq
            else xxhash.xxh3_64_intdigest(struct.pack("<QQ", seq[-1], h), seed=KV_HASH_SEED)
        )
    return local, seq


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.sampled_from([1, 4, 16, 32]),
    lora_name=st.sampled_from([None, "", "adapter-a"]),
)
def test_list_and_array_paths_equal_reference(
    tokens: list[int], block_size: int, lora_name: str | None
) -> None:
    expected = reference(tokens, block_size, lora_name)
    assert compute_block_hashes(tokens, block_size, lora_name=lora_name) == expected
    as_array = np.asarray(tokens, dtype=np.uint32)
    assert compute_block_hashes(as_array, block_size, lora_name=lora_name) == expected
    assert compute_seq_hashes(tokens, block_size, lora_name=lora_name) == expected[1]
    assert compute_block_hashes(tuple(tokens), block_size, lora_name=lora_name) == expected


def test_lora_and_multimodal_change_the_hashes() -> None:
    tokens = list(range(64))
    plain = compute_seq_hashes(tokens, 16)
    assert compute_seq_hashes(tokens, 16, lora_name="a") != plain
    assert hash_seed("a") != hash_seed("b") != KV_HASH_SEED
    with_image = compute_seq_hashes(tokens, 16, block_extra=[None, b"img-hash", None, None])
    assert with_image[0] == plain[0]
    assert with_image[1] != plain[1] and with_image[3] != plain[3]  # the chain carries it on


def test_continuing_a_chain_equals_hashing_the_whole() -> None:
    local, seq = compute_block_hashes(list(range(96)), 16)
    assert compute_sequence_hashes(local[3:], parent=seq[2]) == seq[3:]


@pytest.mark.parametrize("bad", [0, -16])
def test_block_size_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        compute_seq_hashes([1, 2, 3], bad)


def test_ids_outside_u32_are_refused() -> None:
    with pytest.raises((OverflowError, ValueError)):
        compute_seq_hashes([2**32] * 16, 16)


def test_cache_salt_partitions_the_hash_space() -> None:
    tokens = list(range(64))
    plain = compute_seq_hashes(tokens, 16)
    tenant_a = compute_seq_hashes(tokens, 16, cache_salt="tenant-a")
    tenant_b = compute_seq_hashes(tokens, 16, cache_salt="tenant-b")
    assert len({tuple(plain), tuple(tenant_a), tuple(tenant_b)}) == 3
    # No block of one partition names a block of another, not only the first.
    assert not set(plain) & set(tenant_a) and not set(tenant_a) & set(tenant_b)
    # Deterministic, and an empty salt is no salt.
    assert compute_seq_hashes(tokens, 16, cache_salt="tenant-a") == tenant_a
    assert compute_seq_hashes(tokens, 16, cache_salt="") == plain
    # Adapter and salt combine; no split of the same bytes meets another.
    assert hash_seed("a", "b") != hash_seed("ab", None) != hash_seed(None, "ab")
    assert hash_seed("a", "bc") != hash_seed("ab", "c")
    assert hash_seed("a", "b") != hash_seed("a", None)
