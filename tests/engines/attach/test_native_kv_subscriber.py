"""The subscriber over real ZeroMQ sockets on 127.0.0.1: the mocker-server's publisher (in
every dialect) or a hand-driven socket plays the engine; the router's real indexer is fed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from turnout.engines.attach.native_kv import NativeKvTranslator
from turnout.engines.attach.native_kv_subscriber import NativeKvSubscriber, SubscriberState
from turnout.engines.mocker_server.native_kv import EngineBlockHasher, NativeKvPublisher
from turnout.protocols.block_hashing import compute_seq_hashes
from turnout.protocols.kv import AllBlocksCleared, KvCacheEvent
from turnout.protocols.native_kv import (
    NativeCleared,
    NativeRemoved,
    NativeStored,
    encode_native_batch,
    seq_bytes,
)
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.indexer import KvIndexer

BS = 4
PROMPT = list(range(500, 500 + 5 * BS))
DEADLINE_S = 10.0


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class Worker:
    """One attached worker: its translator, its subscriber and what reached the router."""

    translator: NativeKvTranslator
    subscriber: NativeKvSubscriber
    received: list[KvCacheEvent] = field(default_factory=list)


class Fleet:
    """Engines (publishers or raw sockets) and the subscribers of one router's indexer."""

    def __init__(self) -> None:
        self.indexer = KvIndexer()
        self.workers: list[Worker] = []
        self.publishers: list[NativeKvPublisher] = []

    async def publisher(self, **kw: Any) -> NativeKvPublisher:
        pub = NativeKvPublisher(**kw)
        await pub.start()
        self.publishers.append(pub)
        return pub

    async def subscribe(
        self, endpoint: str, *, worker_id: int, dp_rank: int = 0, **kw: Any
    ) -> Worker:
        translator = NativeKvTranslator(block_size=BS, worker_id=worker_id)
        received: list[KvCacheEvent] = []

        def on_events(events: list[KvCacheEvent]) -> None:
            received.extend(events)
            assert self.indexer.apply_batch(events) == []

        sub = NativeKvSubscriber(
            endpoint, translator=translator, on_events=on_events, dp_rank=dp_rank, **kw
        )
        await sub.start()
        worker = Worker(translator, sub, received)
        self.workers.append(worker)
        return worker

    def matched(self, tokens: list[int]) -> dict[WorkerKey, int]:
        return dict(self.indexer.find_matches(compute_seq_hashes(tokens, BS)).scores)

    async def close(self) -> None:
        for worker in self.workers:
            await worker.subscriber.stop()
        for pub in self.publishers:
            await pub.close()


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = Fleet()
    try:
        yield f
    finally:
        await f.close()


async def joined(pub: NativeKvPublisher, worker: Worker, dp_rank: int = 0) -> None:
    """Publish empty batches until one reaches the subscriber (ZeroMQ's slow joiner: a SUB
    gets nothing published before its subscription reached the PUB)."""
    deadline = time.monotonic() + DEADLINE_S
    seen = worker.subscriber.stats.frames
    while worker.subscriber.stats.frames == seen:
        if time.monotonic() > deadline:
            raise AssertionError("the subscriber never joined")
        pub.publish([], dp_rank)
        await asyncio.sleep(0.02)


def stored(
    hasher: EngineBlockHasher, tokens: list[int], start: int = 0
) -> tuple[NativeStored, list[Any]]:
    hashes = hasher.block_hashes(tokens, BS)
    event = NativeStored(
        block_hashes=hashes[start:],
        parent_hash=hashes[start - 1] if start else None,
        token_ids=tokens[start * BS : len(hashes) * BS],
        block_size=BS,
        medium="GPU",
    )
    return event, hashes


DIALECTS = [
    pytest.param({"api": "vllm", "encoding": "array"}, "int", id="vllm-array-int"),
    pytest.param({"api": "vllm", "encoding": "map"}, "int", id="vllm-map-int"),
    pytest.param({"api": "vllm", "encoding": "array"}, "bytes", id="vllm-array-bytes"),
    pytest.param(
        {"api": "vllm", "encoding": "map", "batch_encoding": "map"}, "bytes", id="vllm-map-bytes"
    ),
    pytest.param({"api": "sglang"}, "int", id="sglang-int"),
]


