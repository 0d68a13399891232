"""The mocker's two roles of disaggregated serving, engine to engine (no network: the
transport below calls the other engine's ``serve_kv_transfer`` directly; the request-plane
path is covered by tests/engines/test_kv_transfer_workers.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from tests.engines.mocker.test_mocker_engine import FakeClock, RecordingSink, fast, req

from turnout.engines.mocker import MockerConfig, MockerEngine, Scheduler
from turnout.errors import ConfigError
from turnout.protocols.disagg import (
    DisaggParams,
    KvHandle,
    KvTransferMode,
    KvTransferOp,
    KvTransferReply,
    KvTransferRequest,
    PrefillParams,
)
from turnout.protocols.kv import BlockStored
from turnout.protocols.llm import ErrorKind, FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import EndpointId, ModelType, WorkerRole
from turnout.runtime.context import RequestContext

PREFILL_EP = EndpointId(namespace="t", component="prefill", name="generate")
DECODE_EP = EndpointId(namespace="t", component="backend", name="generate")
PROMPT = list(range(100, 300))  # 200 tokens: 12 full blocks of 16, and a tail of 8


class LocalTransport:
    """Engines of one test, by instance id; counts the calls."""

    def __init__(self) -> None:
        self.engines: dict[int, MockerEngine] = {}
        self.calls: list[str] = []

    def add(self, engine: MockerEngine, instance_id: int, endpoint: EndpointId) -> MockerEngine:
        engine.set_worker_id(instance_id)
        engine.bind_kv_transport(self, endpoint)
        self.engines[instance_id] = engine
        return engine

    async def pull(self, handle: KvHandle) -> KvTransferReply:
        self.calls.append("pull")
        source = self.engines[handle.instance_id]
        request = KvTransferRequest(op=KvTransferOp.PULL, handle_id=handle.handle_id)
        return await source.serve_kv_transfer(request)

    async def push(
        self, endpoint: EndpointId, instance_id: int, handle: KvHandle
    ) -> KvTransferReply:
        self.calls.append("push")
        request = KvTransferRequest(op=KvTransferOp.PUSH, handle_id=handle.handle_id, handle=handle)
        return await self.engines[instance_id].serve_kv_transfer(request)


def prefill_stage(push_to: int | None = None) -> PreprocessedRequest:
    return msgspec.structs.replace(
        req(PROMPT, max_tokens=1),
        disagg=DisaggParams(
            prefill=PrefillParams(
                push_to=push_to, push_endpoint=DECODE_EP if push_to is not None else None
            )
        ),
    )


def decode_stage(first: list[int], handle: KvHandle, max_tokens: int = 9) -> PreprocessedRequest:
    return msgspec.structs.replace(
        req(PROMPT, max_tokens=max_tokens).continued(first), disagg=DisaggParams(handle=handle)
    )


async def run(engine: MockerEngine, request: PreprocessedRequest) -> list[LLMEngineOutput]:
    return [out async for out in engine.generate(request, RequestContext())]


def pair(
    engines: list[MockerEngine], **prefill_changes: Any
) -> tuple[LocalTransport, MockerEngine, MockerEngine, RecordingSink]:
    transport = LocalTransport()
    decode_sink = RecordingSink()
    prefill = transport.add(MockerEngine(fast(role="prefill", **prefill_changes)), 0x1, PREFILL_EP)
    decode = transport.add(MockerEngine(fast(role="decode"), sink=decode_sink), 0x2, DECODE_EP)
    engines += [prefill, decode]
    return transport, prefill, decode, decode_sink


def used(engine: MockerEngine) -> int:
    return engine.get_schedulers()[0].pool.num_used


async def test_pull_flow_parks_transfers_frees_and_stores(engines: list[MockerEngine]) -> None:
    transport, prefill, decode, sink = pair(engines)
    whole = MockerEngine(fast())
    engines.append(whole)
    expected = [t for out in await run(whole, req(PROMPT, max_tokens=9)) for t in out.token_ids]

    (first,) = await run(prefill, prefill_stage())
    assert first.finish_reason is FinishReason.LENGTH and len(first.token_ids) == 1
    handle = first.kv_handle
    assert handle is not None
    assert (handle.instance_id, handle.endpoint) == (0x1, PREFILL_EP)
    assert handle.mode is KvTransferMode.PULL
    assert handle.num_tokens == len(PROMPT)
    assert handle.num_bytes == len(PROMPT) * prefill.config.kv_bytes_per_token
    # The prompt's blocks stay held for the decode worker: 12 full ones and the tail.
    assert used(prefill) == 13 and len(prefill.kv_handles) == 1

    outs = await run(decode, decode_stage(first.token_ids, handle))
    assert transport.calls == ["pull"]
    assert len(prefill.kv_handles) == 0 and used(prefill) == 0  # freed once across
    assert prefill.kv_handles.bytes_sent == handle.num_bytes
    assert isinstance((outs[0].extra or {}).get("kv_transfer_s"), float)
    tokens = first.token_ids + [t for out in outs for t in out.token_ids]
    assert tokens == expected  # the same tokens as the request run whole
    # The decode worker stored the received blocks: KV events name the prompt's full blocks,
    # and only the rest of the prompt was computed there.
    stored = [
        b.block_hash
        for batch in sink.batches
        for ev in batch.events
        if isinstance(ev.data, BlockStored)
        for b in ev.data.blocks
    ]
    whole_pool = whole.get_schedulers()[0].pool
    assert len(stored) >= 12
    assert set(stored[:12]) <= whole_pool.get_resident_hashes()


async def test_push_flow_sends_after_the_first_token(engines: list[MockerEngine]) -> None:
    transport, prefill, decode, _ = pair(engines, kv_transfer="push")
    (first,) = await run(prefill, prefill_stage(push_to=0x2))
    handle = first.kv_handle
    assert handle is not None and handle.mode is KvTransferMode.PUSH and handle.pushed_to == 0x2
    outs = await run(decode, decode_stage(first.token_ids, handle))
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert transport.calls == ["push"]
    for _ in range(5):  # the push task frees the blocks after the acknowledgement
        await asyncio.sleep(0)
    assert len(prefill.kv_handles) == 0 and used(prefill) == 0
    assert decode.kv_arrivals.bytes_received == handle.num_bytes


async def test_push_may_arrive_before_the_decode_request(engines: list[MockerEngine]) -> None:
    _, prefill, decode, _ = pair(engines, kv_transfer="push")
    (first,) = await run(prefill, prefill_stage(push_to=0x2))
    assert first.kv_handle is not None
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(prefill.kv_handles) == 0  # pushed and acknowledged already
    outs = await run(decode, decode_stage(first.token_ids, first.kv_handle))
    assert outs[-1].finish_reason is FinishReason.LENGTH


async def test_release_frees_and_a_released_handle_fails_cleanly(
    engines: list[MockerEngine],
) -> None:
    _, prefill, decode, _ = pair(engines)
    (first,) = await run(prefill, prefill_stage())
    handle = first.kv_handle
    assert handle is not None
    reply = await prefill.serve_kv_transfer(
        KvTransferRequest(op=KvTransferOp.RELEASE, handle_id=handle.handle_id)
    )
    assert reply.ok and used(prefill) == 0
    (out,) = await run(decode, decode_stage(first.token_ids, handle))
    assert out.finish_reason is FinishReason.ERROR
    assert out.error_kind == ErrorKind.KV_TRANSFER_FAILED.value
    assert "unknown or expired KV handle" in (out.error or "")
    assert used(decode) == 0


def on_fake_clock(engines: list[MockerEngine], ttl_s: float) -> tuple[FakeClock, MockerEngine]:
    """A prefill engine whose clock moves only when it sleeps."""
    clock = FakeClock()
    config = fast(role="prefill", kv_handle_ttl_s=ttl_s)
    prefill = LocalTransport().add(
        MockerEngine(config, clock=clock, sleep=clock.sleep), 0x1, PREFILL_EP
    )
    engines.append(prefill)
    return clock, prefill


async def test_handles_expire_after_their_ttl(engines: list[MockerEngine]) -> None:
    clock, prefill = on_fake_clock(engines, ttl_s=5.0)
    (first,) = await run(prefill, prefill_stage())
    assert first.kv_handle is not None and used(prefill) == 13
    assert prefill.kv_handles.expire(now=clock() + 4.9) == 0
    assert prefill.kv_handles.expire(now=clock() + 5.0) == 1
    assert used(prefill) == 0 and len(prefill.kv_handles) == 0


async def test_the_sweeper_expires_unclaimed_handles(engines: list[MockerEngine]) -> None:
    _, prefill = on_fake_clock(engines, ttl_s=3.0)
    await run(prefill, prefill_stage())
    for _ in range(50):  # the sweeper's sleeps advance the fake clock
        if not len(prefill.kv_handles):
            break
        await asyncio.sleep(0)
    assert len(prefill.kv_handles) == 0 and used(prefill) == 0


async def test_cancelling_during_prefill_frees_the_blocks(engines: list[MockerEngine]) -> None:
    clock = FakeClock()
    transport = LocalTransport()
    config = fast(role="prefill", speedup_ratio=1.0, max_num_batched_tokens=32)
    prefill = transport.add(MockerEngine(config, clock=clock, sleep=clock.sleep), 1, PREFILL_EP)
    engines.append(prefill)
    ctx = RequestContext()
    outs: list[LLMEngineOutput] = []

    async def consume() -> None:
        async for out in prefill.generate(prefill_stage(), ctx):
            outs.append(out)

    task = asyncio.create_task(consume())
    for _ in range(3):  # a few chunks of the prompt
        await asyncio.sleep(0)
    assert used(prefill) > 0
    ctx.cancel()
    await task
    assert [o.finish_reason for o in outs] == [FinishReason.CANCELLED]
    assert used(prefill) == 0 and len(prefill.kv_handles) == 0


async def test_a_push_that_never_comes_times_out(engines: list[MockerEngine]) -> None:
    transport = LocalTransport()
    decode = transport.add(
        MockerEngine(fast(role="decode", kv_transfer_timeout_s=0.05)), 0x2, DECODE_EP
    )
    engines.append(decode)
    ghost = KvHandle(
        handle_id="feed", endpoint=PREFILL_EP, instance_id=0x1, num_tokens=len(PROMPT),
        num_bytes=1, mode=KvTransferMode.PUSH, pushed_to=0x2,
    )  # fmt: skip
    (out,) = await run(decode, decode_stage([7], ghost))
    assert out.error_kind == ErrorKind.KV_TRANSFER_FAILED.value
    assert "did not arrive within 0.05s" in (out.error or "")


async def test_prefill_card_says_its_role_and_transfer(engines: list[MockerEngine]) -> None:
    prefill = MockerEngine(fast(role="prefill", kv_transfer="push"))
    decode = MockerEngine(fast(role="decode"))
    card = prefill.model_card_template()
    assert card.model_type == ModelType.Prefill and card.worker_role is WorkerRole.PREFILL
    assert card.runtime_config.kv_transfer == "push"
    dcard = decode.model_card_template()
    assert dcard.worker_role is WorkerRole.DECODE and dcard.model_type.supports_chat()
    assert dcard.runtime_config.kv_transfer is None
    assert card.checksum() == dcard.checksum()  # the frontend pairs them


def test_scheduler_computes_only_what_was_not_received() -> None:
    config = fast()
    scheduler = Scheduler(config)
    request = req([*PROMPT, 5], max_tokens=4)
    assert scheduler.add_request("r", request, imported_tokens=len(PROMPT)) is None
    result = scheduler.step()
    assert result.num_prefill_tokens == 1  # the first token's KV only
    assert scheduler.pool.num_resident == 12  # the received full blocks, stored
    scheduler.pool.check_invariants()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"role": "both"}, "role must be one of"),
        ({"kv_transfer": "teleport"}, "kv_transfer must be one of"),
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token"),
        ({"kv_transfer_bandwidth_gbps": 0.0}, "kv_transfer_bandwidth_gbps"),
        ({"kv_handle_ttl_s": float("inf")}, "kv_handle_ttl_s"),
    ],
)
def test_bad_disagg_settings_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MockerConfig(**changes).validate()


def test_transfer_time_is_bytes_over_bandwidth_over_speedup() -> None:
    config = MockerConfig(kv_transfer_bandwidth_gbps=25.0, speedup_ratio=10.0)
    assert config.transfer_seconds(8192 * 131072) == pytest.approx(8192 * 131072 / 25e9 / 10)
    assert MockerConfig(speedup_ratio=0.0).transfer_seconds(10**9) == 0.0
