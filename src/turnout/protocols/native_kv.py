"""The KV events vLLM and SGLang publish themselves (``--kv-events-config``), both directions.

turnout's own KV events (``protocols.kv``) name blocks by turnout's hashes; a stock engine's
events name them by the engine's hashes, which are seeded per process and cannot be recomputed
elsewhere. This module is only the engines' wire format: decoded into ``NativeStored`` /
``NativeRemoved`` / ``NativeCleared`` for ``engines.attach`` (which rehashes the tokens the
turnout way) and encoded from them for ``engines.mocker_server`` (which imitates an engine).
Both ends import it from here because neither engine package may import the other.

Transport (vLLM ``vllm/distributed/kv_events.py`` ``ZmqEventPublisher``; SGLang's copy in
``python/sglang/srt/disaggregation/kv_events.py`` is the same)::

    PUB      multipart [topic (utf-8, vLLM's default ""), seq (u64 big-endian), payload]
             seq counts batches from 0 in each engine process, one publisher per DP rank
             (its port is the configured port + rank)
    ROUTER   replay: the client sends [b"", start (8 bytes big-endian)]; the server answers
             [b"", seq, payload] for every buffered batch with seq >= start (the buffer keeps
             ``buffer_steps`` = 10,000 batches), then the end marker [b"", -1 as i64, b""]

Payload: one msgpack ``EventBatch``. Every encoding in use since 2025 is accepted:

* the batch as an array ``[ts, events]`` (vLLM before DP ranks, SGLang before
  ``attn_dp_rank``), ``[ts, events, dp_rank]`` (msgspec writes every field of an
  ``array_like`` struct, so a missing rank is a trailing nil) or a map
  ``{"ts", "events", "data_parallel_rank" | "attn_dp_rank"}``;
* an event as a tagged array ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...]`` (msgspec's
  ``array_like`` + ``tag=True``: the tag is the class name, first; older engines stop after
  ``lora_id`` or ``medium``, SGLang puts an unrelated ``metadata`` after ``medium``) or a
  tagged map ``{"type": "BlockStored", "block_hashes": ..., ...}`` (vLLM 2026: ``tag=True``
  without ``array_like``; ``omit_defaults`` drops optional fields left at their default);
  ``BlockRemoved`` is ``block_hashes, medium, group_idx``, ``AllBlocksCleared`` has no field;
* a block hash as an int (vLLM's default: the digest's low 64 bits, unsigned; SGLang: the
  first 8 bytes of a SHA-256 as a *signed* i64, often negative) or bytes (vLLM with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: the whole digest). Ints are normalised to u64, so
  a hash reads the same whichever sign it was written with;
* token ids as ints, or SGLang's EAGLE bigram pairs ``[t_i, t_i+1]`` (the block's own token is
  the pair's first);
* unknown keys and trailing fields ignored, missing optional ones defaulted, an event of an
  unknown type skipped and counted (``NativeBatch.num_unknown``).

``extra_keys`` (vLLM, one entry per block, None or a tuple) holds what else the engine's hash
covers, in this order: the LoRA adapter's name (an int id before 2026), multimodal items
(``(identifier, offset)`` pairs; bare strings in older releases), the request's cache salt
(first block of a request only) and prompt-embedding digests (bytes). The decoder reads the
cache salt off the first block of a chain (``parent_block_hash`` None) and marks the first
block whose hash covers anything turnout cannot rehash (``first_opaque_block``). An older
engine's lone multimodal string on a first block reads as a salt: those blocks then match no
request, which loses a cache hit but never claims one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypeAlias, TypeGuard

import msgspec

#: An engine's block hash: an int (u64 once decoded) or the raw digest.
EngineBlockHash: TypeAlias = int | bytes

_U64 = (1 << 64) - 1
_I64_TOP = 1 << 63

#: The replay server's end marker (vLLM ``ZmqEventPublisher.END_SEQ``): -1 as a signed i64.
REPLAY_END_SEQ = (-1).to_bytes(8, "big", signed=True)


def is_gpu_medium(medium: str | None) -> bool:
    """Whether an event's ``medium`` is GPU memory (None: an engine too old to say, which
    caches on GPU only); a CPU, disk or remote tier does not serve a prefill."""
    return medium is None or medium.upper() == "GPU"


class NativeKvDecodeError(ValueError):
    """A payload that is not an engine KV event batch (what is wrong is in the message)."""


class NativeStored(msgspec.Struct, kw_only=True):
    """Blocks an engine cached, in prefix order; the first one's parent is ``parent_hash``
    (None: the first block of a request's chain)."""

    block_hashes: list[EngineBlockHash]
    parent_hash: EngineBlockHash | None
    #: The tokens of every block, ``block_size`` each, in order.
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    #: The engine's LoRA int id (vLLM keeps it for compatibility; the name is what hashes).
    lora_id: int | None = None
    medium: str | None = None
    #: The request's cache salt, when the engine says it (vLLM's first block's extra keys).
    cache_salt: str | None = None
    #: Index of the first block whose engine hash covers inputs turnout cannot rehash
    #: (multimodal items, prompt embeddings): it and every later block are not indexed.
    first_opaque_block: int | None = None
    #: vLLM's KV cache group (hybrid models); None when the engine does not say.
    group_idx: int | None = None


class NativeRemoved(msgspec.Struct, kw_only=True):
    """Blocks an engine evicted."""

    block_hashes: list[EngineBlockHash]
    medium: str | None = None
    group_idx: int | None = None


class NativeCleared(msgspec.Struct, kw_only=True):
    """The engine dropped its whole prefix cache (``reset_prefix_cache``, start-up)."""


NativeEvent: TypeAlias = NativeStored | NativeRemoved | NativeCleared


class NativeBatch(msgspec.Struct, kw_only=True):
    """One decoded payload: the engine's events of one step, in order."""

    ts: float
    events: list[NativeEvent]
    #: The rank the engine stamped (vLLM ``data_parallel_rank``, SGLang ``attn_dp_rank``).
    dp_rank: int | None = None
    #: Events of a type this decoder does not know, skipped.
    num_unknown: int = 0


# ---- decoding ------------------------------------------------------------------------------

_decode_msgpack = msgspec.msgpack.Decoder().decode

#: Positions in a tagged array (index 0 is the tag).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def decode_native_batch(payload: bytes) -> NativeBatch:
    """Decode one engine payload (any encoding in the module docstring); raises
    ``NativeKvDecodeError`` naming what is malformed."""
    try:
        raw = _decode_msgpack(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise NativeKvDecodeError(f"not msgpack: {exc}") from exc
    if isinstance(raw, list):
        if len(raw) < 2:
            raise NativeKvDecodeError(f"batch array has {len(raw)} fields, expected >= 2")
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "events" not in raw:
            raise NativeKvDecodeError("batch map has no 'events'")
        ts, events = raw.get("ts", 0.0), raw["events"]
        rank = raw.get("data_parallel_rank", raw.get("attn_dp_rank"))
    else:
        raise NativeKvDecodeError(f"batch is a {type(raw).__name__}, expected array or map")
    if not _is_number(ts):
        raise NativeKvDecodeError(f"batch ts is a {type(ts).__name__}")
    if not isinstance(events, list):
        raise NativeKvDecodeError(f"batch events is a {type(events).__name__}, expected array")
    if rank is not None and not _is_int(rank):
        raise NativeKvDecodeError(f"batch dp rank is a {type(rank).__name__}")
    out: list[NativeEvent] = []
    unknown = 0
    for i, raw_event in enumerate(events):
        try:
            event = _decode_event(raw_event)
        except NativeKvDecodeError as exc:
            raise NativeKvDecodeError(f"event {i}: {exc}") from None
        if event is None:
            unknown += 1
        else:
            out.append(event)
    return NativeBatch(ts=float(ts), events=out, dp_rank=rank, num_unknown=unknown)


def _decode_event(raw: Any) -> NativeEvent | None:
    """One event, or None when its type is unknown (a newer engine's)."""
    fields: dict[str, Any]
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise NativeKvDecodeError("tagged array without a string tag")
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, raw[1:], strict=False))
    elif isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise NativeKvDecodeError("tagged map without a string 'type'")
        tag, fields = kind, raw
    else:
        raise NativeKvDecodeError(f"event is a {type(raw).__name__}, expected array or map")
    if tag == "BlockStored":
        return _decode_stored(fields)
    if tag == "BlockRemoved":
        return NativeRemoved(
            block_hashes=_hashes(fields.get("block_hashes")),
            medium=_opt_str(fields.get("medium")),
            group_idx=_opt_int(fields.get("group_idx")),
        )
    if tag == "AllBlocksCleared":
        return NativeCleared()
    return None