@pytest.mark.parametrize(("dialect", "hash_type"), DIALECTS)
async def test_prefix_stored_on_a_worker_is_found_then_removed(
    fleet: Fleet, dialect: dict[str, Any], hash_type: Any
) -> None:
    pub_a, pub_b = await fleet.publisher(**dialect), await fleet.publisher(**dialect)
    a = await fleet.subscribe(pub_a.endpoint, worker_id=1, replay_endpoint=pub_a.replay_endpoint)
    b = await fleet.subscribe(pub_b.endpoint, worker_id=2, replay_endpoint=pub_b.replay_endpoint)
    await joined(pub_a, a)
    await joined(pub_b, b)
    hasher_a, hasher_b = (
        EngineBlockHasher(hash_type=hash_type),
        EngineBlockHasher(hash_type=hash_type),
    )
    head, hashes = stored(hasher_a, PROMPT[: 2 * BS])
    pub_a.publish([head])
    pub_a.publish([stored(hasher_a, PROMPT, start=2)[0]])
    pub_b.publish([stored(hasher_b, PROMPT[: 2 * BS] + [1] * (3 * BS))[0]])
    await until(lambda: fleet.matched(PROMPT) == {WorkerKey(1, 0): 5, WorkerKey(2, 0): 2}, "both")

    hashes = hasher_a.block_hashes(PROMPT, BS)
    pub_a.publish([NativeRemoved(block_hashes=hashes[3:], medium="GPU")])
    await until(lambda: fleet.matched(PROMPT)[WorkerKey(1, 0)] == 3, "the removal")
    pub_a.publish([NativeCleared()])
    await until(lambda: fleet.matched(PROMPT) == {WorkerKey(2, 0): 2}, "the clear")
    assert a.subscriber.stats.gaps == 0 and a.subscriber.stats.malformed_frames == 0
    assert a.subscriber.last_event_at is not None


@pytest.mark.parametrize(("dialect", "hash_type"), DIALECTS[::2])
async def test_a_lost_batch_is_replayed(
    fleet: Fleet, dialect: dict[str, Any], hash_type: Any
) -> None:
    pub = await fleet.publisher(**dialect)
    w = await fleet.subscribe(pub.endpoint, worker_id=1, replay_endpoint=pub.replay_endpoint)
    await joined(pub, w)
    hasher = EngineBlockHasher(hash_type=hash_type)
    pub.publish([stored(hasher, PROMPT[: 2 * BS])[0]])
    pub.publish([stored(hasher, PROMPT[: 4 * BS], start=2)[0]], simulate_loss=True)
    pub.publish([stored(hasher, PROMPT, start=4)[0]])
    await until(lambda: fleet.matched(PROMPT) == {WorkerKey(1, 0): 5}, "the replayed blocks")
    stats = w.subscriber.stats
    assert (stats.gaps, stats.replays, stats.resets) == (1, 1, 0)
    assert not any(isinstance(e.data, AllBlocksCleared) for e in w.received)


async def test_a_gap_older_than_the_replay_buffer_clears_the_worker(fleet: Fleet) -> None:
    pub = await fleet.publisher(buffer_steps=2)
    w = await fleet.subscribe(pub.endpoint, worker_id=1, replay_endpoint=pub.replay_endpoint)
    await joined(pub, w)
    hasher = EngineBlockHasher()
    other = [9] * (3 * BS)
    pub.publish([stored(hasher, other)[0]])
    await until(lambda: fleet.matched(other) == {WorkerKey(1, 0): 3}, "the first blocks")
    lost = hasher.block_hashes(other, BS)
    pub.publish([NativeRemoved(block_hashes=lost)], simulate_loss=True)  # leaves the buffer
    pub.publish([], simulate_loss=True)
    pub.publish([], simulate_loss=True)
    pub.publish([stored(hasher, PROMPT)[0]])
    await until(lambda: fleet.matched(PROMPT) == {WorkerKey(1, 0): 5}, "the later blocks")
    assert fleet.matched(other) == {}  # cleared, not left claiming blocks it may have lost
    stats = w.subscriber.stats
    assert (stats.gaps, stats.replay_failures, stats.resets) == (1, 1, 1)
    assert any(isinstance(e.data, AllBlocksCleared) for e in w.received)


