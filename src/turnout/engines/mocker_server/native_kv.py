"""The mocker-server's KV events, published as vLLM or SGLang publish theirs.

Same sockets, frames and replay protocol as vLLM's ``ZmqEventPublisher`` (see
``protocols.native_kv``): a PUB socket sending ``[topic, seq, payload]`` and a ROUTER socket
answering replay requests from a bounded buffer of the last ``buffer_steps`` batches. The
payload is written by ``encode_native_batch`` in the encoding asked for, so one simulated
fleet can speak every dialect a consumer must read.

Engine block hashes come from ``EngineBlockHasher``: SHA-256 over the parent's hash, the
block's tokens and its extra keys, from a random per-process root, like vLLM's ``sha256``
prefix-caching hash. They are deliberately unlike turnout's hashes, so a consumer that indexes
them as they are (instead of rehashing the tokens) finds nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

import zmq
import zmq.asyncio

from turnout.protocols.native_kv import (
    REPLAY_END_SEQ,
    EngineBlockHash,
    NativeApi,
    NativeEncoding,
    NativeEvent,
    encode_native_batch,
    seq_bytes,
)

log = logging.getLogger(__name__)

HashType = Literal["int", "bytes"]

_U64 = (1 << 64) - 1


@functools.cache
def _block_packer(block_size: int) -> struct.Struct:
    """Little-endian u32 tokens of one block."""
    return struct.Struct(f"<{block_size}I")


class EngineBlockHasher:
    """An engine's own block hashes: chained SHA-256 from a random root (per instance, as an
    engine's is per process), exposed as vLLM exposes them: the low 64 bits as an int
    (``hash_type="int"``, vLLM's default) or the whole 32-byte digest (``"bytes"``)."""

    __slots__ = ("_hash_type", "_root")

    def __init__(self, *, hash_type: HashType = "int", seed: bytes | None = None) -> None:
        if hash_type not in ("int", "bytes"):
            raise ValueError(f"hash_type must be 'int' or 'bytes', got {hash_type!r}")
        self._hash_type = hash_type
        self._root = seed if seed is not None else os.urandom(32)

    @property
    def hash_type(self) -> HashType:
        return self._hash_type

    def block_hashes(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        parent: EngineBlockHash | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[EngineBlockHash]:
        """Hashes of the full blocks of ``token_ids``, chained from ``parent`` (None: these
        blocks start a request; the salt then joins the first block, as in vLLM)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        prev = self._root if parent is None else _hash_bytes(parent)
        out: list[EngineBlockHash] = []
        for b in range(len(token_ids) // block_size):
            h = hashlib.sha256(prev)
            h.update(
                _block_packer(block_size).pack(*token_ids[b * block_size : (b + 1) * block_size])
            )
            extra = [lora_name or ""]
            if b == 0 and parent is None and cache_salt:
                extra.append(cache_salt)
            h.update("\x00".join(extra).encode())
            digest = h.digest()
            value: EngineBlockHash = (
                int.from_bytes(digest, "big") & _U64 if self._hash_type == "int" else digest
            )
            out.append(value)
            prev = _hash_bytes(value)
        return out


def _hash_bytes(h: EngineBlockHash) -> bytes:
    return h if isinstance(h, bytes) else (h & _U64).to_bytes(8, "big")


class NativeKvPublisher:
    """PUB + ROUTER replay sockets speaking an engine's KV-event wire format (one publisher per
    data-parallel rank, as engines run them).

    ``endpoint`` / ``replay_endpoint`` are bound (``tcp://127.0.0.1:0`` picks a free port; the
    bound addresses are ``endpoint`` / ``replay_endpoint`` after ``start``; a None replay
    endpoint serves no replay). ``api``, ``encoding`` and ``batch_encoding`` choose the
    dialect (``encode_native_batch``).
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str | None = "tcp://127.0.0.1:0",
        *,
        api: NativeApi = "vllm",
        encoding: NativeEncoding = "array",
        batch_encoding: NativeEncoding = "array",
        topic: str = "",
        buffer_steps: int = 10_000,
        sndhwm: int = 100_000,
        clock: Callable[[], float] = time.time,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if buffer_steps <= 0:
            raise ValueError(f"buffer_steps must be positive, got {buffer_steps}")
        encode_native_batch([], ts=0.0, api=api, encoding=encoding, batch_encoding=batch_encoding)
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._api: NativeApi = api
        self._encoding: NativeEncoding = encoding
        self._batch_encoding: NativeEncoding = batch_encoding
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._sndhwm = sndhwm
        self._clock = clock
        self._own_context = context is None
        self._context = context
        self._pub: zmq.asyncio.Socket | None = None
        self._pub_sync: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._next_seq = 0
        self._closed = False
        self._warned = False

    @property
    def endpoint(self) -> str:
        """The PUB address (the bound one once started)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._replay_endpoint

    @property
    def next_seq(self) -> int:
        return self._next_seq

    async def start(self) -> None:
        """Bind the sockets and start answering replay requests."""
        if self._pub is not None or self._closed:
            raise RuntimeError("a publisher starts once")
        if self._context is None:
            self._context = zmq.asyncio.Context()
        pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self._sndhwm)
        pub.bind(self._endpoint)
        self._pub = pub
        # A synchronous view of the same socket: a non-blocking send that drops, not a future.
        self._pub_sync = zmq.Socket.shadow(pub.underlying)
        self._endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self._replay_endpoint is not None:
            router = self._context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self._replay_endpoint)
            self._router = router
            self._replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_task = asyncio.create_task(self._serve_replay(), name="native-kv-replay")

    def publish(
        self, events: Sequence[NativeEvent], dp_rank: int = 0, *, simulate_loss: bool = False
    ) -> int:
        """Send one batch (an engine step's events); returns its sequence number.

        ``simulate_loss`` (for tests): buffer the batch for replay but do not send it, so a
        subscriber sees a gap, as when the network or a full queue drops a message.
        """
        if self._pub_sync is None or self._closed:
            raise RuntimeError("publish on a publisher that is not started, or closed")
        payload = encode_native_batch(
            events,
            ts=self._clock(),
            dp_rank=dp_rank,
            api=self._api,
            encoding=self._encoding,
            batch_encoding=self._batch_encoding,
        )
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        if not simulate_loss:
            # A subscriber whose queue is full loses the batch: it sees a gap and replays.
            with contextlib.suppress(zmq.Again):
                self._pub_sync.send_multipart([self._topic, seq_bytes(seq), payload], zmq.NOBLOCK)
        return seq

    async def disconnect_subscribers(self, timeout_s: float = 5.0) -> None:
        """Drop every subscriber's connection and listen again on the same address, the
        process and its sequence unchanged (for tests: a network blip)."""
        pub = self._pub_sync
        if pub is None or self._closed:
            raise RuntimeError("disconnect on a publisher that is not started, or closed")
        pub.unbind(self._endpoint)
        deadline = time.monotonic() + timeout_s
        while True:  # the old listener closes in ZeroMQ's I/O thread, shortly
            try:
                pub.bind(self._endpoint)
                return
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.01)

    async def close(self) -> None:
        """Close both sockets at once (linger 0) and stop answering replays."""
        if self._closed:
            return
        self._closed = True
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # a cancellation of close() itself still propagates
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        self._pub_sync = None
        if self._own_context and self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            try:
                await self._answer_replay(router, frames)
            except zmq.ZMQError as exc:  # one client's trouble; the next one is served
                log.warning("native KV publisher: answering a replay failed: %s", exc)

    async def _answer_replay(self, router: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        """Stream the buffered batches from the requested sequence number, then the end
        marker; a request not shaped ``[identity, b"", start]`` is logged once and ignored."""
        if len(frames) != 3 or len(frames[2]) != 8:
            if not self._warned:
                self._warned = True
                log.warning("native KV publisher: invalid replay request (%d frames)", len(frames))
            return
        client, _empty, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):  # a copy: publish may run meanwhile
            if seq >= start:
                await router.send_multipart([client, b"", seq_bytes(seq), payload])
        await router.send_multipart([client, b"", REPLAY_END_SEQ, b""])
