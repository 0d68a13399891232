"""Back-pressure in the mocker: a request whose stream is not read is paused (no steps, its
stream bounded), resumes when read, and ends exactly as an unpaused run would.

The scheduler half is driven synchronously (step, apply pauses, repeat); the engine half
through ``generate`` with a consumer that stops reading, polling the engine's state under a
deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.engines.mocker.replay import BS, ReplayModel

from turnout.engines.mocker import (
    STREAM_HIGH_WATER,
    STREAM_LOW_WATER,
    MockerConfig,
    MockerEngine,
    MockRequest,
    Scheduler,
)
from turnout.protocols.llm import (
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    StopConditions,
)
from turnout.runtime.context import RequestContext


def make_request(tokens: list[int], max_tokens: int) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="mock", token_ids=tokens, stop_conditions=StopConditions(max_tokens=max_tokens)
    )


def tokens_of(outs: list[LLMEngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


# ---- the scheduler ------------------------------------------------------------------------


def drain(
    sched: Scheduler, outs: dict[str, list[LLMEngineOutput]], max_steps: int = 10_000
) -> None:
    for _ in range(max_steps):
        if not sched.has_work():
            return
        for rid, out in sched.step().outputs:
            outs.setdefault(rid, []).append(out)
        sched.pool.check_invariants()
    raise AssertionError("scheduler did not drain")


def test_a_paused_request_gets_no_steps_keeps_its_blocks_and_resumes() -> None:
    sched = Scheduler(MockerConfig(num_gpu_blocks=64, block_size=BS))
    sched.add_request("a", make_request(list(range(20)), 40))
    sched.add_request("b", make_request(list(range(100, 120)), 40))
    outs: dict[str, list[LLMEngineOutput]] = {}
    for _ in range(5):
        for rid, out in sched.step().outputs:
            outs.setdefault(rid, []).append(out)
    a = sched.get_request("a")
    assert a is not None
    held = a.num_blocks_held
    assert sched.pause("a") and not sched.pause("a")  # a second pause is a no-op
    produced = a.num_output
    decodes = []
    for _ in range(10):
        result = sched.step()
        decodes.append(result.num_decodes)
        for rid, out in result.outputs:
            outs.setdefault(rid, []).append(out)
    assert a.num_output == produced and a.num_blocks_held == held
    assert decodes == [1] * 10  # only b decodes; a is not in the batch
    assert sched.get_load().num_running == 2 and sched.num_paused == 1
    assert sched.resume("a") and not sched.resume("a")
    drain(sched, outs)
    assert len(tokens_of(outs["a"])) == 40 and outs["a"][-1].finish_reason is FinishReason.LENGTH
    assert sched.num_paused == 0 and sched.pool.num_used == 0


def test_with_every_request_paused_there_is_no_work() -> None:
    sched = Scheduler(MockerConfig(num_gpu_blocks=64, block_size=BS))
    sched.add_request("a", make_request(list(range(20)), 40))
    sched.step()
    assert sched.pause("a")
    assert not sched.has_work()  # the engine's loop parks instead of stepping nothing
    sched.add_request("b", make_request(list(range(50, 70)), 4))
    assert sched.has_work()


def test_aborting_a_paused_request_frees_its_blocks() -> None:
    sched = Scheduler(MockerConfig(num_gpu_blocks=64, block_size=BS))
    sched.add_request("a", make_request(list(range(40)), 400))
    for _ in range(3):
        sched.step()
    assert sched.pause("a") and sched.pool.num_used > 0
    assert sched.abort("a")
    assert sched.pool.num_used == 0 and sched.num_paused == 0 and not sched.has_work()


def test_a_waiting_request_takes_the_slot_of_a_paused_one() -> None:
    """max_num_seqs=1: the paused request is preempted (recompute) so the next one runs; the
    paused one, passed over while paused, then finishes with the tokens it would have had."""
    cfg = MockerConfig(num_gpu_blocks=64, block_size=BS, max_num_seqs=1)
    alone = Scheduler(cfg)
    alone.add_request("a", make_request(list(range(20)), 30))
    expected: dict[str, list[LLMEngineOutput]] = {}
    drain(alone, expected)

    sched = Scheduler(cfg)
    sched.add_request("a", make_request(list(range(20)), 30))
    outs: dict[str, list[LLMEngineOutput]] = {}
    for _ in range(4):
        for rid, out in sched.step().outputs:
            outs.setdefault(rid, []).append(out)
    sched.pause("a")
    sched.add_request("b", make_request(list(range(200, 220)), 10))
    drain(sched, outs)  # b runs to the end although a holds the only slot
    assert outs["b"][-1].finish_reason is FinishReason.LENGTH
    a = sched.get_request("a")
    assert a is not None and a.num_preemptions == 1 and a.num_blocks_held == 0
    sched.resume("a")
    drain(sched, outs)
    assert tokens_of(outs["a"]) == tokens_of(expected["a"])


def test_a_paused_request_is_the_first_victim_when_blocks_run_out() -> None:
    # 7 blocks of 4 tokens: "old" holds 2 (its prompt), "new" ends needing 6 (23 computed).
    cfg = MockerConfig(num_gpu_blocks=7, block_size=BS, max_num_seqs=4)
    sched = Scheduler(cfg)
    sched.add_request("old", make_request(list(range(BS * 2)), 16))
    sched.add_request("new", make_request(list(range(100, 100 + BS * 2)), 16))
    outs: dict[str, list[LLMEngineOutput]] = {}
    for rid, out in sched.step().outputs:
        outs.setdefault(rid, []).append(out)
    assert sched.pause("old")
    drain(sched, outs)  # "new" grows until it needs the paused request's blocks
    old = sched.get_request("old")
    assert outs["new"][-1].finish_reason is FinishReason.LENGTH
    assert len(tokens_of(outs["new"])) == 16
    assert old is not None and old.num_preemptions == 1 and old.num_blocks_held == 0
    sched.resume("old")
    drain(sched, outs)
    assert len(tokens_of(outs["old"])) == 16
    assert sched.num_preemptions == 1  # never the unpaused one


@settings(max_examples=30, deadline=None)
@given(
    flips=st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=60),
    blocks=st.integers(8, 40),
)
def test_any_pauses_drain_to_the_unpaused_tokens_with_consistent_events(
    flips: list[tuple[int, bool]], blocks: int
) -> None:
    """Pausing and resuming at random, under memory pressure, never loses, repeats or changes
    a token, and the KV events always match the pool."""
    cfg = MockerConfig(num_gpu_blocks=blocks, block_size=BS, max_num_seqs=4)
    prompts = {f"r{i}": [i % 2] * 10 + [50 + i] * 6 for i in range(6)}

    def fresh() -> Scheduler:
        sched = Scheduler(cfg)
        for rid, prompt in prompts.items():
            assert sched.add_request(rid, make_request(prompt, 20)) is None
        return sched

    expected: dict[str, list[LLMEngineOutput]] = {}
    drain(fresh(), expected)

    sched = fresh()
    replay = ReplayModel()
    outs: dict[str, list[LLMEngineOutput]] = {}
    for which, pause in flips:
        rid = f"r{which}"
        if pause:
            sched.pause(rid)
        else:
            sched.resume(rid)
        if sched.has_work():
            for r, out in sched.step().outputs:
                outs.setdefault(r, []).append(out)
        sched.pool.check_invariants()
        replay.apply(sched.pool.take_events())
        assert replay.resident == sched.pool.get_resident_hashes()
    for rid in prompts:
        sched.resume(rid)
    drain(sched, outs)
    replay.apply(sched.pool.take_events())
    assert {r: tokens_of(o) for r, o in outs.items()} == {
        r: tokens_of(o) for r, o in expected.items()
    }
    assert sched.pool.num_used == 0 and sched.num_paused == 0


# ---- the engine ---------------------------------------------------------------------------


def config(**changes: object) -> MockerConfig:
    # A large speedup: simulated step times pass in microseconds.
    settings_: dict[str, object] = {"speedup_ratio": 1000.0, "num_gpu_blocks": 1024}
    return MockerConfig(**(settings_ | changes))  # type: ignore[arg-type]


async def until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll ``predicate`` under a deadline, yielding to the loop between looks."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


def the_request(engine: MockerEngine, ctx: RequestContext) -> MockRequest:
    """The scheduler's record of the request ``ctx`` names (internal ids add a suffix)."""
    (sched,) = engine.get_schedulers()
    for rid in sched.iter_request_ids():
        if rid.startswith(ctx.request_id + "#"):
            request = sched.get_request(rid)
            assert request is not None
            return request
    raise AssertionError(f"{ctx.request_id} is not in the scheduler")


