"""Busy instances: one that answered ``overloaded``, or whose load reports say it is busy, is
left out of the push router's candidates for a while (round-robin and random included), on
an injected clock; and migration reports the refusal and sends the request elsewhere."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import pytest
from tests.polling import eventually

from turnout.errors import EngineOverloaded, NoInstanceAvailable
from turnout.llm.migration import Migration
from turnout.protocols.kv import LOAD_TOPIC, LoadReport
from turnout.protocols.llm import ErrorKind, FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import EndpointId
from turnout.router.instance_load import InstanceLoad
from turnout.router.load_reports import BusyReports
from turnout.router.push_router import PushRouter
from turnout.router.selectors import InstanceSelector, RandomSelector, RoundRobinSelector
from turnout.runtime.context import AVOID_METADATA, RequestContext
from turnout.runtime.event_plane.base import DEFAULT_MAX_PENDING
from turnout.runtime.event_plane.local import LocalEventPlane

HOLD = 5.0
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(LLMEngineOutput).decode
_request_decoder = msgspec.msgpack.Decoder(PreprocessedRequest)


class Clock:
    def __init__(self) -> None:
        self.time = 100.0

    def __call__(self) -> float:
        return self.time


class Instances:
    """In-memory instances: each streams one token and a finish, or refuses as
    ``overloaded`` when listed in ``full``; records which instance each stream went to."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)
        self.full: set[int] = set()
        self.opened: list[int] = []

    def instance_ids(self) -> list[int]:
        return list(self.ids)

    def announced_ids(self) -> list[int]:
        return list(self.ids)

    async def stream(
        self, instance_id: int, payload: bytes, ctx: RequestContext
    ) -> AsyncIterator[bytes]:
        self.opened.append(instance_id)
        if instance_id in self.full:
            yield _encode(
                LLMEngineOutput(
                    finish_reason=FinishReason.ERROR,
                    error="queue full",
                    error_kind=ErrorKind.OVERLOADED.value,
                )
            )
            return
        yield _encode(LLMEngineOutput(token_ids=[instance_id], finish_reason=FinishReason.STOP))


def make(
    ids: Sequence[int], selector: InstanceSelector
) -> tuple[PushRouter[PreprocessedRequest, LLMEngineOutput], Instances, Clock]:
    clock = Clock()
    instances = Instances(ids)
    router: PushRouter[PreprocessedRequest, LLMEngineOutput] = PushRouter(
        instances,
        selector,
        encode=_encode,
        decode=_decode,
        load=InstanceLoad(busy_hold_s=HOLD, clock=clock),
    )
    return router, instances, clock


def request() -> PreprocessedRequest:
    return PreprocessedRequest(model="m", token_ids=[1, 2, 3])


async def serve(
    router: PushRouter[PreprocessedRequest, LLMEngineOutput], ctx: RequestContext | None = None
) -> list[LLMEngineOutput]:
    return [out async for out in router.generate(request(), ctx or RequestContext())]


@pytest.mark.parametrize("selector", [RoundRobinSelector, lambda: RandomSelector(seed=7)])
async def test_a_busy_instance_is_skipped_until_its_hold_ends(selector: object) -> None:
    router, instances, clock = make([1, 2, 3], selector())  # type: ignore[operator]
    router.load.mark_busy(2)
    for _ in range(12):
        await serve(router)
    assert 2 not in instances.opened
    assert set(instances.opened) == {1, 3}
    clock.time += HOLD
    instances.opened.clear()
    for _ in range(12):
        await serve(router)
    assert 2 in instances.opened


@pytest.mark.parametrize("selector", [RoundRobinSelector, lambda: RandomSelector(seed=7)])
async def test_when_every_instance_is_busy_one_is_still_tried(selector: object) -> None:
    router, _, _ = make([1, 2], selector())  # type: ignore[operator]
    router.load.mark_busy(1)
    router.load.mark_busy(2)
    outputs = await serve(router)
    assert outputs[-1].finish_reason is FinishReason.STOP


async def test_busy_marks_of_instances_that_left_are_forgotten() -> None:
    router, _, _ = make([1, 2], RoundRobinSelector())
    router.load.mark_busy(1)
    router.load.retain({2})
    assert not router.load.is_busy(1)


async def test_avoided_instances_are_never_candidates() -> None:
    router, instances, _ = make([1, 2, 3], RoundRobinSelector())
    ctx = RequestContext()
    ctx.metadata[AVOID_METADATA] = {1, 3}
    for _ in range(3):
        await serve(router, ctx)
    assert instances.opened == [2, 2, 2]
    ctx.metadata[AVOID_METADATA] = {1, 2, 3}
    with pytest.raises(NoInstanceAvailable, match="3 failed or overloaded"):
        await serve(router, ctx)


def migration_over(
    router: PushRouter[PreprocessedRequest, LLMEngineOutput], limit: int = 0
) -> Migration:
    return Migration(router.generate, migration_limit=limit, report_busy=router.load.mark_busy)


async def collect(migration: Migration) -> list[int]:
    tokens: list[int] = []
    stream = migration.generate(request(), RequestContext())
    try:
        async for output in stream:
            tokens.extend(output.token_ids)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    return tokens


async def test_an_overloaded_reply_is_retried_elsewhere_and_marks_the_instance_busy() -> None:
    router, instances, _ = make([1, 2, 3], RoundRobinSelector())
    instances.full.add(1)
    migration = migration_over(router)
    served = await collect(migration)  # 1 refused, another served: no migration spent
    assert instances.opened[0] == 1 and len(instances.opened) == 2
    assert served == [instances.opened[1]] and served != [1]
    assert router.load.is_busy(1)
    # The next requests skip the busy instance: round-robin over the others.
    assert sorted([await collect(migration) for _ in range(4)]) == [[2], [2], [3], [3]]
    assert instances.opened.count(1) == 1


