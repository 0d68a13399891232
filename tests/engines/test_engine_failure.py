"""Engines that fail: the worker takes its instance out of discovery and fails the streams in
flight as ``engine_failed``; the mocker's fault injection, health probe (injected clock) and
bounded waiting queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from turnout.engines.echo import EchoEngine
from turnout.engines.mocker import MockerConfig, MockerEngine
from turnout.engines.mocker.scheduler import Scheduler
from turnout.engines.worker import Worker
from turnout.protocols.llm import (
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    StopConditions,
)
from turnout.protocols.model import EndpointId
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery.memory import MemoryStore

ENDPOINT = EndpointId(namespace="t", component="backend", name="generate")
_decode = msgspec.msgpack.Decoder(LLMEngineOutput).decode
_encode = msgspec.msgpack.Encoder().encode


class HangingEngine(EchoEngine):
    """Echo's card; every stream yields one token and then waits forever."""

    def __init__(self, gguf_path: str) -> None:
        super().__init__(gguf_path)
        self.unhealthy: str | None = None

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        yield LLMEngineOutput(token_ids=[request.token_ids[0]])
        await asyncio.get_running_loop().create_future()

    def health(self) -> str | None:
        return self.unhealthy or super().health()


def request(n: int = 4, max_tokens: int = 8) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m", token_ids=list(range(10, 10 + n)),
        stop_conditions=StopConditions(max_tokens=max_tokens),
    )  # fmt: skip


async def until(predicate: object, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.01)


async def run_failure(gguf_path: str, fail: str) -> None:
    runtime = await DistributedRuntime.create(
        store=MemoryStore(), request_plane="tcp", lease_ttl=30.0
    )
    engine = HangingEngine(gguf_path)
    worker = Worker(runtime, engine, ENDPOINT, health_interval=0)
    try:
        serving = await worker.start()
        client = await runtime.endpoint(ENDPOINT).client()
        assert list(client.instance_ids()) == [serving.instance_id]
        stream = client.stream(serving.instance_id, _encode(request()), RequestContext("r"))
        first = _decode(await stream.__anext__())
        assert first.token_ids == [10]
        if fail == "report":
            engine.report_failure("the loop died")
        else:
            engine.unhealthy = "stuck"
            assert worker.probe() == "stuck"
        last = _decode(await stream.__anext__())
        assert last.finish_reason is FinishReason.ERROR
        assert last.error_kind == ErrorKind.ENGINE_FAILED.value
        await asyncio.wait_for(worker.failed.wait(), 10)
        # Out of discovery at once, long before the 30 s lease could have expired.
        await until(lambda: list(client.instance_ids()) == [])
        assert worker.failure is not None
    finally:
        await worker.stop(drain_timeout=0.5)
        await runtime.shutdown()


async def test_a_failed_engine_leaves_discovery_and_fails_its_streams(gguf_path: str) -> None:
    await run_failure(gguf_path, "report")


async def test_a_failed_health_probe_does_the_same(gguf_path: str) -> None:
    await run_failure(gguf_path, "probe")


async def test_the_mocker_fault_injection_fails_streams_as_engine_failed() -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=0, fail_after_steps=3))
    reasons: list[str] = []
    engine.on_failure(reasons.append)
    await engine.start()
    try:
        outputs = [out async for out in engine.generate(request(), RequestContext("r"))]
        assert outputs[-1].finish_reason is FinishReason.ERROR
        assert outputs[-1].error_kind == ErrorKind.ENGINE_FAILED.value
        assert len(reasons) == 1 and "--fail-after-steps" in reasons[0]
        assert engine.health() == reasons[0]
        # Requests after the failure are refused the same way (they go elsewhere).
        (late,) = [out async for out in engine.generate(request(), RequestContext("s"))]
        assert late.error_kind == ErrorKind.ENGINE_FAILED.value
    finally:
        await engine.stop()


async def test_the_mocker_health_probe_notices_a_loop_that_stopped_stepping() -> None:
    now = [100.0]
    engine = MockerEngine(MockerConfig(health_timeout_s=5.0), clock=lambda: now[0])
    engine._started = True  # as if running, without a loop that would step
    rank = engine._ranks[0]
    assert engine.health() is None
    rank.last_beat = 100.0
    assert rank.scheduler.add_request("a", request()) is None
    now[0] = 104.0
    assert engine.health() is None
    now[0] = 106.0
    reason = engine.health()
    assert reason is not None and "not stepped for 6.0s with 1 requests" in reason


def test_the_waiting_queue_is_bounded() -> None:
    scheduler = Scheduler(MockerConfig(max_waiting=2))
    assert scheduler.add_request("a", request()) is None
    assert scheduler.add_request("b", request()) is None
    assert scheduler.is_full
    refused = scheduler.add_request("c", request())
    assert refused is not None and refused.error_kind == ErrorKind.OVERLOADED.value


def test_requests_that_can_never_run_are_bad_requests() -> None:
    scheduler = Scheduler(MockerConfig(num_gpu_blocks=1, block_size=4))
    refused = scheduler.add_request("a", request(n=10))
    assert refused is not None and refused.error_kind == ErrorKind.BAD_REQUEST.value


async def test_a_full_queue_is_reported_busy_and_routers_skip_it() -> None:
    from turnout.protocols.kv import KvEventBatch, LoadReport
    from turnout.router.kv.base import WorkerKey
    from turnout.router.kv.worker_load import WorkerLoads

    class Sink:
        def __init__(self) -> None:
            self.loads: list[LoadReport] = []

        def publish_kv(self, batch: KvEventBatch) -> None:
            pass

        def publish_load(self, report: LoadReport) -> None:
            self.loads.append(report)

    sink = Sink()
    engine = MockerEngine(MockerConfig(max_waiting=1), sink=sink)
    rank = engine._ranks[0]
    assert rank.scheduler.add_request("a", request()) is None
    engine._maybe_publish_load(rank, force=False)
    report = sink.loads[-1]
    assert report.busy
    loads = WorkerLoads()  # no thresholds: only the worker's own word
    assert loads.on_load(report, now=0.0)
    assert loads.is_busy(WorkerKey(report.worker_id, report.dp_rank), now=1.0)
