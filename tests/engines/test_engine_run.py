"""``EngineRun``: an engine stream stepped in the handler's own task, in batches of what was
ready, with a task's cancellation semantics and the worker's early end (``fail``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from turnout.engines.engine_run import MAX_BATCH, EngineRun
from turnout.protocols.llm import ErrorKind, FinishReason, LLMEngineOutput

FINAL = LLMEngineOutput(
    finish_reason=FinishReason.ERROR, error="engine failed", error_kind=ErrorKind.ENGINE_FAILED
)


def out(token: int) -> LLMEngineOutput:
    return LLMEngineOutput(token_ids=[token])


def render(outputs: list[LLMEngineOutput]) -> list[bytes]:
    """One item per batch naming its outputs' tokens (``-1``: one without tokens)."""
    return [b",".join(str(o.token_ids[0] if o.token_ids else -1).encode() for o in outputs)]


class Engine:
    """A scripted engine: ``steps`` of outputs, each step after a wait on a future the test
    resolves (``release``); records how it ended."""

    def __init__(self) -> None:
        self.gate: asyncio.Future[None] | None = None
        self.ended: str | None = None

    def release(self) -> None:
        assert self.gate is not None
        self.gate.set_result(None)

    async def wait(self) -> None:
        self.gate = asyncio.get_running_loop().create_future()
        await self.gate

    async def steps(self, steps: list[list[int]]) -> AsyncIterator[LLMEngineOutput]:
        try:
            for i, tokens in enumerate(steps):
                if i:
                    await self.wait()
                for token in tokens:
                    yield out(token)
            self.ended = "done"
        except asyncio.CancelledError:
            self.ended = "cancelled"
            await asyncio.sleep(0)  # cleanup that waits, as an engine's may
            raise


async def next_item(items: AsyncIterator[bytes]) -> bytes:
    async with asyncio.timeout(5):
        return await anext(items)


async def test_outputs_ready_together_form_one_batch_then_one_per_wait() -> None:
    engine = Engine()
    runs: set[EngineRun] = set()
    items = EngineRun(engine.steps([[1, 2, 3], [4], [5, 6]]), render, runs).items()
    assert await next_item(items) == b"1,2,3"
    assert len(runs) == 1
    engine.release()
    assert await next_item(items) == b"4"
    engine.release()
    assert await next_item(items) == b"5,6"
    with pytest.raises(StopAsyncIteration):
        await anext(items)
    assert engine.ended == "done" and not runs


async def test_an_engine_that_never_waits_is_cut_into_bounded_batches() -> None:
    n = MAX_BATCH * 2 + 3
    items = EngineRun(Engine().steps([list(range(n))]), render, set()).items()
    sizes = [len(item.split(b",")) async for item in items]
    assert sizes == [MAX_BATCH, MAX_BATCH, 3]


async def test_fail_while_the_engine_waits_forever_ends_with_the_final_output() -> None:
    engine = Engine()
    runs: set[EngineRun] = set()
    run = EngineRun(engine.steps([[1], [2]]), render, runs)
    items = run.items()
    assert await next_item(items) == b"1"
    pending = asyncio.ensure_future(next_item(items))
    await asyncio.sleep(0)  # parked on the engine's gate, which never opens
    run.fail(FINAL)
    assert await pending == b"-1"
    assert engine.ended == "cancelled"
    with pytest.raises(StopAsyncIteration):
        await anext(items)
    assert not runs


async def test_fail_stops_an_engine_that_only_yields_bare() -> None:
    stopped = asyncio.Event()

    async def spinning() -> AsyncIterator[LLMEngineOutput]:
        yield out(1)
        try:
            while True:
                await asyncio.sleep(0)
        finally:
            stopped.set()

    run = EngineRun(spinning(), render, set())
    items = run.items()
    assert await next_item(items) == b"1"
    pending = asyncio.ensure_future(next_item(items))
    await asyncio.sleep(0)
    run.fail(FINAL)
    assert await pending == b"-1"
    assert stopped.is_set()


async def test_fail_while_a_batch_is_out_sends_the_final_output_next() -> None:
    engine = Engine()
    run = EngineRun(engine.steps([[1], [2]]), render, set())
    items = run.items()
    assert await next_item(items) == b"1"  # the engine's next step waits meanwhile
    run.fail(FINAL)
    assert await next_item(items) == b"-1"
    assert engine.ended == "cancelled"


async def test_cancelling_the_consumer_cancels_the_engine_where_it_waits() -> None:
    engine = Engine()
    runs: set[EngineRun] = set()
    items = EngineRun(engine.steps([[1], [2]]), render, runs).items()
    assert await next_item(items) == b"1"
    pending = asyncio.ensure_future(anext(items))
    await asyncio.sleep(0)
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    assert engine.ended == "cancelled"
    assert not runs


async def test_closing_mid_step_runs_the_engine_cleanup_to_its_end() -> None:
    engine = Engine()
    runs: set[EngineRun] = set()
    items = EngineRun(engine.steps([[1], [2]]), render, runs).items()
    assert await next_item(items) == b"1"
    await items.aclose()  # type: ignore[attr-defined]
    assert engine.ended == "cancelled"
    assert not runs


async def test_an_engine_error_comes_after_the_outputs_before_it() -> None:
    async def failing() -> AsyncIterator[LLMEngineOutput]:
        yield out(1)
        yield out(2)
        raise RuntimeError("boom")

    items = EngineRun(failing(), render, set()).items()
    assert await next_item(items) == b"1,2"
    with pytest.raises(RuntimeError, match="boom"):
        await anext(items)
