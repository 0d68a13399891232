"""The admission controller on its own: limits, priority order, timeouts on a fake clock,
cancellation, bounded memory."""

from __future__ import annotations

import asyncio

import pytest
from tests.frontend.fake_clock import FakeClock

from turnout.errors import ConfigError, FrontendOverloaded
from turnout.frontend.admission.limiter import AdmissionController, AdmissionLimits, Ticket


def controller(clock: FakeClock, **limits: object) -> AdmissionController:
    return AdmissionController(AdmissionLimits(**limits), clock=clock)  # type: ignore[arg-type]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_admits_at_once_below_the_limit_and_counts() -> None:
    ctl = controller(FakeClock(), max_inflight=2, queue_size=0)
    a = await ctl.acquire("m")
    b = await ctl.acquire("m")
    assert (ctl.inflight, a.waited, b.waited) == (2, 0.0, 0.0)
    with pytest.raises(FrontendOverloaded) as info:
        await ctl.acquire("m")
    assert info.value.reason == "queue_full"
    a.release()
    a.release()  # idempotent
    assert ctl.inflight == 1
    (await ctl.acquire("m")).release()
    b.release()
    assert ctl.inflight == 0


async def test_priority_then_arrival_order() -> None:
    clock = FakeClock()
    ctl = controller(clock, max_inflight=1, queue_size=10)
    first = await ctl.acquire("m")
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        ticket = await ctl.acquire("m", priority)
        order.append(name)
        ticket.release()

    tasks = []
    for name, priority in [("low", -1), ("a0", 0), ("hi", 5), ("b0", 0), ("hi2", 5)]:
        tasks.append(asyncio.create_task(wait(name, priority)))
        await settle()
    assert ctl.queued == 5
    clock.advance(3)
    first.release()
    await asyncio.gather(*tasks)
    assert order == ["hi", "hi2", "a0", "b0", "low"]
    assert (ctl.inflight, ctl.queued, clock.pending) == (0, 0, 0)


async def test_queue_timeout_on_the_injected_clock() -> None:
    clock = FakeClock()
    ctl = controller(clock, max_inflight=1, queue_size=4, queue_timeout=10.0)
    held = await ctl.acquire("m")
    waiter = asyncio.create_task(ctl.acquire("m"))
    await settle()
    clock.advance(9.9)
    await settle()
    assert not waiter.done()
    clock.advance(0.2)
    with pytest.raises(FrontendOverloaded) as info:
        await waiter
    assert info.value.reason == "queue_timeout"
    assert info.value.waited == pytest.approx(10.1)
    assert "--queue-timeout" in str(info.value)
    assert ctl.queued == 0
    held.release()
    assert ctl.inflight == 0


async def test_waited_time_is_reported_on_admission() -> None:
    clock = FakeClock()
    ctl = controller(clock, max_inflight=1, queue_size=4)
    held = await ctl.acquire("m")
    waiter = asyncio.create_task(ctl.acquire("m"))
    await settle()
    clock.advance(2.5)
    held.release()
    ticket = await waiter
    assert ticket.waited == pytest.approx(2.5)
    ticket.release()


async def test_cancelled_waiter_leaves_the_queue_at_once() -> None:
    clock = FakeClock()
    ctl = controller(clock, max_inflight=1, queue_size=1)
    held = await ctl.acquire("m")
    waiter = asyncio.create_task(ctl.acquire("m"))
    await settle()
    assert ctl.queued == 1
    waiter.cancel()
    await settle()
    assert (ctl.queued, clock.pending) == (0, 0)
    # Its place is free: another request can wait.
    again = asyncio.create_task(ctl.acquire("m"))
    await settle()
    assert ctl.queued == 1
    held.release()
    (await again).release()
    assert ctl.inflight == 0


async def test_waiter_cancelled_in_the_instant_it_is_granted_gives_the_slot_back() -> None:
    ctl = controller(FakeClock(), max_inflight=1, queue_size=1)
    held = await ctl.acquire("m")
    waiter = asyncio.create_task(ctl.acquire("m"))
    await settle()
    held.release()  # grants the waiter's future ...
    waiter.cancel()  # ... but its task is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (ctl.inflight, ctl.queued) == (0, 0)


