"""MockerEngine: the async edge. Streams, cancellation, KV events, load reports, timing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from tests.engines.mocker.replay import ReplayModel
from tests.polling import eventually

from turnout.engines.mocker import (
    MockerConfig,
    MockerEngine,
    PolynomialTimingModel,
    make_mocker_engines,
)
from turnout.protocols.kv import KvEventBatch, LoadReport
from turnout.protocols.llm import (
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    StopConditions,
)
from turnout.runtime.context import RequestContext


class RecordingSink:
    """A KvEventSink that keeps what it is given."""

    def __init__(self) -> None:
        self.batches: list[KvEventBatch] = []
        self.loads: list[LoadReport] = []

    def publish_kv(self, batch: KvEventBatch) -> None:
        self.batches.append(batch)

    def publish_load(self, report: LoadReport) -> None:
        self.loads.append(report)


class FakeClock:
    """Simulated time: sleeping advances it instantly, after letting ready tasks run (as
    they would during a real sleep, at its start)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)
        self.now += seconds


def req(tokens: list[int], **stop: object) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="mock",
        token_ids=tokens,
        stop_conditions=StopConditions(**stop),  # type: ignore[arg-type]
    )


async def collect(engine: MockerEngine, request: PreprocessedRequest) -> list[LLMEngineOutput]:
    return [out async for out in engine.generate(request, RequestContext())]


def fast(**changes: Any) -> MockerConfig:
    """A small config at speedup 0 (no waiting)."""
    settings: dict[str, Any] = {"speedup_ratio": 0.0, "num_gpu_blocks": 256, "block_size": 16}
    return MockerConfig(**(settings | changes))


async def test_generate_streams_tokens_and_usage(engines: list[MockerEngine]) -> None:
    engine = MockerEngine(fast(seed=1))
    engines.append(engine)
    outs = await collect(engine, req(list(range(40)), max_tokens=12))
    assert [len(o.token_ids) for o in outs] == [1] * 12
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].usage is not None
    assert (outs[-1].usage.prompt_tokens, outs[-1].usage.completion_tokens) == (40, 12)
    # Same seed, same prompt: same tokens on another worker; the repeat hits the cache.
    other = MockerEngine(fast(seed=1))
    engines.append(other)
    again = await collect(other, req(list(range(40)), max_tokens=12))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    third = await collect(engine, req(list(range(40)), max_tokens=12))
    assert third[-1].usage is not None and third[-1].usage.cached_tokens == 32


async def test_a_migrated_request_goes_on_as_the_interrupted_one_would(
    engines: list[MockerEngine],
) -> None:
    """The continuation of a migrated request (prompt + tokens produced so far, with the
    original prompt length) yields exactly the rest of what an uninterrupted run gives, on
    another worker: a stream's text does not depend on where it ran."""
    first, second = MockerEngine(fast(seed=3)), MockerEngine(fast(seed=3))
    engines += [first, second]
    prompt = list(range(100, 140))
    whole = [t for o in await collect(first, req(prompt, max_tokens=20)) for t in o.token_ids]
    done = whole[:7]
    continued = PreprocessedRequest(
        model="mock",
        token_ids=[*prompt, *done],
        stop_conditions=StopConditions(max_tokens=13),
        original_prompt_len=len(prompt),
    )
    rest = [t for o in await collect(second, continued) for t in o.token_ids]
    assert done + rest == whole
    # Without the original length it is a new prompt, with other tokens.
    fresh = req([*prompt, *done], max_tokens=13)
    assert [t for o in await collect(second, fresh) for t in o.token_ids] != rest


async def test_kv_events_replay_and_load_reports(engines: list[MockerEngine]) -> None:
    sink = RecordingSink()
    engine = MockerEngine(fast(num_gpu_blocks=32), sink=sink)
    engine.set_worker_id(0xABC)
    engines.append(engine)
    prompts = [[p] * 48 + list(range(i, i + 40)) for i in range(12) for p in (1, 2)]
    await asyncio.gather(*(collect(engine, req(p, max_tokens=20)) for p in prompts))
    replay = ReplayModel(block_size=16)
    for batch in sink.batches:
        assert all(ev.worker_id == 0xABC for ev in batch.events)
        replay.apply(batch.events)
    (sched,) = engine.get_schedulers()
    assert replay.resident == sched.pool.get_resident_hashes()
    assert replay.next_event_id > 0
    assert sched.num_preemptions > 0  # 24 requests of ~6 blocks in 32 blocks
    assert sink.loads and all(r.worker_id == 0xABC for r in sink.loads)
    assert max(r.num_waiting for r in sink.loads) > 0
    last = sink.loads[-1]
    assert (last.num_running, last.num_waiting, last.active_decode_blocks) == (0, 0, 0)
    assert last.total_kv_blocks == 32