def _decode_stored(fields: dict[str, Any]) -> NativeStored:
    hashes = _hashes(fields.get("block_hashes"))
    parent_raw = fields.get("parent_block_hash")
    parent = None if parent_raw is None else _hash(parent_raw)
    block_size = fields.get("block_size")
    if not _is_int(block_size) or block_size <= 0:
        raise NativeKvDecodeError(f"block_size {block_size!r} is not a positive int")
    raw_lora = fields.get("lora_name")
    lora_name = raw_lora if isinstance(raw_lora, str) else None  # SGLang: metadata here
    lora_id = _opt_int(fields.get("lora_id"))
    salt, opaque = _read_extra_keys(fields.get("extra_keys"), parent is None, lora_name, lora_id)
    return NativeStored(
        block_hashes=hashes,
        parent_hash=parent,
        token_ids=_tokens(fields.get("token_ids")),
        block_size=block_size,
        lora_name=lora_name,
        lora_id=lora_id,
        medium=_opt_str(fields.get("medium")),
        cache_salt=salt,
        first_opaque_block=opaque,
        group_idx=_opt_int(fields.get("group_idx")),
    )


def _read_extra_keys(
    extra_keys: Any, starts_chain: bool, lora_name: str | None, lora_id: int | None
) -> tuple[str | None, int | None]:
    """(cache salt, index of the first opaque block) from vLLM's per-block extra keys."""
    if not isinstance(extra_keys, list):
        return None, None  # absent, or not the shape anyone documents: nothing extra
    salt: str | None = None
    for i, keys in enumerate(extra_keys):
        if keys is None:
            continue
        items = list(keys) if isinstance(keys, list | tuple) else [keys]
        if items and (
            (lora_name is not None and items[0] == lora_name)
            or (lora_id is not None and _is_int(items[0]) and items[0] == lora_id)
        ):
            items = items[1:]
        if i == 0 and starts_chain and items and isinstance(items[-1], str):
            salt = items.pop()
        if items:
            return salt, i
    return salt, None


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _opt_int(value: Any) -> int | None:
    return value if _is_int(value) else None


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _hash(value: Any) -> EngineBlockHash:
    if _is_int(value):
        return int(value) & _U64  # a negative i64 (SGLang) and its u64 are one hash
    if isinstance(value, bytes) and value:
        return value
    raise NativeKvDecodeError(f"block hash {value!r:.40} is not an int or bytes")