async def test_full_queue_higher_priority_displaces_the_last_waiter() -> None:
    ctl = controller(FakeClock(), max_inflight=1, queue_size=2)
    held = await ctl.acquire("m")
    a = asyncio.create_task(ctl.acquire("m", 0))
    await settle()
    b = asyncio.create_task(ctl.acquire("m", 0))
    await settle()
    # Same priority as the last waiter: the newcomer is the one rejected.
    with pytest.raises(FrontendOverloaded) as info:
        await ctl.acquire("m", 0)
    assert info.value.reason == "queue_full"
    urgent = asyncio.create_task(ctl.acquire("m", 1))
    await settle()
    with pytest.raises(FrontendOverloaded):
        await b  # the newest of the lowest priority made room
    assert ctl.queued == 2
    held.release()
    first = await urgent
    first.release()
    (await a).release()
    assert ctl.inflight == 0


async def test_per_model_limit_queues_then_rejects_with_model_limit() -> None:
    clock = FakeClock()
    ctl = controller(clock, max_inflight=10, max_inflight_per_model=1, queue_size=4)
    hot = await ctl.acquire("hot")
    waiting_hot = asyncio.create_task(ctl.acquire("hot"))
    await settle()
    # Another model is not held back by the hot one's waiters.
    cold = await ctl.acquire("cold")
    assert ctl.model_inflight("cold") == 1
    clock.advance(31)
    with pytest.raises(FrontendOverloaded) as info:
        await waiting_hot
    assert info.value.reason == "model_limit"
    assert "--max-inflight-per-model" in str(info.value)
    # With no queue, the model limit rejects at once.
    ctl2 = controller(clock, max_inflight=10, max_inflight_per_model=1, queue_size=0)
    t = await ctl2.acquire("x")
    with pytest.raises(FrontendOverloaded) as info:
        await ctl2.acquire("x")
    assert info.value.reason == "model_limit"
    t.release()
    hot.release()
    cold.release()
    # Counters of idle models are dropped: memory follows the models in flight.
    assert ctl._per_model == {}


async def test_model_limit_does_not_block_other_models_waiting_behind() -> None:
    ctl = controller(FakeClock(), max_inflight=2, max_inflight_per_model=1, queue_size=4)
    a1 = await ctl.acquire("a")
    b1 = await ctl.acquire("b")
    a2 = asyncio.create_task(ctl.acquire("a", 9))  # first in line, but model a stays full
    await settle()
    c1 = asyncio.create_task(ctl.acquire("c"))
    await settle()
    b1.release()  # a frontend slot frees: a2 cannot use it (a is at 1), c1 can
    c = await c1
    assert not a2.done()
    a1.release()
    a = await a2
    for ticket in (a, c):
        ticket.release()
    assert (ctl.inflight, ctl.queued) == (0, 0)


async def test_unlimited_inflight() -> None:
    ctl = controller(FakeClock(), max_inflight=0, queue_size=0)
    tickets: list[Ticket] = [await ctl.acquire("m") for _ in range(5000)]
    assert ctl.inflight == 5000
    for ticket in tickets:
        ticket.release()
    assert ctl.inflight == 0


async def test_memory_is_bounded_under_offered_load() -> None:
    clock = FakeClock()
    ctl = controller(clock, max_inflight=4, queue_size=8)
    held = [await ctl.acquire("m") for _ in range(4)]
    tasks = [asyncio.create_task(ctl.acquire("m", i % 3)) for i in range(2000)]
    await settle()
    assert ctl.queued == 8
    assert clock.pending == 8
    assert sum(t.done() for t in tasks) == 2000 - 8
    for t in tasks:
        if t.done():
            assert isinstance(t.exception(), FrontendOverloaded)
    waiting = [t for t in tasks if not t.done()]
    for ticket in held:
        ticket.release()
    while waiting:  # each release admits the next waiter
        await settle()
        admitted = [t for t in waiting if t.done()]
        assert admitted
        for t in admitted:
            t.result().release()
        waiting = [t for t in waiting if not t.done()]
    assert (ctl.inflight, ctl.queued, clock.pending) == (0, 0, 0)


async def test_close_rejects_waiters() -> None:
    ctl = controller(FakeClock(), max_inflight=1, queue_size=2)
    held = await ctl.acquire("m")
    waiter = asyncio.create_task(ctl.acquire("m"))
    await settle()
    ctl.close()
    with pytest.raises(FrontendOverloaded):
        await waiter
    held.release()


@pytest.mark.parametrize(
    ("limits", "flag"),
    [
        ({"max_inflight": -1}, "--max-inflight"),
        ({"max_inflight_per_model": -2}, "--max-inflight-per-model"),
        ({"queue_size": -1}, "--queue-size"),
        ({"queue_timeout": 0.0}, "--queue-timeout"),
        ({"queue_timeout": float("nan")}, "--queue-timeout"),
    ],
)
def test_bad_limits_name_the_flag(limits: dict[str, object], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        AdmissionController(AdmissionLimits(**limits))  # type: ignore[arg-type]