async def test_every_instance_overloaded_is_engine_overloaded() -> None:
    router, instances, _ = make([1, 2, 3], RoundRobinSelector())
    instances.full.update({1, 2, 3})
    with pytest.raises(EngineOverloaded, match="queue full"):
        await collect(migration_over(router, limit=3))
    assert sorted(instances.opened) == [1, 2, 3]  # each tried once


# -- the workers' own reports ---------------------------------------------------------------


async def test_an_instance_that_reports_busy_is_skipped_until_it_reports_free() -> None:
    router, instances, clock = make([1, 2], RoundRobinSelector())
    router.load.on_load_report(2, 0, busy=True)
    for _ in range(4):
        await serve(router)
    assert instances.opened == [1, 1, 1, 1]
    router.load.on_load_report(2, 0, busy=False)
    await serve(router)
    await serve(router)
    assert 2 in instances.opened
    # A busy report goes stale: the instance is tried again after the report TTL.
    router.load.on_load_report(2, 0, busy=True)
    assert router.load.is_busy(2)
    clock.time += router.load.report_ttl_s + 1
    assert not router.load.is_busy(2)


def test_an_instance_is_busy_only_when_every_rank_it_reported_is() -> None:
    load = InstanceLoad(clock=Clock())
    load.on_load_report(5, 0, busy=True)
    assert load.is_busy(5)
    load.on_load_report(5, 1, busy=False)  # rank 1 can take work
    assert not load.is_busy(5)
    load.on_load_report(5, 1, busy=True)
    assert load.is_busy(5)
    load.retain({6})
    assert not load.is_busy(5)


async def test_busy_reports_reach_the_load_view_over_the_event_plane() -> None:
    endpoint = EndpointId(namespace="ns", component="backend", name="generate")
    plane = LocalEventPlane()
    load = InstanceLoad()
    reports = BusyReports(plane, endpoint, load, announced={7}.__contains__)
    reports.start()
    publisher = await plane.publisher("ns", "backend")
    try:
        busy, free = (_encode(LoadReport(worker_id=7, busy=b)) for b in (True, False))

        def reported(payload: bytes, want: bool) -> bool:
            # Published again on every look: the feed subscribes in its own task.
            publisher.publish_nowait(LOAD_TOPIC, payload)
            return load.is_busy(7) is want

        await eventually(lambda: reported(busy, True), what="instance 7 busy")
        await eventually(lambda: reported(free, False), what="instance 7 free")
    finally:
        await publisher.close()
        await reports.aclose()
        await plane.close()


async def test_busy_reports_of_instances_the_endpoint_does_not_announce_are_dropped() -> None:
    """The load topic is the component's: reports of another endpoint's instances (or ids
    never announced) must not grow the load view."""
    endpoint = EndpointId(namespace="ns", component="backend", name="generate")
    plane = LocalEventPlane()
    load = InstanceLoad()
    reports = BusyReports(plane, endpoint, load, announced={7}.__contains__)
    reports.start()
    publisher = await plane.publisher("ns", "backend")
    try:
        stranger = _encode(LoadReport(worker_id=8, busy=True))
        ours = _encode(LoadReport(worker_id=7, busy=True))

        def fed() -> bool:
            publisher.publish_nowait(LOAD_TOPIC, stranger)
            publisher.publish_nowait(LOAD_TOPIC, ours)
            return load.is_busy(7)

        await eventually(fed, what="instance 7 busy")
        assert not load.is_busy(8)
        assert load.not_busy([7, 8]) == [8]
    finally:
        await publisher.close()
        await reports.aclose()
        await plane.close()


class FlakyPlane(LocalEventPlane):
    """A local event plane whose first ``failures`` subscriptions fail."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def subscribe(
        self, namespace: str, component: str, topic: str, *, max_pending: int = DEFAULT_MAX_PENDING
    ) -> Any:
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("event plane unreachable")
        return await super().subscribe(namespace, component, topic, max_pending=max_pending)


async def test_a_failed_subscription_is_made_again() -> None:
    endpoint = EndpointId(namespace="ns", component="backend", name="generate")
    plane = FlakyPlane(failures=2)
    load = InstanceLoad()
    reports = BusyReports(
        plane, endpoint, load, announced={7}.__contains__, retry_min_s=0.001, retry_max_s=0.01
    )
    reports.start()
    publisher = await plane.publisher("ns", "backend")
    try:
        busy = _encode(LoadReport(worker_id=7, busy=True))

        def reported() -> bool:
            publisher.publish_nowait(LOAD_TOPIC, busy)
            return load.is_busy(7)

        await eventually(reported, what="instance 7 busy after two failed subscriptions")
        assert reports.failures == 2
    finally:
        await publisher.close()
        await reports.aclose()
        await plane.close()


async def test_closing_a_feed_never_raises() -> None:
    """``aclose`` runs where a card's routing is torn down: it must not abort the rest."""
    endpoint = EndpointId(namespace="ns", component="backend", name="generate")
    plane = FlakyPlane(failures=1_000_000)
    reports = BusyReports(
        plane, endpoint, InstanceLoad(), announced={7}.__contains__, retry_min_s=0.001
    )
    reports.start()
    await eventually(lambda: reports.failures >= 2, what="failed subscriptions")
    await reports.aclose()
    await plane.close()