def _hashes(value: Any) -> list[EngineBlockHash]:
    if not isinstance(value, list):
        raise NativeKvDecodeError(f"block_hashes is a {type(value).__name__}, expected array")
    return [_hash(h) for h in value]


def _tokens(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise NativeKvDecodeError(f"token_ids is a {type(value).__name__}, expected array")
    if all(type(t) is int for t in value):
        return value
    out: list[int] = []
    for t in value:
        if isinstance(t, list) and t and _is_int(t[0]):
            t = t[0]  # SGLang EAGLE bigram pair: (this token, the next)
        if not _is_int(t):
            raise NativeKvDecodeError(f"token id {t!r:.40} is not an int")
        out.append(t)
    return out


# ---- encoding ------------------------------------------------------------------------------

NativeApi: TypeAlias = Literal["vllm", "sglang"]
NativeEncoding: TypeAlias = Literal["array", "map"]

_encode_msgpack = msgspec.msgpack.Encoder().encode


def encode_native_batch(
    events: Sequence[NativeEvent],
    *,
    ts: float,
    dp_rank: int | None = 0,
    api: NativeApi = "vllm",
    encoding: NativeEncoding = "array",
    batch_encoding: NativeEncoding = "array",
) -> bytes:
    """One payload as the engine named by ``api`` writes it.

    ``vllm``: events as tagged arrays (``encoding="array"``, up to 2025) or tagged maps
    (``"map"``, 2026), the batch as ``[ts, events, data_parallel_rank]`` or, with
    ``batch_encoding="map"``, a map; per-block ``extra_keys`` carry the LoRA name and the
    cache salt as vLLM's ``generate_block_hash_extra_keys`` does. ``sglang``: tagged arrays
    only, one ``BlockStored`` / ``BlockRemoved`` per block (as SGLang's radix cache records
    them), int hashes written as signed i64, no LoRA name nor extra keys, the batch as
    ``[ts, events, attn_dp_rank]``.
    """
    if api == "sglang":
        if encoding != "array" or batch_encoding != "array":
            raise ValueError("SGLang writes only tagged arrays (array_like structs)")
        body = [e for event in events for e in _sglang_events(event)]
        return _encode_msgpack([ts, body, dp_rank])
    if api != "vllm":
        raise ValueError(f"unknown engine api {api!r}")
    as_map = encoding == "map"
    body = [_vllm_event(event, as_map) for event in events]
    if batch_encoding == "map":
        batch: dict[str, Any] = {"ts": ts, "events": body}
        if dp_rank is not None:
            batch["data_parallel_rank"] = dp_rank
        return _encode_msgpack(batch)
    return _encode_msgpack([ts, body, dp_rank])


def _vllm_extra_keys(event: NativeStored) -> list[tuple[Any, ...] | None] | None:
    """vLLM's ``extra_keys``: per block, the LoRA name, then the salt on a chain's first."""
    if not event.block_hashes:
        return None
    out: list[tuple[Any, ...] | None] = []
    for i in range(len(event.block_hashes)):
        keys: list[Any] = [event.lora_name] if event.lora_name else []
        if i == 0 and event.parent_hash is None and event.cache_salt:
            keys.append(event.cache_salt)
        out.append(tuple(keys) if keys else None)
    return out


def _vllm_event(event: NativeEvent, as_map: bool) -> Any:
    if isinstance(event, NativeStored):
        values: list[Any] = [
            event.block_hashes,
            event.parent_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            _vllm_extra_keys(event),
            event.group_idx,
        ]
        if not as_map:
            return ["BlockStored", *values]
        out = {"type": "BlockStored", **dict(zip(_STORED_FIELDS, values, strict=True))}
        for optional in ("extra_keys", "group_idx"):  # omit_defaults drops these when None
            if out[optional] is None:
                del out[optional]
        return out
    if isinstance(event, NativeRemoved):
        if not as_map:
            return ["BlockRemoved", event.block_hashes, event.medium, event.group_idx]
        removed: dict[str, Any] = {
            "type": "BlockRemoved",
            "block_hashes": event.block_hashes,
            "medium": event.medium,
        }
        if event.group_idx is not None:
            removed["group_idx"] = event.group_idx
        return removed
    return ["AllBlocksCleared"] if not as_map else {"type": "AllBlocksCleared"}


def _to_i64(h: EngineBlockHash) -> int:
    if not isinstance(h, int):
        raise ValueError("SGLang publishes int block hashes only")
    h &= _U64
    return h - (1 << 64) if h >= _I64_TOP else h


def _sglang_events(event: NativeEvent) -> list[list[Any]]:
    if isinstance(event, NativeStored):
        out: list[list[Any]] = []
        parent = None if event.parent_hash is None else _to_i64(event.parent_hash)
        bs = event.block_size
        for i, h in enumerate(event.block_hashes):
            block = _to_i64(h)
            tokens = event.token_ids[i * bs : (i + 1) * bs]
            out.append(["BlockStored", [block], parent, tokens, len(tokens), None, event.medium])
            parent = block
        return out
    if isinstance(event, NativeRemoved):
        return [["BlockRemoved", [_to_i64(h)], event.medium] for h in event.block_hashes]
    return [["AllBlocksCleared"]]


def seq_bytes(seq: int) -> bytes:
    """A batch sequence number as the PUB and replay frames carry it."""
    return seq.to_bytes(8, "big")


def read_seq(frame: bytes) -> int:
    """A sequence frame's number (-1 for the replay end marker); ValueError unless 8 bytes."""
    if len(frame) != 8:
        raise ValueError(f"sequence frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=frame == REPLAY_END_SEQ)
