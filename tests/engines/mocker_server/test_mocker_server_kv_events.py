"""The mocker-server's KV events: the engine's own wire format on ZMQ, with token ids and
engine-seeded hashes, as a router subscribed to a real vLLM or SGLang receives them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio
from tests.engines.mocker_server.conftest import StartServer

from turnout.engines.mocker_server.kv_events import rank_endpoint
from turnout.engines.mocker_server.metrics import Api
from turnout.protocols.block_hashing import compute_block_hashes
from turnout.protocols.native_kv import (
    NativeBatch,
    NativeRemoved,
    NativeStored,
    decode_native_batch,
    read_seq,
)

BS = 16


class Subscriber:
    """A SUB socket on a server's KV events."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, topic: str = "") -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(endpoint)

    async def next(self, timeout: float = 5.0) -> tuple[int, NativeBatch]:
        if not await self.sock.poll(timeout * 1000):
            pytest.fail("no KV event batch in time")
        _topic, seq, payload = await self.sock.recv_multipart()
        return read_seq(seq), decode_native_batch(payload)

    async def stored(self, timeout: float = 5.0) -> list[NativeStored]:
        """The BlockStored events of the next batch that has any."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, batch = await self.next(deadline - time.monotonic())
            events = [e for e in batch.events if isinstance(e, NativeStored)]
            if events:
                return events
        pytest.fail("no BlockStored in time")


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def subscribe(
    client: httpx.AsyncClient, endpoint: str, ctx: zmq.asyncio.Context, path: str, **kw: Any
) -> Subscriber:
    """A subscriber past ZMQ's slow-joiner window: requests with fresh prompts go out until
    one's events arrive."""
    sub = Subscriber(ctx, endpoint, **kw)
    deadline = time.monotonic() + 10
    probe = 30000
    while time.monotonic() < deadline:
        probe += 1
        await generate(client, path, [probe] * BS, 1)
        if await sub.sock.poll(200):
            while await sub.sock.poll(50):  # drain what the probes published
                await sub.sock.recv_multipart()
            return sub
    pytest.fail("the subscriber never received anything")


async def generate(client: httpx.AsyncClient, path: str, ids: list[int], n: int) -> None:
    if path == "/generate":
        body: dict[str, Any] = {"input_ids": ids, "sampling_params": {"max_new_tokens": n}}
    else:
        body = {"prompt": ids, "max_tokens": n}
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("api", "encoding", "path"),
    [(Api.VLLM, "array", "/v1/completions"), (Api.VLLM, "map", "/v1/completions"),
     (Api.SGLANG, "array", "/generate")],
)  # fmt: skip
async def test_stored_blocks_carry_the_prompts_tokens(
    start_server: StartServer, zctx: zmq.asyncio.Context, api: Api, encoding: str, path: str
) -> None:
    server = await start_server(api, kv_events_endpoint="tcp://127.0.0.1:0",
                                kv_events_encoding=encoding)  # fmt: skip
    endpoint = server.publishers[0].endpoint
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        sub = await subscribe(client, endpoint, zctx, path)
        prompt = list(range(1000, 1040))  # two full blocks and a partial one
        await generate(client, path, prompt, 2)
        events = await sub.stored()
        hashes = [h for e in events for h in e.block_hashes]
        assert [t for e in events for t in e.token_ids] == prompt[: 2 * BS]
        assert all(e.block_size == BS for e in events)
        assert events[0].parent_hash is None and len(hashes) == 2
        # The engine's own hashes: not turnout's (nor recomputable from the tokens alone).
        _, turnout_hashes = compute_block_hashes(prompt, BS)
        assert not set(hashes) & set(turnout_hashes)
        # A prompt that continues it stores only its new block, chained to the last one.
        longer = prompt[: 2 * BS] + list(range(2000, 2000 + BS + 3))
        await generate(client, path, longer, 2)
        (event,) = await sub.stored()
        assert event.token_ids == longer[2 * BS : 3 * BS]
        assert event.parent_hash == hashes[-1]


async def test_evictions_are_published_and_replayed(
    start_server: StartServer, zctx: zmq.asyncio.Context
) -> None:
    server = await start_server(
        Api.VLLM,
        kv_events_endpoint="tcp://127.0.0.1:0",
        kv_events_replay_endpoint="tcp://127.0.0.1:0",
        mocker={"num_gpu_blocks": 8},
    )
    publisher = server.publishers[0]
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        stored: set[Any] = set()
        removed: set[Any] = set()
        for i in range(6):  # 6 prompts of 2 blocks each through an 8-block pool
            await generate(client, "/v1/completions", list(range(i * 100, i * 100 + 2 * BS)), 1)
        # Replay everything from the first batch, as a subscriber that joined late would.
        dealer = zctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint)
        try:
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            seqs = []
            while True:
                assert await dealer.poll(5000), "the replay did not answer"
                _empty, seq, payload = await dealer.recv_multipart()
                if read_seq(seq) == -1:
                    break
                seqs.append(read_seq(seq))
                for event in decode_native_batch(payload).events:
                    if isinstance(event, NativeStored):
                        stored.update(event.block_hashes)
                    elif isinstance(event, NativeRemoved):
                        removed.update(event.block_hashes)
        finally:
            dealer.close(linger=0)
    assert seqs == list(range(len(seqs))) and seqs
    assert len(stored) == 12 and removed and removed <= stored


def test_each_rank_publishes_at_the_port_plus_its_rank() -> None:
    assert rank_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert rank_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert rank_endpoint("tcp://*:5557", 1) == "tcp://*:5558"
    assert rank_endpoint("tcp://127.0.0.1:0", 1) == "tcp://127.0.0.1:0"