async def read(stream: AsyncIterator[LLMEngineOutput], n: int) -> list[LLMEngineOutput]:
    return [await anext(stream) for _ in range(n)]


async def read_all(stream: AsyncIterator[LLMEngineOutput]) -> list[LLMEngineOutput]:
    return [out async for out in stream]


PROMPT = list(range(1, 41))
MAX_TOKENS = 1000


async def test_an_unread_stream_stops_its_request_at_the_bound(
    engines: list[MockerEngine],
) -> None:
    engine = MockerEngine(config(seed=7))
    engines.append(engine)
    reference = MockerEngine(config(seed=7))
    engines.append(reference)
    expected = await read_all(
        reference.generate(make_request(PROMPT, MAX_TOKENS), RequestContext())
    )

    ctx = RequestContext("stalled")
    stalled = engine.generate(make_request(PROMPT, MAX_TOKENS), ctx)
    first = await read(stalled, 3)  # then the consumer stops reading
    request = the_request(engine, ctx)
    await until(lambda: request.paused, "the stalled request to pause")
    assert request.num_output == 3 + STREAM_HIGH_WATER

    # Other requests on the same rank keep going, and finish, while it stays at the bound.
    others = await asyncio.gather(
        *(read_all(engine.generate(make_request([90 + i] * 30, 300), RequestContext()))
          for i in range(3))
    )  # fmt: skip
    assert all(len(tokens_of(o)) == 300 for o in others)
    assert request.num_output == 3 + STREAM_HIGH_WATER

    # With everything paused the loop parks: turns of the event loop, and no step is taken.
    steps = engine.get_stats().num_steps
    for _ in range(200):
        await asyncio.sleep(0)
    assert engine.get_stats().num_steps == steps

    # Reading resumes it; it ends with exactly max_tokens, the unpaused run's tokens.
    rest = await read_all(stalled)
    outs = first + rest
    assert tokens_of(outs) == tokens_of(expected) and len(tokens_of(outs)) == MAX_TOKENS
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == MAX_TOKENS
    (sched,) = engine.get_schedulers()
    assert sched.num_paused == 0 and sched.pool.num_used == 0


