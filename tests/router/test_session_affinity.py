"""Session affinity: bindings, their lifetime and caps, on a fake clock and a fake router."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from tests.polling import eventually

from turnout.errors import NoInstanceAvailable, RequestError, StreamBroken
from turnout.llm.migration import Migration
from turnout.protocols.llm import FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.router.push_router import PIN_PARAM
from turnout.router.session_affinity import (
    AFFINITY_METADATA,
    MAX_TTL_S,
    BindingState,
    SessionAffinityRouter,
    SessionTable,
)
from turnout.runtime.context import AVOID_METADATA, RequestContext

TTL = 60.0


class Clock:
    def __init__(self) -> None:
        self.time = 1000.0

    def __call__(self) -> float:
        return self.time


class FakeRouter:
    """Round-robin over ``live`` unless the request is pinned; records where each request
    went. ``hold`` keeps a request's stream open until its event is set; ``unreachable``
    instances fail pinned requests as the real routers do; ``break_after`` breaks a stream
    on that instance after that many tokens."""

    def __init__(self, live: list[int]) -> None:
        self.live = live
        self.next = 0
        self.calls: list[tuple[int, PreprocessedRequest]] = []
        self.hold: asyncio.Event | None = None
        self.unreachable: set[int] = set()
        self.break_after: dict[int, int] = {}
        self.fail_unpinned: Exception | None = None
        #: Instances that refuse every request as ``overloaded``.
        self.refuse: set[int] = set()

    def instance_ids(self) -> list[int]:
        return sorted(self.live)

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        target = request.backend_instance_id
        if target is None:
            if self.fail_unpinned is not None:
                raise self.fail_unpinned
            live = self.instance_ids()
            target = live[self.next % len(live)]
            self.next += 1
        elif target in self.unreachable:
            raise NoInstanceAvailable(f"instance {target:x} is unreachable")
        self.calls.append((target, request))
        ctx.metadata["worker_instance_id"] = target
        if self.hold is not None:
            await self.hold.wait()
        if target in self.refuse:
            yield LLMEngineOutput(
                finish_reason=FinishReason.ERROR, error="full", error_kind="overloaded"
            )
            return
        limit = self.break_after.get(target)
        for i in range(3):
            if limit is not None and i == limit:
                raise StreamBroken(f"instance {target:x} died")
            yield LLMEngineOutput(token_ids=[target * 100 + len(request.token_ids) + i])
        yield LLMEngineOutput(finish_reason=FinishReason.STOP)


def make(
    live: list[int], *, max_sessions: int = 100, bind_wait_s: float = 30.0
) -> tuple[SessionAffinityRouter, FakeRouter, Clock]:
    clock = Clock()
    fake = FakeRouter(live)
    table = SessionTable(TTL, max_sessions=max_sessions, clock=clock)
    return SessionAffinityRouter(fake.generate, table, fake, bind_wait_s=bind_wait_s), fake, clock


def req(
    session: str | None = "s", pin: int | None = None, lora: str | None = None
) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m", token_ids=[1, 2, 3], session_id=session, backend_instance_id=pin, lora_name=lora
    )


async def run(router: SessionAffinityRouter, request: PreprocessedRequest) -> int:
    """Serve ``request`` to the end; returns the instance that served it."""
    ctx = RequestContext("r")
    async for _ in router.generate(request, ctx):
        pass
    return int(ctx.metadata["worker_instance_id"])


async def test_session_sticks_over_many_turns_while_others_spread() -> None:
    router, fake, clock = make([1, 2, 3])
    first = await run(router, req("a"))
    for _ in range(20):
        clock.time += TTL / 2
        assert await run(router, req("a")) == first
    others = {await run(router, req(f"other-{i}")) for i in range(6)}
    assert others == {1, 2, 3}
    # The pin was the router's, on the copy it got; the client's request carried none.
    assert all(r.backend_instance_id in (None, first) for _, r in fake.calls)


async def test_an_adapters_requests_bind_apart_from_the_base_models() -> None:
    router, _, _ = make([1, 2])
    assert await run(router, req("a")) == 1
    assert await run(router, req("a", lora="tuned")) == 2
    assert await run(router, req("a")) == 1
    assert await run(router, req("a", lora="tuned")) == 2


async def test_no_session_id_is_routed_unbound() -> None:
    router, _, _ = make([1, 2])
    assert [await run(router, req(None)) for _ in range(4)] == [1, 2, 1, 2]
    assert len(router.table) == 0


async def test_binding_expires_after_the_idle_ttl() -> None:
    router, _, clock = make([1, 2])
    assert await run(router, req("a")) == 1
    clock.time += TTL - 0.001
    assert await run(router, req("a")) == 1  # refreshed: idle again from now
    clock.time += TTL + 0.001
    assert router.table.get("a") is None
    assert await run(router, req("a")) == 2  # routed afresh (round-robin moved on)


async def test_binding_never_expires_while_a_request_is_in_flight() -> None:
    router, fake, clock = make([1, 2])
    fake.hold = asyncio.Event()
    ctx = RequestContext("long")
    long = router.generate(req("a"), ctx)
    first = asyncio.ensure_future(anext(long))
    await asyncio.sleep(0)
    clock.time += 10 * TTL
    fake.hold.set()
    await first  # bound at its first output
    fake.hold = None
    clock.time += 10 * TTL
    binding = router.table.get("a")
    assert binding is not None and binding.state is BindingState.BOUND
    assert await run(router, req("a")) == 1  # still in flight: still bound
    async for _ in long:
        pass
    binding = router.table.get("a")
    assert binding is not None and binding.state is BindingState.IDLE
    clock.time += TTL + 1
    assert router.table.get("a") is None


async def test_concurrent_first_requests_wait_for_the_first_decision() -> None:
    router, fake, _ = make([1, 2, 3, 4])
    fake.hold = asyncio.Event()
    tasks = [asyncio.ensure_future(run(router, req("a"))) for _ in range(8)]
    await eventually(lambda: len(fake.calls) == 1, what="the first request routed")
    # Time under test: for a while, nothing else is routed (the others wait for the first).
    await asyncio.sleep(0.01)
    assert len(fake.calls) == 1
    fake.hold.set()
    assert set(await asyncio.gather(*tasks)) == {1}


async def test_a_waiter_routes_afresh_when_the_first_request_fails() -> None:
    router, fake, _ = make([1, 2])
    gate = asyncio.Event()

    async def slow_fail(
        request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        await gate.wait()
        raise NoInstanceAvailable("nothing up yet")
        yield  # an async generator, like a router's generate

    router._inner = slow_fail  # the first request's routing fails after a while
    first = asyncio.ensure_future(run(router, req("a")))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(run(router, req("a")))  # waits for the first
    await asyncio.sleep(0)
    router._inner = fake.generate
    gate.set()
    with pytest.raises(NoInstanceAvailable):
        await first
    assert await second == 1
    binding = router.table.get("a")
    assert binding is not None and binding.instance_id == 1


async def test_waiting_for_the_first_decision_is_bounded() -> None:
    router, fake, _ = make([1, 2], bind_wait_s=0.0)
    fake.hold = asyncio.Event()
    first = asyncio.ensure_future(run(router, req("a")))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(run(router, req("a")))
    await eventually(lambda: len(fake.calls) == 2, what="the second routed without waiting")
    fake.hold.set()
    assert await first == 1
    assert await second == 2  # gave up waiting: routed without the binding


async def test_instance_leaving_discovery_frees_the_binding() -> None:
    router, fake, _ = make([1, 2])
    assert await run(router, req("a")) == 1
    fake.live.remove(1)
    assert await run(router, req("a")) == 2
    assert await run(router, req("a")) == 2  # re-bound
    assert router.table.num_rebound == 1


async def test_unreachable_instance_frees_the_binding_and_the_request_reroutes() -> None:
    router, fake, _ = make([1, 2])
    assert await run(router, req("a")) == 1
    fake.unreachable.add(1)  # still listed as live, but a pinned request cannot reach it
    assert await run(router, req("a")) == 2
    # The pinned attempt failed; the fresh one went unpinned and bound where it landed.
    assert fake.calls[-1][1].backend_instance_id is None
    assert await run(router, req("a")) == 2
    assert router.table.num_rebound == 1


async def test_explicit_pin_to_another_instance_is_a_400() -> None:
    router, _, _ = make([1, 2])
    assert await run(router, req("a")) == 1
    with pytest.raises(RequestError) as info:
        await run(router, req("a", pin=2))
    assert info.value.param == PIN_PARAM
    assert await run(router, req("a", pin=1)) == 1  # the same instance is fine


async def test_explicit_pin_binds_a_new_session() -> None:
    router, _, _ = make([1, 2])
    assert await run(router, req("a", pin=2)) == 2
    assert await run(router, req("a")) == 2


async def test_idle_sessions_are_evicted_least_recently_used_first() -> None:
    router, _, clock = make([1, 2, 3], max_sessions=2)
    await run(router, req("a"))
    clock.time += 1
    await run(router, req("b"))
    clock.time += 1
    await run(router, req("a"))  # a is now the most recently idle
    await run(router, req("c"))  # evicts b
    assert router.table.get("b") is None
    assert router.table.get("a") is not None and router.table.get("c") is not None
    assert len(router.table) == 2


async def test_a_table_full_of_busy_sessions_routes_new_ones_unbound() -> None:
    router, fake, _ = make([1, 2, 3], max_sessions=2)
    fake.hold = asyncio.Event()
    busy = [asyncio.ensure_future(run(router, req(s))) for s in ("a", "b")]
    await eventually(lambda: len(fake.calls) == 2, what="sessions a and b routed")
    third = asyncio.ensure_future(run(router, req("c")))
    await eventually(lambda: len(fake.calls) == 3, what="session c routed")
    fake.hold.set()
    await asyncio.gather(*busy, third)
    assert router.table.num_refused == 1
    assert router.table.get("c") is None
    assert len(router.table) == 2


async def test_a_broken_stream_frees_the_binding_and_migration_rebinds() -> None:
    """The affinity pin is not on the request migration holds, so it migrates."""
    router, fake, _ = make([1, 2])
    assert await run(router, req("a")) == 1
    fake.break_after[1] = 2
    migration = Migration(router.generate, migration_limit=3)
    ctx = RequestContext("m")
    tokens = [t async for out in migration.generate(req("a"), ctx) for t in out.token_ids]
    assert ctx.metadata["migrations"] == 1
    assert tokens[:2] == [103, 104]  # two tokens from 1, then the rest from 2
    assert len(tokens) == 5 and all(t // 100 == 2 for t in tokens[2:])
    assert AFFINITY_METADATA not in ctx.metadata  # the continuation was routed afresh
    binding = router.table.get("a")
    assert binding is not None and binding.instance_id == 2


def test_table_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="TTL"):
        SessionTable(0)
    with pytest.raises(ValueError, match="TTL"):
        SessionTable(MAX_TTL_S + 1)
    with pytest.raises(ValueError, match="max_sessions"):
        SessionTable(1.0, max_sessions=0)


async def test_an_overloaded_refusal_binds_nothing() -> None:
    router, fake, _ = make([1, 2])
    fake.refuse.add(1)
    async for _ in router.generate(req("a"), RequestContext("r")):
        pass
    assert fake.calls[-1][0] == 1
    assert router.table.get("a") is None  # the next request of the session routes afresh
    assert await run(router, req("a")) == 2
    assert await run(router, req("a")) == 2


async def test_a_request_sent_away_from_its_bound_instance_is_not_pinned_there() -> None:
    """Migration retries a request elsewhere before its first token (its instance failed it
    or refused it): the binding does not pin it back, and the binding stays."""
    router, fake, _ = make([1, 2])
    assert await run(router, req("a")) == 1
    ctx = RequestContext("r")
    ctx.metadata[AVOID_METADATA] = {1}
    async for _ in router.generate(req("a"), ctx):
        pass
    assert fake.calls[-1][1].backend_instance_id is None
    assert ctx.metadata["worker_instance_id"] == 2
    assert await run(router, req("a")) == 1