async def test_a_gap_without_a_replay_endpoint_clears_the_worker(fleet: Fleet) -> None:
    pub = await fleet.publisher(replay_endpoint=None)
    w = await fleet.subscribe(pub.endpoint, worker_id=1)
    await joined(pub, w)
    hasher = EngineBlockHasher()
    pub.publish([stored(hasher, PROMPT[: 2 * BS])[0]])
    await until(lambda: fleet.matched(PROMPT) == {WorkerKey(1, 0): 2}, "the first blocks")
    pub.publish([], simulate_loss=True)
    pub.publish([stored(hasher, PROMPT, start=2)[0]])  # its parent went with the clear
    await until(lambda: w.subscriber.stats.resets == 1, "the reset")
    assert fleet.matched(PROMPT) == {}
    assert w.translator.stats.unknown_parent_events == 1


async def test_a_restarted_publisher_clears_the_worker(fleet: Fleet) -> None:
    pub = await fleet.publisher()
    w = await fleet.subscribe(pub.endpoint, worker_id=1, replay_endpoint=pub.replay_endpoint)
    await joined(pub, w)
    old = EngineBlockHasher()
    pub.publish([stored(old, PROMPT)[0]])
    for _ in range(5):
        pub.publish([])
    await until(lambda: w.subscriber.stats.batches == pub.next_seq, "the old process's batches")
    assert fleet.matched(PROMPT) == {WorkerKey(1, 0): 5}
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    await pub.close()
    # a new engine process on the same ports: new hash seed, sequence from 0, empty cache
    new_pub = await fleet.publisher(endpoint=endpoint, replay_endpoint=replay)
    other = [3] * (2 * BS)
    new_pub.publish([stored(EngineBlockHasher(), other)[0]])
    await joined(new_pub, w)
    await until(lambda: fleet.matched(other) == {WorkerKey(1, 0): 2}, "the new process's")
    assert fleet.matched(PROMPT) == {}
    assert w.subscriber.stats.resets == 1


async def test_a_reconnection_to_the_same_process_keeps_the_blocks(fleet: Fleet) -> None:
    pub = await fleet.publisher()
    w = await fleet.subscribe(pub.endpoint, worker_id=1, replay_endpoint=pub.replay_endpoint)
    await joined(pub, w)
    hasher = EngineBlockHasher()
    pub.publish([stored(hasher, PROMPT[: 2 * BS])[0]])
    await until(lambda: w.subscriber.stats.batches == pub.next_seq, "the first batches")
    await pub.disconnect_subscribers()
    pub.publish([stored(hasher, PROMPT, start=2)[0]], simulate_loss=True)  # during the blip
    await joined(pub, w)
    await until(lambda: fleet.matched(PROMPT) == {WorkerKey(1, 0): 5}, "the replayed blocks")
    stats = w.subscriber.stats
    assert (stats.disconnects, stats.resets, stats.gaps, stats.replays) == (1, 0, 1, 1)


class RawEngine:
    """A hand-driven PUB socket, for frames no well-behaved publisher sends."""

    def __init__(self) -> None:
        self.context = zmq.asyncio.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        #: The sequence number ``batch`` sends next.
        self.seq = 0

    async def send(self, *frames: bytes) -> None:
        await self.pub.send_multipart(list(frames))

    async def batch(self, events: list[Any], seq: int | None = None) -> None:
        """Send a batch numbered ``seq`` (default: the next); numbering goes on from it."""
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        await self.send(b"", seq_bytes(seq), encode_native_batch(events, ts=0.0))

    def close(self) -> None:
        self.pub.close(linger=0)
        self.context.destroy(linger=0)


@pytest.fixture
async def raw() -> AsyncIterator[RawEngine]:
    engine = RawEngine()
    try:
        yield engine
    finally:
        engine.close()


async def raw_joined(raw: RawEngine, w: Worker) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while w.subscriber.stats.frames == 0:
        if time.monotonic() > deadline:
            raise AssertionError("the subscriber never joined")
        await raw.batch([])
        await asyncio.sleep(0.02)


