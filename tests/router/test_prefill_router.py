"""The prefill router's decisions and stages, against scripted prefill and decode workers.

End-to-end runs with real mocker workers over HTTP are in ``tests/frontend/test_disagg_e2e.py``;
here each path (conditional skip, the two stages, retries, releases, waiting for activation)
is driven exactly, including the ones real workers produce only by bad luck.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import pytest
from tests.polling import eventually

from turnout.errors import NoInstanceAvailable, StreamBroken
from turnout.llm.migration import Migration
from turnout.protocols.disagg import KvHandle, KvTransferOp, KvTransferRequest
from turnout.protocols.llm import (
    CompletionUsage,
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    StopConditions,
    StructuredOutput,
)
from turnout.protocols.model import EndpointId, WorkerRole
from turnout.router.prefill_policy import BypassPolicy, LocalReason
from turnout.router.prefill_router import MAX_KV_RETRIES, PrefillRouter, Stage
from turnout.router.prefill_slots import PrefillPool, PrefillSlot
from turnout.runtime.context import (
    AVOID_METADATA,
    DEADLINE_METADATA,
    STALLED_METADATA,
    RequestContext,
)

PREFILL_EP = EndpointId(namespace="t", component="prefill", name="generate")
DECODE_EP = EndpointId(namespace="t", component="backend", name="generate")
GRAMMAR = '%llguidance {}\nstart: "yes" | "no"'
_transfer_request = msgspec.msgpack.Decoder(KvTransferRequest).decode


def handle(n: int, instance: int = 0xA, hid: str = "h1") -> KvHandle:
    return KvHandle(
        handle_id=hid, endpoint=PREFILL_EP, instance_id=instance, num_tokens=n, num_bytes=n * 10
    )


@dataclass
class Observer:
    stages: list[tuple[Stage, float]] = field(default_factory=list)
    locals: list[LocalReason] = field(default_factory=list)
    bytes: int = 0
    retries: list[str] = field(default_factory=list)

    def stage(self, stage: Stage, seconds: float) -> None:
        self.stages.append((stage, seconds))

    def local(self, reason: LocalReason) -> None:
        self.locals.append(reason)

    def transferred(self, num_bytes: int) -> None:
        self.bytes += num_bytes

    def retry(self, reason: str) -> None:
        self.retries.append(reason)


class PrefillClient:
    """The prefill endpoint's client as the router uses it: releases and set-asides."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.down: list[int] = []

    async def call(
        self, instance_id: int, name: str, payload: bytes, ctx: RequestContext
    ) -> AsyncIterator[bytes]:
        request = _transfer_request(payload)
        assert request.op is KvTransferOp.RELEASE
        self.released.append(request.handle_id)
        yield b""

    def report_instance_down(self, instance_id: int) -> None:
        self.down.append(instance_id)


