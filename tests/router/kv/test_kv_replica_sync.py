"""Two KV router replicas over a real (local) event plane: one's in-flight requests reach the
other as batches, and a burst of changes costs one publish per event-loop iteration."""

from __future__ import annotations

from collections.abc import Callable

from tests.polling import eventually

from turnout.protocols.model import EndpointId
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.router import ACTIVE_BATCH_MAX, KvRouter
from turnout.runtime.event_plane.local import LocalEventPlane

ENDPOINT = EndpointId(namespace="ns", component="backend", name="generate")


class Workers:
    """The instance view a router reads: two fixed workers."""

    def instance_ids(self) -> list[int]:
        return [1, 2]

    def announced_ids(self) -> set[int]:
        return {1, 2}

    def add_listener(self, listener: Callable[[], None]) -> None:
        pass

    def remove_listener(self, listener: Callable[[], None]) -> None:
        pass


def replica(plane: LocalEventPlane, name: str) -> KvRouter:
    return KvRouter(
        KvRouterConfig(block_size=4, use_kv_events=False),
        Workers(),  # type: ignore[arg-type]
        plane,
        ENDPOINT,
        router_id=name,
    )


def loads(router: KvRouter) -> dict[WorkerKey, tuple[int, int]]:
    return {k: (c.num_requests, c.prefill_requests) for k, c in router.core.active.counters.items()}


async def test_replicas_converge_with_one_publish_per_loop_iteration() -> None:
    plane = LocalEventPlane()
    one, two = replica(plane, "one"), replica(plane, "two")
    await one.start()
    await two.start()
    try:
        assert one._publisher is not None
        n = 40
        for i in range(n):  # adds, first tokens and frees within one loop iteration
            one.route(f"r{i}", list(range(16)))
        for i in range(n // 2):
            one.on_first_token(f"r{i}")
        for i in range(n // 4):
            one.on_finished(f"r{i}")
        await eventually(lambda: loads(two) == loads(one), what="replica two converges")
        assert sum(r for r, _ in loads(two).values()) == n - n // 4
        assert one._publisher.num_published == 1  # not one per change (90 here)
        # A later iteration's changes go in a batch of their own, applied after the first.
        for i in range(n // 4, n):
            one.on_finished(f"r{i}")
        await eventually(lambda: not loads(two), what="replica two sees every request freed")
        assert one._publisher.num_published == 2
    finally:
        await one.close()
        await two.close()


async def test_a_burst_beyond_the_bound_is_split() -> None:
    plane = LocalEventPlane()
    one, two = replica(plane, "one"), replica(plane, "two")
    await one.start()
    await two.start()
    try:
        assert one._publisher is not None
        n = ACTIVE_BATCH_MAX + 10
        for i in range(n):
            one.route(f"r{i}", [i])
        await eventually(lambda: loads(two) == loads(one), what="replica two converges")
        assert one._publisher.num_published == 2
    finally:
        await one.close()
        await two.close()
