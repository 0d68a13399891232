"""Load reports folded before the KV router applies them: per batch only each worker's
latest feeds the busy view, step samples reach the fits together and in order, and the
router's feed does both over a real (local) event plane."""

from __future__ import annotations

import time

import msgspec
import pytest
from tests.polling import eventually
from tests.router.kv.members import ENDPOINT, Members

from turnout.protocols.kv import LOAD_TOPIC, LoadReport, StepSample
from turnout.router.event_batches import BatchDecoder, take_ready
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.load_feed import StepBacklog, latest_per_worker
from turnout.router.kv.router import KvRouter
from turnout.runtime.event_plane.base import Event
from turnout.runtime.event_plane.local import LocalEventPlane

_encode = msgspec.msgpack.Encoder().encode


def report(worker: int, *steps: float, rank: int = 0, busy: bool = False) -> LoadReport:
    return LoadReport(
        worker_id=worker,
        dp_rank=rank,
        busy=busy,
        steps=[StepSample(128, 0, s) for s in steps],
    )


def seconds(r: LoadReport) -> list[float]:
    return [s.seconds for s in r.steps]


def test_latest_per_worker_keeps_each_worker_and_rank_last_report() -> None:
    reports = [report(1, busy=True), report(2), report(1, rank=1), report(1, busy=False)]
    latest = latest_per_worker(reports)
    assert latest == [reports[3], reports[1], reports[2]]


def test_backlog_folds_a_worker_samples_in_order_until_its_interval_is_due() -> None:
    backlog = StepBacklog(interval_s=1.0, max_samples=100)
    backlog.add(report(1, 0.1))
    assert [seconds(r) for r in backlog.take_due(0.0)] == [[0.1]]  # the first batch: at once
    backlog.add(report(1, 0.2))
    backlog.add(report(2, 0.5))
    backlog.add(report(1, 0.3, busy=True))
    assert backlog.take_due(0.5) == []  # within the interval
    assert len(backlog) == 2
    due = backlog.take_due(1.0)
    assert [(r.worker_id, r.busy, seconds(r)) for r in due] == [
        (1, True, [0.2, 0.3]),  # the latest report, every sample since the last fit
        (2, False, [0.5]),
    ]
    assert len(backlog) == 0


def test_a_worker_with_enough_samples_is_fitted_without_waiting() -> None:
    backlog = StepBacklog(interval_s=10.0, max_samples=3)
    assert backlog.take_due(0.0) == []
    backlog.add(report(1, 0.1, 0.2))
    backlog.add(report(2, 0.5))
    assert backlog.take_due(1.0) == []
    backlog.add(report(1, 0.3))
    due = backlog.take_due(2.0)
    assert [(r.worker_id, seconds(r)) for r in due] == [(1, [0.1, 0.2, 0.3])]
    assert [r.worker_id for r in backlog.take_all()] == [2]


def test_the_backlog_is_bounded_by_workers() -> None:
    backlog = StepBacklog(interval_s=10.0, max_workers=2)
    backlog.take_due(0.0)
    for worker in (1, 2, 3):
        backlog.add(report(worker, 0.1))
    assert [r.worker_id for r in backlog.take_due(1.0)] == [1, 2, 3]  # past the bound: all
    backlog.add(report(4, 0.1))
    backlog.remove_worker(4)
    assert backlog.take_all() == []


@pytest.mark.parametrize(
    ("interval_s", "max_samples", "max_workers"), [(-1.0, 1, 1), (1.0, 0, 1), (1.0, 1, 0)]
)
def test_bad_bounds_are_refused(interval_s: float, max_samples: int, max_workers: int) -> None:
    with pytest.raises(ValueError, match="step backlog"):
        StepBacklog(interval_s=interval_s, max_samples=max_samples, max_workers=max_workers)


def test_an_undecodable_payload_is_skipped_and_counted() -> None:
    decoder = BatchDecoder(LoadReport, LOAD_TOPIC)
    batch = [Event(LOAD_TOPIC, b"\xc1"), Event(LOAD_TOPIC, _encode(report(3)))]
    assert [r.worker_id for r in decoder.decode(batch)] == [3]
    assert decoder.num_invalid == 1


async def test_take_ready_takes_what_is_queued_and_ends_with_the_subscription() -> None:
    plane = LocalEventPlane()
    sub = await plane.subscribe("ns", "backend", LOAD_TOPIC)
    pub = await plane.publisher("ns", "backend")
    for i in range(5):
        pub.publish_nowait(LOAD_TOPIC, bytes([i]))
    first = await take_ready(sub, limit=3)
    rest = await take_ready(sub)
    assert first is not None and rest is not None
    assert [e.payload for e in first + rest] == [bytes([i]) for i in range(5)]
    await sub.close()
    assert await take_ready(sub) is None
    await plane.close()


async def test_the_router_feeds_busy_views_and_step_fits_from_the_plane() -> None:
    plane = LocalEventPlane()
    router = KvRouter(
        KvRouterConfig(block_size=4, use_kv_events=False),
        Members([1, 2]),  # type: ignore[arg-type]
        plane,
        ENDPOINT,
        share_active=False,
    )
    await router.start()
    pub = await plane.publisher("ns", "backend")
    try:
        models = router.core.step_models
        key = WorkerKey(1, 0)
        for r in (report(1, 0.1, busy=True), report(2, 0.2), report(1, 0.3, 0.4)):
            pub.publish_nowait(LOAD_TOPIC, _encode(r))
        await eventually(
            lambda: router.core.loads.get_report(WorkerKey(2, 0)) is not None,
            what="reports applied",
        )
        assert not router.core.loads.is_busy(key, time.monotonic())  # the latest says free
        await eventually(
            lambda: models.get(key).prefill.num_samples == 3, what="worker 1's samples fitted"
        )
    finally:
        await pub.close()
        await router.close()
        await plane.close()


async def test_the_router_keeps_nothing_for_workers_outside_discovery() -> None:
    """A report from a worker that left (or never registered) is dropped: kept, it would stay
    in the step fits and the metrics for good."""
    plane = LocalEventPlane()
    router = KvRouter(
        KvRouterConfig(block_size=4, use_kv_events=False),
        Members([1]),  # type: ignore[arg-type]
        plane,
        ENDPOINT,
        share_active=False,
    )
    await router.start()
    pub = await plane.publisher("ns", "backend")
    try:
        for r in (report(0, 0.1), report(7, 0.2), report(1, 0.3)):
            pub.publish_nowait(LOAD_TOPIC, _encode(r))
        await eventually(
            lambda: router.core.loads.get_report(WorkerKey(1, 0)) is not None,
            what="the member's report applied",
        )
        assert router.core.loads.get_report(WorkerKey(0, 0)) is None
        assert router.core.loads.get_report(WorkerKey(7, 0)) is None
        assert {k.worker_id for k, _ in router.core.step_models.items()} <= {1}
    finally:
        await pub.close()
        await router.close()
        await plane.close()