class Workers:
    """Scripted prefill and decode workers; each records the requests it got."""

    def __init__(self) -> None:
        self.prefill_requests: list[PreprocessedRequest] = []
        self.decode_requests: list[PreprocessedRequest] = []
        #: The instances each prefill call was told to avoid.
        self.prefill_avoided: list[set[int]] = []
        #: One script per prefill call: the outputs, an exception to raise after them, or
        #: an event to wait for (a worker that stalls until it is set).
        self.prefill_scripts: list[list[LLMEngineOutput | Exception | asyncio.Event]] = []
        self.decode_scripts: list[list[LLMEngineOutput]] = []
        self.decode_gate: asyncio.Event | None = None

    async def prefill(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        self.prefill_requests.append(request)
        self.prefill_avoided.append(set(ctx.metadata.get(AVOID_METADATA, ())))
        n = len(self.prefill_requests)
        ctx.metadata["worker_instance_id"] = 0xA0 + n
        ctx.metadata["routing"] = {"prefill_call": n}
        script = self.prefill_scripts.pop(0) if self.prefill_scripts else None
        if script is None:
            script = [
                LLMEngineOutput(
                    token_ids=[7],
                    finish_reason=FinishReason.LENGTH,
                    kv_handle=handle(len(request.token_ids), 0xA0 + n, f"h{n}"),
                    usage=CompletionUsage(prompt_tokens=len(request.token_ids), cached_tokens=32),
                )
            ]
        for item in script:
            if isinstance(item, Exception):
                raise item
            if isinstance(item, asyncio.Event):
                await item.wait()
                continue
            yield item

    async def decode(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        self.decode_requests.append(request)
        ctx.metadata["worker_instance_id"] = 0xD0
        ctx.metadata["routing"] = {"decode_call": len(self.decode_requests)}
        if self.decode_gate is not None:
            await self.decode_gate.wait()
        script = self.decode_scripts.pop(0) if self.decode_scripts else None
        if script is None:
            left = request.stop_conditions.max_tokens or 3
            script = [LLMEngineOutput(token_ids=[100 + i]) for i in range(left - 1)]
            script.append(
                LLMEngineOutput(
                    token_ids=[200],
                    finish_reason=FinishReason.LENGTH,
                    usage=CompletionUsage(prompt_tokens=len(request.token_ids), cached_tokens=0),
                )
            )
        for output in script:
            yield output


def make(
    workers: Workers,
    *,
    active: bool = True,
    role: WorkerRole = WorkerRole.DECODE,
    fallback: bool = True,
    min_tokens: int = 64,
    checksum: str = "c",
    wait_s: float = 5.0,
) -> tuple[PrefillRouter, PrefillSlot, PrefillPool, Observer]:
    slot = PrefillSlot("m")
    pool = PrefillPool(PREFILL_EP, PrefillClient(), workers.prefill, "c")
    if active:
        slot.activate(pool)
    observer = Observer()
    router = PrefillRouter(
        slot,
        workers.decode,
        checksum=checksum,
        role=role,
        decode_endpoint=DECODE_EP,
        block_size=16,
        min_tokens=min_tokens,
        fallback=fallback,
        observer=observer,
        wait_s=wait_s,
    )
    return router, slot, pool, observer


def request(n: int = 200, max_tokens: int = 4, **kw: object) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m",
        token_ids=list(range(n)),
        stop_conditions=StopConditions(max_tokens=max_tokens),
        **kw,  # type: ignore[arg-type]
    )


async def collect(stream: AsyncIterator[LLMEngineOutput]) -> list[LLMEngineOutput]:
    return [output async for output in stream]


async def settle() -> None:
    """Let the release tasks run (they need a few loop turns; no wall-clock wait)."""
    for _ in range(20):
        await asyncio.sleep(0)


def tokens(outputs: list[LLMEngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


async def test_inactive_slot_is_not_in_the_way() -> None:
    workers = Workers()
    router, *_ = make(workers, active=False, role=WorkerRole.AGGREGATED)
    stream = router.generate(request(), RequestContext())
    # The decode router's own stream, not a wrapper: no per-token cost while inactive.
    assert stream.ag_code is Workers.decode.__code__  # type: ignore[attr-defined]
    assert tokens(await collect(stream)) == [100, 101, 102, 200]
    assert workers.prefill_requests == []


async def test_two_stages_first_token_from_prefill_rest_from_decode() -> None:
    workers = Workers()
    router, _, _, observer = make(workers)
    ctx = RequestContext()
    outputs = await collect(router.generate(request(200, max_tokens=4), ctx))
    assert tokens(outputs) == [7, 100, 101, 200]
    (prefill,) = workers.prefill_requests
    assert prefill.stop_conditions.max_tokens == 1
    assert prefill.disagg is not None and prefill.disagg.prefill is not None
    assert prefill.token_ids == list(range(200))
    (decode,) = workers.decode_requests
    assert decode.token_ids == [*range(200), 7]
    assert decode.stop_conditions.max_tokens == 3
    assert decode.disagg is not None and decode.disagg.handle == handle(200, 0xA1, "h1")
    # The client's cached tokens are the prefill side's.
    assert outputs[-1].usage is not None and outputs[-1].usage.cached_tokens == 32
    routing = ctx.metadata["routing"]
    assert routing["disaggregated"] is True
    assert routing["prefill"]["worker_id"] == "a1"
    assert routing["prefill"]["routing"] == {"prefill_call": 1}
    assert routing["decode"]["routing"] == {"decode_call": 1}
    assert routing["kv_transfer"]["bytes"] == 2000
    assert [s for s, _ in observer.stages] == [Stage.PREFILL, Stage.DECODE]
    assert observer.bytes == 2000 and observer.locals == []
    assert ctx.metadata["worker_instance_id"] == 0xD0


@pytest.mark.parametrize(
    ("req", "reason"),
    [
        (request(10), LocalReason.SHORT),
        (request(200, max_tokens=1), LocalReason.ONE_TOKEN),
        (request(200, lora_name="ad"), LocalReason.LORA),
        (request(200, backend_instance_id=5), LocalReason.PINNED),
        (
            request(200, structured=StructuredOutput(kind="choice", grammar=GRAMMAR)),
            LocalReason.STRUCTURED,
        ),
    ],
)
async def test_requests_that_run_whole_on_the_decode_worker(
    req: PreprocessedRequest, reason: LocalReason
) -> None:
    workers = Workers()
    router, _, _, observer = make(workers)
    ctx = RequestContext()
    await collect(router.generate(req, ctx))
    assert workers.prefill_requests == []
    assert workers.decode_requests == [req]
    assert observer.locals == [reason]
    assert ctx.metadata["routing"]["disaggregated"] is False
    assert ctx.metadata["routing"]["reason"] == reason.value


async def test_card_mismatch_runs_locally() -> None:
    workers = Workers()
    router, _, _, observer = make(workers, checksum="other")
    await collect(router.generate(request(), RequestContext()))
    assert workers.prefill_requests == [] and observer.locals == [LocalReason.CARD_MISMATCH]


async def test_first_token_that_ends_the_request_releases_the_handle() -> None:
    workers = Workers()
    workers.prefill_scripts.append(
        [
            LLMEngineOutput(
                token_ids=[2], finish_reason=FinishReason.EOS, kv_handle=handle(200, hid="eos")
            )
        ]
    )
    router, _, pool, _ = make(workers)
    outputs = await collect(router.generate(request(), RequestContext()))
    assert tokens(outputs) == [2] and outputs[-1].finish_reason is FinishReason.EOS
    assert workers.decode_requests == []
    await settle()  # the release runs in its own task
    assert pool.client.released == ["eos"]


async def test_failed_transfer_prefills_again_then_computes_locally() -> None:
    workers = Workers()
    failed = LLMEngineOutput(
        finish_reason=FinishReason.ERROR,
        error="unknown or expired KV handle",
        error_kind=ErrorKind.KV_TRANSFER_FAILED.value,
    )
    workers.decode_scripts = [[failed]] * (MAX_KV_RETRIES + 1)
    router, _, _, observer = make(workers)
    outputs = await collect(router.generate(request(200, max_tokens=3), RequestContext()))
    # The client saw the first token once, then the decode worker's, no error.
    assert tokens(outputs) == [7, 100, 200]
    assert len(workers.prefill_requests) == 1 + MAX_KV_RETRIES
    handles = [r.disagg.handle if r.disagg else None for r in workers.decode_requests]
    assert [h.handle_id if h else None for h in handles] == ["h1", "h2", "h3", None]
    # Every attempt continues after the same first token.
    assert all(r.token_ids == [*range(200), 7] for r in workers.decode_requests)
    assert observer.retries == ["kv_transfer"] * (MAX_KV_RETRIES + 1)
    assert observer.locals == [LocalReason.KV_RETRIES_EXHAUSTED]


async def test_prefill_worker_dying_mid_prefill_reruns_elsewhere() -> None:
    workers = Workers()
    workers.prefill_scripts.append([StreamBroken("connection lost")])
    router, _, pool, observer = make(workers)
    outputs = await collect(router.generate(request(), RequestContext()))
    assert tokens(outputs)[0] == 7
    assert len(workers.prefill_requests) == 2
    assert pool.client.down == [0xA1]  # the dead one was set aside
    assert observer.retries == ["prefill_worker_failed"]


async def test_prefill_engine_failure_is_a_rerun_too() -> None:
    workers = Workers()
    workers.prefill_scripts.append(
        [
            LLMEngineOutput(
                finish_reason=FinishReason.ERROR,
                error="engine failed: loop died",
                error_kind=ErrorKind.ENGINE_FAILED.value,
            )
        ]
    )
    router, *_ = make(workers)
    await collect(router.generate(request(), RequestContext()))
    assert len(workers.prefill_requests) == 2


async def test_prefill_bad_request_goes_to_the_client_as_is() -> None:
    workers = Workers()
    bad = LLMEngineOutput(
        finish_reason=FinishReason.ERROR,
        error="prompt too long",
        error_kind=ErrorKind.BAD_REQUEST.value,
    )
    workers.prefill_scripts.append([bad])
    router, *_ = make(workers)
    outputs = await collect(router.generate(request(), RequestContext()))
    assert outputs == [bad] and workers.decode_requests == []


async def test_client_gone_before_decode_took_the_kv_releases_it() -> None:
    workers = Workers()
    workers.decode_gate = asyncio.Event()  # the decode worker never answers
    router, _, pool, _ = make(workers)
    stream = router.generate(request(), RequestContext())
    first = await anext(stream)
    assert first.token_ids == [7]
    waiting = asyncio.ensure_future(anext(stream))
    await eventually(lambda: len(workers.decode_requests) == 1, what="the decode request sent")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await stream.aclose()  # type: ignore[attr-defined]
    await settle()
    assert pool.client.released == ["h1"]


async def test_claimed_handle_is_not_released() -> None:
    workers = Workers()
    router, _, pool, _ = make(workers)
    await collect(router.generate(request(), RequestContext()))
    await settle()
    assert pool.client.released == []


async def test_no_prefill_worker_with_fallback_runs_on_decode() -> None:
    workers = Workers()
    router, _, _, observer = make(workers, active=False)
    await collect(router.generate(request(), RequestContext()))
    assert len(workers.decode_requests) == 1
    assert observer.locals == [LocalReason.NO_PREFILL_WORKER]


async def test_without_fallback_requests_wait_for_a_prefill_worker() -> None:
    workers = Workers()
    router, slot, pool, _ = make(workers, active=False, fallback=False)
    task = asyncio.ensure_future(collect(router.generate(request(), RequestContext())))
    await asyncio.sleep(0.01)  # time under test: for a while, nothing is sent anywhere
    assert not task.done() and workers.decode_requests == []
    slot.activate(pool)
    outputs = await asyncio.wait_for(task, 5)
    assert tokens(outputs)[0] == 7 and len(workers.prefill_requests) == 1


async def test_without_fallback_the_wait_ends_in_a_clear_error() -> None:
    workers = Workers()
    router, *_ = make(workers, active=False, fallback=False, wait_s=0.01)
    with pytest.raises(NoInstanceAvailable, match=r"no prefill worker.*--no-decode-fallback"):
        await collect(router.generate(request(), RequestContext()))
    assert workers.decode_requests == []


async def test_without_fallback_the_wait_ends_before_the_request_deadline() -> None:
    workers = Workers()
    router, *_ = make(workers, active=False, fallback=False, wait_s=3600)
    ctx = RequestContext()
    ctx.metadata[DEADLINE_METADATA] = asyncio.get_running_loop().time() + 0.05
    with pytest.raises(NoInstanceAvailable, match=r"no prefill worker"):
        await asyncio.wait_for(collect(router.generate(request(), ctx)), 10)


async def test_a_rerun_prefill_is_the_one_in_the_routing_record() -> None:
    workers = Workers()
    failed = LLMEngineOutput(
        finish_reason=FinishReason.ERROR,
        error="prefill worker gone",
        error_kind=ErrorKind.KV_TRANSFER_FAILED.value,
    )
    workers.decode_scripts = [[failed]]
    router, *_ = make(workers)
    ctx = RequestContext()
    await collect(router.generate(request(200, max_tokens=3), ctx))
    record = ctx.metadata["routing"]
    assert record["disaggregated"] is True
    # The second prefill (worker 0xa2) gave the handle the decode stage used.
    assert record["prefill"]["worker_id"] == "a2"
    assert record["prefill"]["routing"] == {"prefill_call": 2}
    assert record["kv_transfer"]["from_worker_id"] == "a2"


async def test_deactivation_sends_requests_back_to_decode() -> None:
    workers = Workers()
    router, slot, _, _ = make(workers)
    await collect(router.generate(request(), RequestContext()))
    slot.deactivate()
    await collect(router.generate(request(), RequestContext()))
    assert len(workers.prefill_requests) == 1 and len(workers.decode_requests) == 2
    assert workers.decode_requests[1].disagg is None


async def test_a_rerun_prefill_that_ends_in_an_error_releases_its_handle() -> None:
    """The decode worker could not get the KV; the re-run prefill answers an error that
    still announced a handle: the error goes to the client, the handle back to its worker."""
    workers = Workers()
    failed = LLMEngineOutput(
        finish_reason=FinishReason.ERROR,
        error="unknown or expired KV handle",
        error_kind=ErrorKind.KV_TRANSFER_FAILED.value,
    )
    workers.decode_scripts = [[failed]]
    error = LLMEngineOutput(
        finish_reason=FinishReason.ERROR, error="out of blocks", kv_handle=handle(200, hid="h2")
    )
    workers.prefill_scripts = [None, [error]]  # type: ignore[list-item]
    router, _, pool, _ = make(workers)
    outputs = await collect(router.generate(request(200, max_tokens=3), RequestContext()))
    assert outputs[-1] == error
    await eventually(lambda: pool.client.released == ["h2"], what="h2 released")


def test_the_bypass_policy_answers_with_its_reason() -> None:
    policy = BypassPolicy(model="m", checksum="c", block_size=16, min_tokens=64)
    assert policy.before_routing(request(200), "c") is None
    assert policy.before_routing(request(200, max_tokens=1), "c") is LocalReason.ONE_TOKEN
    assert policy.before_routing(request(200, lora_name="a"), "c") is LocalReason.LORA
    assert policy.before_routing(request(200, backend_instance_id=1), "c") is LocalReason.PINNED
    assert policy.before_routing(request(200), "other") is LocalReason.CARD_MISMATCH
    assert policy.after_routing(request(63), 0) is LocalReason.SHORT
    assert policy.after_routing(request(200), 9) is LocalReason.CACHED  # 200 - 144 < 64
    assert policy.after_routing(request(200), 8) is None  # 200 - 128 >= 64


OVERLOADED = LLMEngineOutput(
    finish_reason=FinishReason.ERROR,
    error="waiting queue full",
    error_kind=ErrorKind.OVERLOADED.value,
)


async def test_an_overloaded_prefill_worker_is_left_out_and_another_prefills() -> None:
    workers = Workers()
    workers.prefill_scripts.append([OVERLOADED])
    router, _, pool, observer = make(workers)
    ctx = RequestContext()
    ctx.metadata[AVOID_METADATA] = {0xD9}  # migration's list, of decode instances
    outputs = await collect(router.generate(request(), ctx))
    assert tokens(outputs)[0] == 7
    assert len(workers.prefill_requests) == 2
    assert workers.prefill_avoided == [set(), {0xA1}]  # what the prefill pool's router saw
    assert pool.client.down == []  # refused, not dead
    assert observer.retries == ["prefill_overloaded"]
    assert ctx.metadata[AVOID_METADATA] == {0xD9}  # put back for the decode side


async def test_every_prefill_worker_overloaded_is_the_clients_refusal() -> None:
    workers = Workers()
    workers.prefill_scripts += [[OVERLOADED], [NoInstanceAvailable("none left")]]
    router, *_ = make(workers)
    outputs = await collect(router.generate(request(), RequestContext()))
    assert outputs == [OVERLOADED] and workers.decode_requests == []


async def test_a_prefill_worker_that_stalls_is_set_aside_on_the_prefill_side() -> None:
    """Migration's TTFT watchdog cancels a request stuck in its prefill stage: the prefill
    worker is set aside on the prefill client, and neither reported down to nor avoided on
    the decode side (its id means nothing there); the request starts again and completes."""
    workers = Workers()
    workers.prefill_scripts = [[asyncio.Event()]]  # the first prefill worker never answers
    router, _, pool, _ = make(workers)
    assert isinstance(pool.client, PrefillClient)
    decode_down: list[int] = []
    migration = Migration(
        router.generate, migration_limit=0, ttft_timeout=0.05, report_down=decode_down.append
    )
    ctx = RequestContext("r")
    outputs = await collect(migration.generate(request(), ctx))
    assert tokens(outputs) == [7, 100, 101, 200]
    assert pool.client.down == [0xA1]
    assert decode_down == []
    assert 0xA1 not in ctx.metadata.get(AVOID_METADATA, set())
    assert STALLED_METADATA not in ctx.metadata
