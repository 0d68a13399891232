"""Migration's deadlines, stall detection and engine error kinds, against scripted streams.

The scripted streams yield their outputs without suspending, so a watchdog can only fire
where a script deliberately hangs: the tests do not depend on how fast the machine is.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from tests.polling import eventually

from turnout.errors import (
    EngineBadRequest,
    EngineOverloaded,
    NoInstanceAvailable,
    RequestTimedOut,
    StreamBroken,
)
from turnout.llm.migration import FIRST_TOKEN_RETRIES, Migration
from turnout.protocols.llm import (
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    StopConditions,
    StructuredOutput,
)
from turnout.runtime.context import AVOID_METADATA, RequestContext

HANG = object()


class Script:
    """Per attempt, a list of outputs (``HANG``: wait forever). Records what it was sent."""

    def __init__(self, *attempts: list[object]) -> None:
        self.attempts = list(attempts)
        self.requests: list[PreprocessedRequest] = []
        self.closed = 0

    async def __call__(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        n = len(self.requests)
        if n >= len(self.attempts):  # as a router with no instance left to try
            raise NoInstanceAvailable("no live instance left")
        self.requests.append(request)
        ctx.metadata["worker_instance_id"] = 100 + n
        try:
            for item in self.attempts[n]:
                if item is HANG:
                    await asyncio.get_running_loop().create_future()
                assert isinstance(item, LLMEngineOutput)
                yield item
        finally:
            self.closed += 1


def tok(*ids: int, finish: FinishReason | None = None) -> LLMEngineOutput:
    return LLMEngineOutput(token_ids=list(ids), finish_reason=finish)


def err(kind: ErrorKind, message: str = "boom") -> LLMEngineOutput:
    return LLMEngineOutput(finish_reason=FinishReason.ERROR, error=message, error_kind=kind.value)


def request(max_tokens: int = 3, timeout: float | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m",
        token_ids=[7, 8],
        stop_conditions=StopConditions(max_tokens=max_tokens),
        request_timeout=timeout,
    )


async def collect(migration: Migration, req: PreprocessedRequest) -> list[int]:
    out: list[int] = []
    stream = migration.generate(req, RequestContext("r"))
    try:
        async for output in stream:
            out.extend(output.token_ids)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    return out


async def test_a_stalled_stream_migrates_keeping_its_tokens() -> None:
    script = Script([tok(1), tok(2), HANG], [tok(3, finish=FinishReason.LENGTH)])
    down: list[int] = []
    migration = Migration(script, migration_limit=2, stall_timeout=0.05, report_down=down.append)
    assert await collect(migration, request()) == [1, 2, 3]
    assert down == [100]
    second = script.requests[1]
    assert second.token_ids == [7, 8, 1, 2]
    assert second.stop_conditions.max_tokens == 1
    assert script.closed == 2


async def test_no_first_token_within_ttft_migrates() -> None:
    script = Script([HANG], [tok(1), tok(2), tok(3, finish=FinishReason.LENGTH)])
    down: list[int] = []
    migration = Migration(script, migration_limit=1, ttft_timeout=0.05, report_down=down.append)
    assert await collect(migration, request()) == [1, 2, 3]
    assert down == [100]


async def test_stalls_past_the_migration_limit_are_broken_streams() -> None:
    script = Script([tok(1), HANG], [HANG])
    migration = Migration(script, migration_limit=1, stall_timeout=0.05, ttft_timeout=0.05)
    with pytest.raises(StreamBroken, match=r"no output for 0\.05s"):
        await collect(migration, request())


async def test_the_deadline_cancels_the_work_and_raises() -> None:
    script = Script([tok(1), HANG])
    migration = Migration(script, migration_limit=3, request_timeout=0.05)
    with pytest.raises(RequestTimedOut, match=r"0\.05s deadline"):
        await collect(migration, request())
    assert script.closed == 1


async def test_a_request_timeout_may_shorten_the_default() -> None:
    script = Script([HANG])
    migration = Migration(script, migration_limit=3, request_timeout=3600)
    with pytest.raises(RequestTimedOut):
        await collect(migration, request(timeout=0.05))


async def test_a_request_timeout_cannot_lift_the_operators_deadline() -> None:
    script = Script([HANG])
    migration = Migration(script, migration_limit=3, request_timeout=0.05)
    with pytest.raises(RequestTimedOut, match=r"0\.05s deadline"):
        await collect(migration, request(timeout=3600))


async def test_a_slow_consumer_is_not_a_stall() -> None:
    script = Script([tok(1), tok(2), tok(3, finish=FinishReason.LENGTH)])
    migration = Migration(script, migration_limit=0, stall_timeout=0.02, ttft_timeout=0.02)
    got: list[int] = []
    stream = migration.generate(request(), RequestContext("r"))
    async for output in stream:
        got.extend(output.token_ids)
        await asyncio.sleep(0.05)  # longer than the stall timeout, outside the stream
    assert got == [1, 2, 3]
    assert len(script.requests) == 1


async def test_outside_cancellation_is_not_swallowed() -> None:
    script = Script([HANG])
    migration = Migration(script, migration_limit=3, stall_timeout=3600)
    task = asyncio.create_task(collect(migration, request()))
    await eventually(lambda: len(script.requests) == 1, what="the attempt hanging")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(script.requests) == 1


@pytest.mark.parametrize("timed", [False, True])
async def test_engine_failed_migrates_like_a_broken_stream(timed: bool) -> None:
    script = Script(
        [tok(1), err(ErrorKind.ENGINE_FAILED)], [tok(2), tok(3, finish=FinishReason.LENGTH)]
    )
    down: list[int] = []
    migration = Migration(
        script, migration_limit=1, report_down=down.append, stall_timeout=60 if timed else 0
    )
    assert await collect(migration, request()) == [1, 2, 3]
    assert down == [100]
    assert script.requests[1].token_ids == [7, 8, 1]


async def test_engine_failed_past_the_limit_is_a_broken_stream() -> None:
    script = Script([err(ErrorKind.ENGINE_FAILED, "loop died")])
    with pytest.raises(StreamBroken, match="loop died"):
        await collect(Migration(script, migration_limit=0), request())


async def test_a_bad_request_raises_and_never_migrates() -> None:
    script = Script([err(ErrorKind.BAD_REQUEST, "nope")], [tok(1, finish=FinishReason.LENGTH)])
    with pytest.raises(EngineBadRequest, match="nope"):
        await collect(Migration(script, migration_limit=3), request())
    assert len(script.requests) == 1


def test_negative_timeouts_are_refused() -> None:
    with pytest.raises(ValueError, match="stall_timeout"):
        Migration(Script(), migration_limit=1, stall_timeout=-1)


async def test_deadline_stream_bounds_a_plain_stream() -> None:
    from turnout.llm.migration import deadline_stream

    closed: list[bool] = []

    async def chunks() -> AsyncIterator[bytes]:
        try:
            yield b"a"
            await asyncio.get_running_loop().create_future()
        finally:
            closed.append(True)

    got: list[bytes] = []
    with pytest.raises(RequestTimedOut, match=r"\(1 chunks generated\)"):
        async for chunk in deadline_stream(chunks(), 0.05, RequestContext("r")):
            got.append(chunk)
    assert got == [b"a"] and closed == [True]


async def test_deadline_stream_passes_a_quick_stream_through() -> None:
    from turnout.llm.migration import deadline_stream

    async def chunks() -> AsyncIterator[int]:
        for i in range(3):
            yield i

    assert [i async for i in deadline_stream(chunks(), 60, RequestContext("r"))] == [0, 1, 2]


async def test_a_structured_output_that_began_does_not_migrate() -> None:
    """The next worker would start the grammar afresh after the generated prefix, and the
    whole would match nothing: the broken stream goes to the client instead."""
    script = Script(
        [tok(1), err(ErrorKind.ENGINE_FAILED, "died")], [tok(2, finish=FinishReason.STOP)]
    )
    req = request()
    req.structured = StructuredOutput(kind="choice", grammar='%llguidance {}\nstart: "a"')
    with pytest.raises(StreamBroken, match="died"):
        await collect(Migration(script, migration_limit=3), req)
    assert len(script.requests) == 1


async def test_a_structured_output_that_has_not_begun_migrates() -> None:
    script = Script([err(ErrorKind.ENGINE_FAILED)], [tok(2, finish=FinishReason.STOP)])
    req = request()
    req.structured = StructuredOutput(kind="choice", grammar='%llguidance {}\nstart: "a"')
    assert await collect(Migration(script, migration_limit=3), req) == [2]
    assert script.requests[1].token_ids == [7, 8]


async def test_a_stall_before_the_first_token_goes_elsewhere_without_a_migration() -> None:
    script = Script([HANG], [tok(1), tok(2), tok(3, finish=FinishReason.LENGTH)])
    down: list[int] = []
    migration = Migration(script, migration_limit=0, ttft_timeout=0.05, report_down=down.append)
    ctx = RequestContext("r")
    stream = migration.generate(request(), ctx)
    assert [t async for o in stream for t in o.token_ids] == [1, 2, 3]
    assert down == [100]
    assert ctx.metadata[AVOID_METADATA] == {100}  # the routers below leave it out
    assert "migrations" not in ctx.metadata
    assert script.requests[1].token_ids == [7, 8]  # the same request, from the start


async def test_a_stall_after_the_first_token_needs_the_migration_budget() -> None:
    script = Script([tok(1), HANG], [tok(2), tok(3, finish=FinishReason.LENGTH)])
    migration = Migration(script, migration_limit=0, stall_timeout=0.05)
    with pytest.raises(StreamBroken, match="stall"):
        await collect(migration, request())
    assert len(script.requests) == 1


async def test_a_failure_before_the_first_token_with_no_instance_left_is_that_failure() -> None:
    script = Script([err(ErrorKind.ENGINE_FAILED, "loop died")])
    with pytest.raises(StreamBroken, match="loop died"):
        await collect(Migration(script, migration_limit=3), request())
    assert len(script.requests) == 1


async def test_a_pinned_request_is_not_sent_elsewhere_before_its_first_token() -> None:
    script = Script([err(ErrorKind.OVERLOADED, "full")], [tok(1, finish=FinishReason.LENGTH)])
    req = request()
    req.backend_instance_id = 100
    with pytest.raises(EngineOverloaded, match="full"):
        await collect(Migration(script, migration_limit=3), req)
    assert len(script.requests) == 1


async def test_tokens_merged_into_an_error_output_reach_the_client_before_migrating() -> None:
    """A worker merges the last tokens before an error into the error output."""
    broken = LLMEngineOutput(
        token_ids=[1, 2],
        finish_reason=FinishReason.ERROR,
        error="died",
        error_kind=ErrorKind.ENGINE_FAILED.value,
    )
    script = Script([broken], [tok(3, finish=FinishReason.LENGTH)])
    assert await collect(Migration(script, migration_limit=1), request()) == [1, 2, 3]
    assert script.requests[1].token_ids == [7, 8, 1, 2]


async def test_an_engine_that_fails_every_prompt_costs_a_bounded_number_of_instances() -> None:
    """A prompt that crashes engines goes to 1 + FIRST_TOKEN_RETRIES instances without
    spending the budget, then spends it, never to every instance the routers have."""
    script = Script(*([err(ErrorKind.ENGINE_FAILED, "crash")] for _ in range(10)))
    down: list[int] = []
    with pytest.raises(StreamBroken, match="crash"):
        await collect(Migration(script, migration_limit=0, report_down=down.append), request())
    assert len(script.requests) == 1 + FIRST_TOKEN_RETRIES
    assert down == [100 + i for i in range(1 + FIRST_TOKEN_RETRIES)]

    script = Script(*([err(ErrorKind.ENGINE_FAILED, "crash")] for _ in range(10)))
    ctx = RequestContext("r")
    stream = Migration(script, migration_limit=2).generate(request(), ctx)
    with pytest.raises(StreamBroken, match="crash"):
        async for _ in stream:
            pass
    assert len(script.requests) == 1 + FIRST_TOKEN_RETRIES + 2
    assert ctx.metadata["migrations"] == 2
    # Each instance it was sent away from is avoided, the budgeted ones included.
    assert ctx.metadata[AVOID_METADATA] == {100 + i for i in range(FIRST_TOKEN_RETRIES + 2)}


async def test_a_prompt_slower_than_the_ttft_limit_everywhere_is_bounded() -> None:
    script = Script(*([HANG] for _ in range(10)))
    down: list[int] = []
    migration = Migration(script, migration_limit=0, ttft_timeout=0.01, report_down=down.append)
    with pytest.raises(StreamBroken, match="time to first token"):
        await collect(migration, request())
    assert len(script.requests) == 1 + FIRST_TOKEN_RETRIES
    assert down == [100 + i for i in range(1 + FIRST_TOKEN_RETRIES)]


async def test_refusals_before_the_first_token_spend_no_budget() -> None:
    refusals = [[err(ErrorKind.OVERLOADED, "full")] for _ in range(5)]
    script = Script(*refusals, [tok(1, finish=FinishReason.LENGTH)])
    busy: list[int] = []
    migration = Migration(script, migration_limit=0, report_busy=busy.append)
    assert await collect(migration, request()) == [1]
    assert busy == [100, 101, 102, 103, 104]


class Instances:
    """Routes like the routers below: the first instance not in the request's avoid list
    that has an attempt scripted (each attempt a list as in ``Script``)."""

    def __init__(self, scripts: dict[int, list[list[object]]]) -> None:
        self.scripts = scripts
        self.picked: list[int] = []

    async def __call__(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        avoid = ctx.metadata.get(AVOID_METADATA, ())
        free = [i for i, attempts in self.scripts.items() if attempts and i not in avoid]
        if not free:
            raise NoInstanceAvailable(f"no instance left (avoided: {sorted(avoid)})")
        instance = free[0]
        self.picked.append(instance)
        ctx.metadata["worker_instance_id"] = instance
        for item in self.scripts[instance].pop(0):
            assert isinstance(item, LLMEngineOutput)
            yield item


@pytest.mark.parametrize("timed", [False, True])
async def test_a_migration_after_the_first_token_may_go_where_it_was_refused(timed: bool) -> None:
    """A refused the request, B streamed then died: the migration goes to A, which has
    room now, rather than failing for want of an instance."""
    instances = Instances(
        {
            1: [[err(ErrorKind.OVERLOADED, "full")], [tok(2), tok(3, finish=FinishReason.LENGTH)]],
            2: [[tok(1), err(ErrorKind.ENGINE_FAILED, "died")]],
        }
    )
    migration = Migration(instances, migration_limit=1, stall_timeout=60 if timed else 0)
    ctx = RequestContext("r")
    stream = migration.generate(request(), ctx)
    assert [t async for o in stream for t in o.token_ids] == [1, 2, 3]
    assert instances.picked == [1, 2, 1]
    assert AVOID_METADATA not in ctx.metadata
