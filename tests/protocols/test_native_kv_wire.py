"""Engine KV-event payloads: the engines' own msgspec definitions, re-declared here as each
release wrote them, decode to the same events; our encoder's dialects round-trip.

Sources read (struct options and field order are what matters to the bytes):
vLLM ``vllm/distributed/kv_events.py`` at b4e69e0a (2025: array_like batch ``[ts, events]``,
events array_like, no medium), ``examples/online_serving/kv_events_subscriber.py`` (+ medium),
a 2025 release with ``data_parallel_rank``, ``lora_name`` and ``extra_keys`` (all array_like),
v0.28.0 (events as tagged maps, batch still array_like) and 0181ea31 (batch and events maps);
SGLang ``python/sglang/srt/disaggregation/kv_events.py`` at 006d053f (``[ts, events]``) and
612d5790 (``attn_dp_rank``), and its 2026 ``medium`` + ``BlockStoredWithMetadata``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from turnout.protocols.native_kv import (
    NativeCleared,
    NativeKvDecodeError,
    NativeRemoved,
    NativeStored,
    decode_native_batch,
    encode_native_batch,
    read_seq,
    seq_bytes,
)

TOKENS = [128000, 128006, 9125, 0, 1, 127, 128, 255, 256, 65535, 65536, 128255, 42, 2, 7, 9]
TOP = (1 << 64) - 1  # needs msgpack's uint64


def vllm_2025_early() -> SimpleNamespace:
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]

    class AllBlocksCleared(KVCacheEvent):
        pass

    def stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> Any:
        return BlockStored(hashes, parent, tokens, 16, kw.get("lora_id"))

    return SimpleNamespace(
        batch=lambda events, rank: EventBatch(1.5, events),
        stored=stored,
        removed=lambda hashes, medium="GPU": BlockRemoved(hashes),
        cleared=AllBlocksCleared,
        medium=False,
        rank=False,
        extra=False,
    )


def vllm_2025_medium() -> SimpleNamespace:
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return SimpleNamespace(
        batch=lambda events, rank: EventBatch(1.5, events),
        stored=lambda h, p, t, **kw: BlockStored(h, p, t, 16, None, kw.get("medium", "GPU")),
        removed=lambda hashes, medium="GPU": BlockRemoved(hashes, medium),
        cleared=AllBlocksCleared,
        medium=True,
        rank=False,
        extra=False,
    )


def _vllm_full(*, events_array: bool, batch_array: bool) -> SimpleNamespace:
    """vLLM with DP ranks, lora_name and extra_keys: all array_like (late 2025), events as
    tagged maps (v0.28.0), or batch and events as maps (0181ea31)."""

    class EventBatch(msgspec.Struct, array_like=batch_array, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(
        msgspec.Struct, array_like=events_array, omit_defaults=True, gc=False, tag=True
    ):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    def stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> Any:
        return BlockStored(
            hashes,
            parent,
            tokens,
            16,
            kw.get("lora_id"),
            kw.get("medium", "GPU"),
            kw.get("lora_name"),
            extra_keys=kw.get("extra_keys"),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    return SimpleNamespace(
        batch=lambda events, rank: EventBatch(1.5, events, rank),
        stored=stored,
        removed=lambda hashes, medium="GPU": BlockRemoved(hashes, medium, group_idx=0),
        cleared=AllBlocksCleared,
        medium=True,
        rank=True,
        extra=True,
    )


def sglang(*, rank: bool, medium: bool) -> SimpleNamespace:
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        attn_dp_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[Any]
        block_size: int
        lora_id: int | None
        medium: str | None = None

    class BlockStoredMetadata(msgspec.Struct, array_like=True):
        priority: int
        session: str

    class BlockStoredWithMetadata(BlockStored, tag="BlockStored", kw_only=True):
        metadata: BlockStoredMetadata

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    def stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> Any:
        if medium:
            return BlockStoredWithMetadata(
                hashes, parent, tokens, 16, None, kw.get("medium", "GPU"),
                metadata=BlockStoredMetadata(1, "s"),
            )  # fmt: skip
        return BlockStored(hashes, parent, tokens, 16, None)

    return SimpleNamespace(
        batch=lambda events, r: EventBatch(1.5, events, r) if rank else EventBatch(1.5, events),
        stored=stored,
        removed=lambda hashes, m="GPU": BlockRemoved(hashes, m) if medium else BlockRemoved(hashes),
        cleared=AllBlocksCleared,
        medium=medium,
        rank=rank,
        extra=False,
    )


DIALECTS: dict[str, Callable[[], SimpleNamespace]] = {
    "vllm-2025-early": vllm_2025_early,
    "vllm-2025-medium": vllm_2025_medium,
    "vllm-2025-array": lambda: _vllm_full(events_array=True, batch_array=True),
    "vllm-0.28-map-events": lambda: _vllm_full(events_array=False, batch_array=True),
    "vllm-2026-map-batch": lambda: _vllm_full(events_array=False, batch_array=False),
    "sglang-2025": lambda: sglang(rank=False, medium=False),
    "sglang-dp-rank": lambda: sglang(rank=True, medium=False),
    "sglang-2026-medium-metadata": lambda: sglang(rank=True, medium=True),
}


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_engine_definitions_decode(dialect: str) -> None:
    d = DIALECTS[dialect]()
    parent = -5 if dialect.startswith("sglang") else 0xDEADBEEF12345678  # SGLang: signed i64
    events = [
        d.stored([TOP if not dialect.startswith("sglang") else -1], parent, TOKENS),
        d.removed([7]),
        d.cleared(),
    ]
    payload = msgspec.msgpack.encode(d.batch(events, 3))
    batch = decode_native_batch(payload)

    assert batch.ts == 1.5
    assert batch.dp_rank == (3 if d.rank else None)
    assert batch.num_unknown == 0
    stored, removed, cleared = batch.events
    assert isinstance(stored, NativeStored)
    assert stored.block_hashes == [TOP]  # u64 max, or -1 as i64: the same 64 bits
    assert stored.parent_hash == parent & TOP
    assert stored.token_ids == TOKENS
    assert stored.block_size == 16
    assert stored.medium == ("GPU" if d.medium else None)
    assert stored.lora_name is None and stored.cache_salt is None
    assert stored.first_opaque_block is None
    assert removed == NativeRemoved(
        block_hashes=[7], medium="GPU" if d.medium else None, group_idx=0 if d.extra else None
    )
    assert isinstance(cleared, NativeCleared)


def test_bytes_hashes_and_lora_and_salt_in_extra_keys() -> None:
    d = _vllm_full(events_array=False, batch_array=True)
    digest = bytes(range(32))
    event = d.stored(
        [digest, bytes(range(1, 33))],
        None,
        TOKENS * 2,
        lora_id=3,
        lora_name="adapter",
        extra_keys=[("adapter", "tenant-a"), ("adapter",)],
    )
    batch = decode_native_batch(msgspec.msgpack.encode(d.batch([event], 0)))
    (stored,) = batch.events
    assert isinstance(stored, NativeStored)
    assert stored.block_hashes == [digest, bytes(range(1, 33))]
    assert (stored.lora_name, stored.lora_id, stored.cache_salt) == ("adapter", 3, "tenant-a")
    assert stored.first_opaque_block is None


@pytest.mark.parametrize(
    ("extra_keys", "parent", "salt", "opaque"),
    [
        ([("salt-1",), None], None, "salt-1", None),
        ([("salt-1",)], 5, None, 0),  # a salt is only on a chain's first block
        ([None, (("mm-id", 0),)], None, None, 1),  # a multimodal item in block 1
        ([(("mm-id", 3), "salt-2")], None, "salt-2", 0),  # salt and a multimodal item
        ([(b"embeds",), None], None, None, 0),  # prompt embeddings
        ([(4, "salt-3")], None, "salt-3", None),  # an older vLLM: the LoRA int id first
        ([None, None], None, None, None),
    ],
)
def test_extra_keys(
    extra_keys: list[Any], parent: int | None, salt: str | None, opaque: int | None
) -> None:
    lora_id = 4 if extra_keys and extra_keys[0] and extra_keys[0][0] == 4 else None
    event = [
        "BlockStored", [1] * len(extra_keys), parent, TOKENS * len(extra_keys), 16, lora_id,
        "GPU", None, extra_keys,
    ]  # fmt: skip
    (stored,) = decode_native_batch(msgspec.msgpack.encode([0.0, [event], 0])).events
    assert isinstance(stored, NativeStored)
    assert (stored.cache_salt, stored.first_opaque_block) == (salt, opaque)


def test_sglang_bigram_pairs_and_unknown_events_and_extra_fields() -> None:
    pairs = [[t, t + 1] for t in TOKENS]
    payload = msgspec.msgpack.encode(
        {
            "ts": 2,
            "attn_dp_rank": 1,
            "future": "ignored",
            "events": [
                ["BlockStored", [1], None, pairs, 16, None, "GPU", {"metadata": 1}],
                {"type": "BlockPinned", "block_hashes": [1]},
                ["BlockRemoved", [1], "CPU_PINNED", None, "more", "fields"],
                {"type": "AllBlocksCleared", "extra": 1},
            ],
        }
    )
    batch = decode_native_batch(payload)
    assert batch.dp_rank == 1 and batch.num_unknown == 1
    stored, removed, cleared = batch.events
    assert isinstance(stored, NativeStored) and stored.token_ids == TOKENS
    assert stored.lora_name is None  # SGLang's metadata sits where vLLM has lora_name
    assert removed == NativeRemoved(block_hashes=[1], medium="CPU_PINNED")
    assert isinstance(cleared, NativeCleared)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "not msgpack"),
        (msgspec.msgpack.encode("batch"), "expected array or map"),
        (msgspec.msgpack.encode([1.0]), "expected >= 2"),
        (msgspec.msgpack.encode({"ts": 1.0}), "no 'events'"),
        (msgspec.msgpack.encode(["x", []]), "ts"),
        (msgspec.msgpack.encode([1.0, {}]), "events"),
        (msgspec.msgpack.encode([1.0, [], "r"]), "dp rank"),
        (msgspec.msgpack.encode([1.0, [5]]), "event 0"),
        (msgspec.msgpack.encode([1.0, [[7, 1]]]), "string tag"),
        (msgspec.msgpack.encode([1.0, [{"kind": "BlockStored"}]]), "'type'"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [1.5], None, [], 16]]]), "block hash"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [b""], None, [], 16]]]), "block hash"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", 1, None, [], 16]]]), "block_hashes"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [], 0]]]), "block_size"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [True], 16]]]), "token id"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, "abc", 16]]]), "token_ids"),
        (msgspec.msgpack.encode([1.0, [["BlockRemoved", None]]]), "block_hashes"),
    ],
)
def test_malformed_payloads_name_the_fault(payload: bytes, message: str) -> None:
    with pytest.raises(NativeKvDecodeError, match=message):
        decode_native_batch(payload)


def _events(hashes: list[Any]) -> list[Any]:
    return [
        NativeStored(
            block_hashes=hashes[:2],
            parent_hash=None,
            token_ids=TOKENS * 2,
            block_size=16,
            lora_name="lora-x",
            lora_id=2,
            medium="GPU",
            cache_salt="salty",
            group_idx=0,
        ),
        NativeStored(
            block_hashes=hashes[2:3], parent_hash=hashes[1], token_ids=TOKENS, block_size=16
        ),
        NativeRemoved(block_hashes=hashes[:1], medium="GPU"),
        NativeCleared(),
    ]


@pytest.mark.parametrize("encoding", ["array", "map"])
@pytest.mark.parametrize("batch_encoding", ["array", "map"])
@pytest.mark.parametrize("hashes", [[1, TOP, 3], [b"\x01" * 32, b"\x02" * 32, b"\x03" * 32]])
def test_vllm_dialects_round_trip(encoding: Any, batch_encoding: Any, hashes: list[Any]) -> None:
    events = _events(hashes)
    payload = encode_native_batch(
        events, ts=3.0, dp_rank=2, encoding=encoding, batch_encoding=batch_encoding
    )
    batch = decode_native_batch(payload)
    assert (batch.ts, batch.dp_rank) == (3.0, 2)
    assert batch.events == events


def test_sglang_dialect_splits_blocks_and_signs_hashes() -> None:
    events = _events([1, TOP, 3])
    batch = decode_native_batch(encode_native_batch(events, ts=1.0, dp_rank=1, api="sglang"))
    raw = msgspec.msgpack.decode(encode_native_batch(events, ts=1.0, api="sglang"))
    assert raw[1][1][1] == [-1]  # u64 max travels as the i64 -1, as SGLang writes it
    first, second, third = batch.events[:3]
    assert first == NativeStored(
        block_hashes=[1], parent_hash=None, token_ids=TOKENS, block_size=16, medium="GPU"
    )  # no LoRA name nor salt: SGLang does not send them
    assert isinstance(second, NativeStored) and second.parent_hash == 1
    assert second.block_hashes == [TOP]
    assert isinstance(third, NativeStored) and third.parent_hash == TOP
    assert batch.events[3:] == [NativeRemoved(block_hashes=[1], medium="GPU"), NativeCleared()]
    with pytest.raises(ValueError, match="tagged arrays"):
        encode_native_batch(events, ts=1.0, api="sglang", encoding="map")
    with pytest.raises(ValueError, match="int block hashes"):
        encode_native_batch(_events([b"a", b"b", b"c"]), ts=1.0, api="sglang")


def test_sequence_frames() -> None:
    assert read_seq(seq_bytes(5)) == 5
    assert read_seq(seq_bytes(2**63 + 1)) == 2**63 + 1
    assert read_seq(b"\xff" * 8) == -1  # the replay end marker
    with pytest.raises(ValueError, match="8"):
        read_seq(b"\x00")