async def test_cancel_via_context_frees_blocks(engines: list[MockerEngine]) -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=100.0, num_gpu_blocks=256, block_size=16))
    engines.append(engine)
    ctx = RequestContext()
    outs = []
    async for out in engine.generate(req(list(range(100)), max_tokens=10_000), ctx):
        outs.append(out)
        if len(outs) == 3:
            ctx.cancel()
    assert outs[-1].finish_reason is FinishReason.CANCELLED
    assert len(outs) < 10
    (sched,) = engine.get_schedulers()
    assert sched.pool.num_used == 0 and not sched.has_work()


async def test_closing_the_stream_aborts_the_request(engines: list[MockerEngine]) -> None:
    engine = MockerEngine(fast())
    engines.append(engine)
    stream = engine.generate(req(list(range(100)), max_tokens=10_000), RequestContext())
    async for out in stream:
        if out.token_ids:
            break
    (sched,) = engine.get_schedulers()
    assert sched.pool.num_used > 0
    await stream.aclose()  # type: ignore[attr-defined]
    assert sched.pool.num_used == 0 and not sched.has_work()


async def test_cancelling_the_consumer_task_frees_blocks(engines: list[MockerEngine]) -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=1.0, num_gpu_blocks=256, block_size=16))
    engines.append(engine)
    task = asyncio.create_task(collect(engine, req(list(range(100)), max_tokens=10_000)))
    await eventually(lambda: in_flight(engine), what="the request holds KV blocks")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (sched,) = engine.get_schedulers()
    assert sched.pool.num_used == 0 and not sched.has_work()


async def test_speedup_zero_runs_without_waiting(engines: list[MockerEngine]) -> None:
    made = make_mocker_engines(fast(), 4)
    engines.extend(made)
    start = time.perf_counter()
    results = await asyncio.gather(
        *(collect(made[i % 4], req([i % 3] * 64 + [i], max_tokens=100)) for i in range(40))
    )
    elapsed = time.perf_counter() - start
    # Simulated: ~100 decode steps of >= 12.5 ms each = 1.25 s per worker at speedup 1.
    assert elapsed < 1.0
    assert all(r[-1].finish_reason is FinishReason.LENGTH for r in results)
    assert [e.worker_id for e in made] == [0, 1, 2, 3]


async def test_timing_with_a_fake_clock(engines: list[MockerEngine]) -> None:
    clock = FakeClock()
    timing = PolynomialTimingModel()
    engine = MockerEngine(
        MockerConfig(num_gpu_blocks=1024, block_size=16),
        timing=timing,
        clock=clock,
        sleep=clock.sleep,
    )
    engines.append(engine)
    prompt = list(range(2000))
    ttfts = []
    for _ in range(2):
        start = clock.now
        ttft = None
        async for _out in engine.generate(req(prompt, max_tokens=64), RequestContext()):
            if ttft is None:
                ttft = clock.now - start
        ttfts.append(ttft)
        total = clock.now - start
    assert ttfts[0] == pytest.approx(timing.prefill_ms(2000) / 1000)
    assert ttfts[1] is not None and ttfts[0] is not None and ttfts[1] < ttfts[0] / 2
    expected = ttfts[1] + 63 * timing.decode_ms(1, 0.13) / 1000
    assert total == pytest.approx(expected, rel=0.1)


async def test_real_time_speedup_is_honoured(engines: list[MockerEngine]) -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=10.0))
    engines.append(engine)
    start = time.perf_counter()
    await collect(engine, req(list(range(64)), max_tokens=20))
    elapsed = time.perf_counter() - start
    timing = PolynomialTimingModel()
    simulated = (timing.prefill_ms(64) + 19 * timing.decode_ms(1, 0.0)) / 1000
    assert simulated / 10 * 0.8 < elapsed < simulated / 10 + 0.5


