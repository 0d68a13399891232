"""Simulated LoRA adapters in the mocker: load on first use, the load's wait, LRU eviction of
idle adapters, adapter blocks hashed apart from base blocks, unknown adapters refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from tests.engines.mocker.test_mocker_engine import FakeClock, RecordingSink, fast, req

from turnout.engines.mocker import MockerConfig, MockerEngine
from turnout.engines.mocker.lora import AdapterState, Begin, LoraSlots, parse_lora_adapters
from turnout.errors import ConfigError
from turnout.protocols.kv import BlockStored
from turnout.protocols.llm import ErrorKind, FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.runtime.context import RequestContext


def lora_req(tokens: list[int], lora: str | None, max_tokens: int = 4) -> PreprocessedRequest:
    request = req(tokens, max_tokens=max_tokens)
    request.lora_name = lora
    return request


@pytest.fixture
async def stopped() -> AsyncIterator[list[MockerEngine]]:
    made: list[MockerEngine] = []
    yield made
    for engine in made:
        await engine.stop()


# -- the state machine ----------------------------------------------------------------------


def test_slots_evict_the_least_recently_used_idle_adapter() -> None:
    slots = LoraSlots({"a": None, "b": None, "c": None}, max_loras=2)
    assert slots.begin("a") == (Begin.LOAD, [])
    slots.finish_load("a")
    assert slots.begin("b") == (Begin.LOAD, [])
    slots.finish_load("b")
    slots.release("b", now=1.0)
    slots.release("a", now=2.0)  # a used last: b is the LRU one
    assert slots.begin("c") == (Begin.LOAD, ["b"])
    assert slots.state("b") is AdapterState.UNLOADED
    assert slots.num_resident == 2
    assert slots.begin("a") == (Begin.READY, [])


def test_slots_never_evict_an_adapter_in_use() -> None:
    slots = LoraSlots({"a": None, "b": None}, max_loras=1)
    assert slots.begin("a")[0] is Begin.LOAD
    assert slots.begin("a")[0] is Begin.WAIT_LOAD  # a second request waits for the same load
    slots.finish_load("a")
    assert slots.begin("b") == (Begin.FULL, [])  # a is held: nothing changes
    assert slots.loaded() == ["a"]
    slots.release("a", now=1.0)
    assert slots.begin("b") == (Begin.FULL, [])  # still held by the second request
    slots.release("a", now=2.0)
    assert slots.begin("b") == (Begin.LOAD, ["a"])
    assert slots.begin("zzz") == (Begin.UNKNOWN, [])


def test_parse_lora_adapters() -> None:
    assert parse_lora_adapters("a=/p/a, b,,c=") == {"a": "/p/a", "b": None, "c": None}
    assert parse_lora_adapters(None) == {}
    for bad in ("a/b", "a,a", " =x"):
        with pytest.raises(ConfigError, match="--lora-adapters"):
            parse_lora_adapters(bad)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"max_loras": 0}, "max_loras"),
        ({"lora_load_ms": -1.0}, "lora_load_ms"),
        ({"lora_adapters": {"a/b": None}}, "adapter name"),
    ],
)
def test_config_rejects_bad_lora_settings(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MockerConfig(**changes).validate()  # type: ignore[arg-type]


# -- the engine -----------------------------------------------------------------------------


async def first_output_at(
    engine: MockerEngine, request: PreprocessedRequest, clock: FakeClock
) -> tuple[float, list[LLMEngineOutput]]:
    outs: list[LLMEngineOutput] = []
    first = -1.0
    async for out in engine.generate(request, RequestContext()):
        if first < 0:
            first = clock.now
        outs.append(out)
    return first, outs


async def test_first_request_waits_the_load_and_the_listener_hears_it(
    stopped: list[MockerEngine],
) -> None:
    clock = FakeClock()
    config = MockerConfig(
        speedup_ratio=2.0,
        num_gpu_blocks=256,
        block_size=16,
        lora_adapters={"a": "/adapters/a"},
        lora_load_ms=800.0,
    )
    engine = MockerEngine(config, clock=clock, sleep=clock.sleep)
    stopped.append(engine)
    heard: list[tuple[str, bool, float]] = []
    engine.set_lora_listener(lambda name, loaded: heard.append((name, loaded, clock.now)))
    start = clock.now
    first, outs = await first_output_at(engine, lora_req(list(range(32)), "a"), clock)
    assert outs[-1].finish_reason is FinishReason.LENGTH
    # 800 ms at speedup 2: the adapter is loaded 0.4 s in, before the first token.
    assert heard == [("a", True, pytest.approx(start + 0.4))]
    assert first >= start + 0.4
    assert engine.loaded_loras() == ["a"]
    # Loaded: the next request does not wait for a load.
    again = clock.now
    first, _ = await first_output_at(engine, lora_req(list(range(100, 132)), "a"), clock)
    assert first - again < 0.4
    assert len(heard) == 1


async def test_max_loras_evicts_the_idle_lru_adapter(stopped: list[MockerEngine]) -> None:
    engine = MockerEngine(fast(lora_adapters={"a": None, "b": None, "c": None}, max_loras=2))
    stopped.append(engine)
    heard: list[tuple[str, bool]] = []
    engine.set_lora_listener(lambda name, loaded: heard.append((name, loaded)))
    for name in ("a", "b", "a", "c"):
        async for _ in engine.generate(lora_req([1] * 20, name), RequestContext()):
            pass
    assert heard == [("a", True), ("b", True), ("b", False), ("c", True)]
    assert engine.loaded_loras() == ["a", "c"]


async def test_a_request_waits_for_a_slot_held_by_another(stopped: list[MockerEngine]) -> None:
    engine = MockerEngine(
        MockerConfig(
            speedup_ratio=50.0,
            num_gpu_blocks=256,
            block_size=16,
            lora_adapters={"a": None, "b": None},
            max_loras=1,
        )
    )
    stopped.append(engine)
    stream_a = engine.generate(lora_req([1] * 20, "a", 50), RequestContext())
    await anext(aiter(stream_a))  # a is loaded, and held until its stream ends

    async def run_b() -> list[LLMEngineOutput]:
        return [o async for o in engine.generate(lora_req([2] * 20, "b"), RequestContext())]

    task_b = asyncio.create_task(run_b())
    await asyncio.sleep(0.05)  # time under test: for a while, b is not loaded beside a
    assert not task_b.done() and engine.loaded_loras() == ["a"]
    async for _ in stream_a:
        pass
    outs = await asyncio.wait_for(task_b, 10)
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert engine.loaded_loras() == ["b"]


async def test_adapter_blocks_never_match_base_blocks(stopped: list[MockerEngine]) -> None:
    sink = RecordingSink()
    engine = MockerEngine(fast(lora_adapters={"a": None}), sink=sink)
    stopped.append(engine)
    prompt = list(range(64))
    base = [o async for o in engine.generate(lora_req(prompt, None), RequestContext())]
    adapter = [o async for o in engine.generate(lora_req(prompt, "a"), RequestContext())]
    assert adapter[-1].usage is not None and adapter[-1].usage.cached_tokens == 0
    assert base[-1].usage is not None
    stored = [e.data for b in sink.batches for e in b.events if isinstance(e.data, BlockStored)]
    by_lora: dict[str | None, set[int]] = {}
    for event in stored:
        by_lora.setdefault(event.lora_name, set()).update(b.block_hash for b in event.blocks)
    assert by_lora.keys() == {None, "a"}
    assert not by_lora[None] & by_lora["a"]


async def test_an_adapter_the_worker_cannot_load_is_a_bad_request(
    stopped: list[MockerEngine],
) -> None:
    for engine in (MockerEngine(fast(lora_adapters={"a": None})), MockerEngine(fast())):
        stopped.append(engine)
        outs = [o async for o in engine.generate(lora_req([1] * 8, "nope"), RequestContext())]
        assert len(outs) == 1
        assert outs[0].finish_reason is FinishReason.ERROR
        assert outs[0].error_kind == ErrorKind.BAD_REQUEST.value
        assert "nope" in (outs[0].error or "")


async def test_closing_an_adapter_stream_aborts_it_and_releases_the_adapter(
    stopped: list[MockerEngine],
) -> None:
    engine = MockerEngine(fast(lora_adapters={"a": None, "b": None}, max_loras=1))
    stopped.append(engine)
    stream = engine.generate(lora_req(list(range(100)), "a", 10_000), RequestContext())
    async for out in stream:
        if out.token_ids:
            break
    (sched,) = engine.get_schedulers()
    assert sched.pool.num_used > 0
    await stream.aclose()  # type: ignore[attr-defined]
    assert sched.pool.num_used == 0 and not sched.has_work()
    # a is idle again: b may evict it at once.
    outs = [o async for o in engine.generate(lora_req([2] * 20, "b"), RequestContext())]
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert engine.loaded_loras() == ["b"]