async def test_a_slow_reader_pauses_and_resumes_between_the_marks(
    engines: list[MockerEngine],
) -> None:
    engine = MockerEngine(config(seed=3))
    engines.append(engine)
    ctx = RequestContext("slow")
    stream = engine.generate(make_request(PROMPT, MAX_TOKENS), ctx)
    outs = await read(stream, 1)
    request = the_request(engine, ctx)
    await until(lambda: request.paused, "the request to pause")
    # Reading down to just above the low-water mark does not resume it...
    outs += await read(stream, STREAM_HIGH_WATER - STREAM_LOW_WATER - 1)
    assert request.paused
    # ...the next read does, and it runs until the stream is full again.
    outs += await read(stream, 1)
    assert not request.paused
    await until(lambda: request.paused, "the request to pause again")
    assert request.num_output == len(outs) + STREAM_HIGH_WATER
    outs += await read_all(stream)
    assert len(tokens_of(outs)) == MAX_TOKENS


@pytest.mark.parametrize("how", ["cancel", "aclose"])
async def test_cancelling_a_paused_request_frees_its_blocks(
    engines: list[MockerEngine], how: str
) -> None:
    engine = MockerEngine(config())
    engines.append(engine)
    (sched,) = engine.get_schedulers()
    ctx = RequestContext("stalled")
    stream = engine.generate(make_request(PROMPT, MAX_TOKENS), ctx)
    await read(stream, 1)
    request = the_request(engine, ctx)
    await until(lambda: request.paused, "the request to pause")
    assert sched.pool.num_used > 0 and not sched.has_work()  # the loop is parked
    if how == "cancel":
        ctx.cancel()  # the parked loop is woken and reaps it
        await until(lambda: sched.pool.num_used == 0, "the blocks to be freed")
        outs = await read_all(stream)
        assert outs[-1].finish_reason is FinishReason.CANCELLED
        assert len(outs) == STREAM_HIGH_WATER + 1
    else:
        await stream.aclose()  # type: ignore[attr-defined]
        assert sched.pool.num_used == 0  # at once, not at the next step
    assert sched.num_paused == 0 and sched.get_load().num_running == 0


async def test_a_paused_request_does_not_keep_its_slot_from_a_new_one(
    engines: list[MockerEngine],
) -> None:
    engine = MockerEngine(config(max_num_seqs=1))
    engines.append(engine)
    ctx = RequestContext("stalled")
    stalled = engine.generate(make_request(PROMPT, MAX_TOKENS), ctx)
    first = await read(stalled, 1)
    request = the_request(engine, ctx)
    await until(lambda: request.paused, "the request to pause")
    other = await read_all(engine.generate(make_request([7] * 30, 50), RequestContext()))
    assert len(tokens_of(other)) == 50
    assert request.num_preemptions == 1
    outs = first + await read_all(stalled)
    assert len(tokens_of(outs)) == MAX_TOKENS