async def test_prompt_longer_than_pool_is_an_error_output(engines: list[MockerEngine]) -> None:
    engine = MockerEngine(fast(num_gpu_blocks=4, block_size=16))
    engines.append(engine)
    outs = await asyncio.wait_for(collect(engine, req(list(range(65)))), timeout=5)
    assert len(outs) == 1 and outs[0].finish_reason is FinishReason.ERROR
    assert "KV cache" in (outs[0].error or "")


async def test_stop_ends_in_flight_streams(engines: list[MockerEngine]) -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=1.0))
    task = asyncio.create_task(collect(engine, req(list(range(64)), max_tokens=10_000)))
    await eventually(lambda: in_flight(engine), what="the request holds KV blocks")
    await engine.stop()
    outs = await asyncio.wait_for(task, timeout=2)
    assert outs[-1].finish_reason is FinishReason.ERROR
    assert engine.get_schedulers()[0].pool.num_used == 0


async def test_data_parallel_ranks_are_independent_pools(engines: list[MockerEngine]) -> None:
    sink = RecordingSink()
    engine = MockerEngine(fast(dp_size=2), sink=sink)
    engines.append(engine)
    for rank in (0, 1, 1):
        r = req(list(range(40)), max_tokens=2)
        r.extra_args = {"dp_rank": rank}
        outs = await collect(engine, r)
        assert outs[-1].usage is not None
    ranks = {ev.dp_rank for b in sink.batches for ev in b.events}
    assert ranks == {0, 1}
    assert {r.dp_rank for r in sink.loads} == {0, 1}


def test_model_card_uses_the_mocker_geometry(gguf_path: str) -> None:
    engine = MockerEngine(
        MockerConfig(num_gpu_blocks=100, block_size=32),
        model_path=gguf_path,
        served_model_name="mock-model",
    )
    card = engine.model_card_template()
    assert card.kv_cache_block_size == 32
    assert card.display_name == "mock-model"
    assert card.runtime_config.total_kv_blocks == 100
    assert card.runtime_config.enable_kv_events


def in_flight(engine: MockerEngine) -> bool:
    return any(sched.pool.num_used > 0 for sched in engine.get_schedulers())


class BrokenSink(RecordingSink):
    def publish_kv(self, batch: KvEventBatch) -> None:
        raise OSError("event plane down")


class BrokenSampler:
    def next_token(self, request: object) -> int:
        raise ValueError("bug in a sampler")


async def test_a_failing_sink_does_not_stop_the_engine(engines: list[MockerEngine]) -> None:
    engine = MockerEngine(fast(), sink=BrokenSink())
    engines.append(engine)
    outs = await collect(engine, req(list(range(40)), max_tokens=5))
    assert outs[-1].finish_reason is FinishReason.LENGTH


async def test_a_bug_in_the_loop_ends_streams_with_error(engines: list[MockerEngine]) -> None:
    engine = MockerEngine(fast(), sampler=BrokenSampler())
    engines.append(engine)
    outs = await asyncio.wait_for(collect(engine, req(list(range(40)), max_tokens=5)), 5)
    assert outs[-1].finish_reason is FinishReason.ERROR
    assert "bug in a sampler" in (outs[-1].error or "")
    late = await collect(engine, req([1, 2, 3]))
    assert late[-1].finish_reason is FinishReason.ERROR


async def test_steady_load_reports_while_idle(engines: list[MockerEngine]) -> None:
    sink = RecordingSink()
    engine = MockerEngine(fast(load_report_interval_s=0.02), sink=sink)
    engines.append(engine)
    started = time.monotonic()
    await engine.start()
    await eventually(lambda: len(sink.loads) >= 4, what="4 load reports")
    # The rate is under test: no more reports than intervals elapsed (plus the first one).
    assert len(sink.loads) <= (time.monotonic() - started) / 0.02 + 2
    assert all(r.num_running == 0 and r.total_kv_blocks == 256 for r in sink.loads)


async def test_generate_after_stop_is_an_error(engines: list[MockerEngine]) -> None:
    engine = MockerEngine(fast())
    await engine.start()
    await engine.stop()
    outs = await collect(engine, req([1, 2, 3]))
    assert outs[-1].finish_reason is FinishReason.ERROR
    with pytest.raises(RuntimeError, match="stopped"):
        await engine.start()