async def test_malformed_frames_are_logged_and_skipped(
    fleet: Fleet, raw: RawEngine, caplog: pytest.LogCaptureFixture
) -> None:
    w = await fleet.subscribe(raw.endpoint, worker_id=1)
    await raw_joined(raw, w)
    hasher = EngineBlockHasher()
    await raw.send(b"", b"\x00\x01", b"x")  # a 2-byte sequence number
    await raw.send(b"", seq_bytes(raw.seq))  # two frames
    await raw.send(b"", seq_bytes(raw.seq), b"\xc1")  # not msgpack
    await raw.send(b"", seq_bytes(raw.seq + 1), msgspec.msgpack.encode([0, [["BlockStored", 1]]]))
    await raw.batch([stored(hasher, PROMPT)[0]], seq=raw.seq + 2)
    await until(lambda: fleet.matched(PROMPT) == {WorkerKey(1, 0): 5}, "the good batch")
    assert w.subscriber.stats.malformed_frames == 4
    assert w.subscriber.stats.resets == 0  # the sequence stayed whole: nothing was lost
    logged = [r for r in caplog.records if "malformed frame" in r.getMessage()]
    assert len(logged) == 1  # once per kind, then rate-limited


async def test_a_sequence_going_backwards_clears_the_worker(fleet: Fleet, raw: RawEngine) -> None:
    w = await fleet.subscribe(raw.endpoint, worker_id=1)
    await raw_joined(raw, w)
    await raw.batch([stored(EngineBlockHasher(), PROMPT)[0]])
    await until(lambda: fleet.matched(PROMPT) == {WorkerKey(1, 0): 5}, "the blocks")
    await raw.batch([], seq=0)  # a new process, from 0
    await until(lambda: w.subscriber.stats.resets == 1, "the reset")
    assert fleet.matched(PROMPT) == {}


async def test_a_replay_server_that_does_not_answer_is_given_up(
    fleet: Fleet, raw: RawEngine
) -> None:
    silent = raw.context.socket(zmq.ROUTER)  # bound, never served
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:0")
    try:
        w = await fleet.subscribe(
            raw.endpoint,
            worker_id=1,
            replay_endpoint=silent.getsockopt_string(zmq.LAST_ENDPOINT),
            replay_timeout_s=0.2,
        )
        await raw_joined(raw, w)
        await raw.batch([stored(EngineBlockHasher(), PROMPT)[0]], seq=raw.seq + 5)
        await until(lambda: fleet.matched(PROMPT) == {WorkerKey(1, 0): 5}, "the live batch")
        stats = w.subscriber.stats
        assert (stats.gaps, stats.replay_failures, stats.resets) == (1, 1, 1)
    finally:
        silent.close(linger=0)


async def test_dp_rank_and_last_event_time_and_a_prompt_stop(fleet: Fleet) -> None:
    pub = await fleet.publisher()
    now = [100.0]
    w = await fleet.subscribe(
        pub.endpoint, worker_id=1, dp_rank=1, replay_endpoint=pub.replay_endpoint,
        clock=lambda: now[0],
    )  # fmt: skip
    assert w.subscriber.last_event_at is None
    await joined(pub, w, dp_rank=1)
    assert w.subscriber.last_event_at == 100.0
    pub.publish([stored(EngineBlockHasher(), PROMPT)[0]], dp_rank=1)
    await until(lambda: fleet.matched(PROMPT) == {WorkerKey(1, 1): 5}, "rank 1's blocks")
    pub.publish([], dp_rank=0)  # stamped with another rank: indexed as the endpoint's
    await until(lambda: w.subscriber.stats.rank_mismatches == 1, "the mismatch")
    assert w.translator.snapshot(1).next_event_id == 1
    started = time.monotonic()
    await w.subscriber.stop()
    assert time.monotonic() - started < 1.0
    assert w.subscriber.state is SubscriberState.STOPPED
    with pytest.raises(RuntimeError, match="stopped"):
        await w.subscriber.start()


async def test_a_late_subscriber_replays_the_engines_history(fleet: Fleet) -> None:
    pub = await fleet.publisher()
    hasher = EngineBlockHasher()
    pub.publish([stored(hasher, PROMPT[: 3 * BS])[0]])  # before anyone listens
    pub.publish([stored(hasher, PROMPT, start=3)[0]])
    w = await fleet.subscribe(pub.endpoint, worker_id=1, replay_endpoint=pub.replay_endpoint)
    await joined(pub, w)
    await until(lambda: fleet.matched(PROMPT) == {WorkerKey(1, 0): 5}, "the history")
    assert w.subscriber.stats.resets == 0
