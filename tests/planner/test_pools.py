"""A pool as the planner sees it: its workers' limits from their cards in the store, their
load and step times from their reports (only for workers in discovery), the least loaded
first, and nothing kept for a worker that left."""

from __future__ import annotations

import msgspec

from turnout.planner.capacity import WorkerCapacity
from turnout.planner.pools import PoolView
from turnout.protocols.kv import LoadReport, StepSample
from turnout.protocols.model import (
    EndpointId,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
    RuntimeConfig,
    mdc_key,
)
from turnout.runtime.discovery.memory import MemoryStore

EID = EndpointId(namespace="ns", component="backend", name="generate")


def card(instance_id: int, max_num_seqs: int, blocks: int) -> bytes:
    return msgspec.json.encode(
        ModelDeploymentCard(
            display_name="m",
            endpoint=EID,
            instance_id=instance_id,
            model_type=ModelType.Completions,
            model_input=ModelInput.Tokens,
            kv_cache_block_size=16,
            runtime_config=RuntimeConfig(max_num_seqs=max_num_seqs, total_kv_blocks=blocks),
        )
    )


def report(worker: int, running: int, waiting: int) -> LoadReport:
    return LoadReport(
        worker_id=worker,
        num_running=running,
        num_waiting=waiting,
        steps=[StepSample(0, running, 0.02, 0.1) for _ in range(8)],
    )


async def test_limits_load_and_order_from_cards_and_reports() -> None:
    store = MemoryStore()
    await store.put(mdc_key(EID, 1), card(1, 4, 64))
    await store.put(mdc_key(EID, 2), card(2, 4, 64))
    await store.put(mdc_key(EID, 3) + "/adapter", card(3, 4, 64))  # a LoRA card: worker 3
    await store.put(mdc_key(EID, 4), b"{not a card")
    view = PoolView("aggregated", EID, store)
    assert await view.refresh() == {1, 2, 3}
    view.on_load(report(1, 3, 2))
    view.on_load(report(2, 1, 0))
    view.on_load(report(9, 5, 5))  # not in discovery: kept nowhere
    assert view.least_loaded() == [3, 2, 1]
    assert view.queues() == {"workers_running": 4, "workers_waiting": 2}
    assert {k.worker_id for k, _ in view.models.items()} == {1, 2}
    capacity = view.capacity(256, 64, ttft_slo=1.0, itl_slo=0.05)
    assert capacity.source == "step-model"
    # Worker 1 leaves discovery: its load and step fit go with it.
    await store.delete(mdc_key(EID, 1))
    assert await view.refresh() == {2, 3}
    assert view.least_loaded() == [3, 2]
    assert {k.worker_id for k, _ in view.models.items()} == {2}


async def test_an_empty_pool_is_planned_with_the_prior() -> None:
    view = PoolView("decode", EID, MemoryStore())
    assert await view.refresh() == set()
    capacity = view.capacity(256, 64, ttft_slo=1.0, itl_slo=0.05)
    assert capacity.source == "step-prior"
    assert capacity.decode_tokens_per_s > 0


async def test_the_capacity_estimate_rises_slowly_and_falls_at_once() -> None:
    store = MemoryStore()
    await store.put(mdc_key(EID, 1), card(1, 4, 64))
    view = PoolView("aggregated", EID, store)
    await view.refresh()

    def rps(c: WorkerCapacity) -> float:
        return c.requests_per_s("aggregated", 256, 64)

    base = view.capacity(256, 64, ttft_slo=0.3, itl_slo=0.03)
    unbounded = view._estimate(256, 64, ttft_slo=10.0, itl_slo=0.5)
    assert rps(unbounded) > 1.2 * rps(base)
    looser = view.capacity(256, 64, ttft_slo=10.0, itl_slo=0.5)
    assert rps(base) < rps(looser) <= 1.2 * rps(base) + 1e-9
    tighter = view.capacity(256, 64, ttft_slo=0.05, itl_slo=0.01)
    assert rps(tighter) <= rps(view._estimate(256, 64, 0.05, 0.01)) + 1e-9 < rps(looser)
