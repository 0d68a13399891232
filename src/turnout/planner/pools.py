"""What the planner knows of each pool's workers: their fitted step times and limits (for
capacity) and their load (to drain the least loaded first).

Each pool's workers publish ``LoadReport`` s on their component's ``load`` topic; a
``PoolView`` subscribes to them, as the KV router does, and fits the same step-time models
(``router.kv.step_time``). A worker's limits (most running requests, KV cache size) come from
its model card's runtime config. Workers that leave discovery are forgotten at the next
``refresh``; what is kept is bounded by the workers in discovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from turnout.planner.capacity import DEFAULT_MAX_SEQS, WorkerCapacity, WorkerLimits, from_step_model
from turnout.protocols.kv import LOAD_TOPIC, LoadReport
from turnout.protocols.model import MDC_ROOT, EndpointId, ModelDeploymentCard
from turnout.router.event_batches import BatchDecoder, take_ready
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.step_time import StepTimeModels
from turnout.runtime.discovery.base import DiscoveryStore
from turnout.runtime.event_plane.base import EventPlane

log = logging.getLogger("turnout.planner")

STORE_TIMEOUT = 5.0
#: Most a pool's capacity estimate rises from one decision to the next (a factor).
CAPACITY_RISE = 1.2
RETRY_S = 2.0


class PoolView:
    """One pool's workers as their reports and cards show them."""

    def __init__(self, pool: str, endpoint: EndpointId, store: DiscoveryStore) -> None:
        self.pool = pool
        self.endpoint = endpoint
        self._store = store
        self.models = StepTimeModels()
        #: Instance id -> (running, waiting), as last reported.
        self._load: dict[int, tuple[int, int]] = {}
        self._limits: dict[int, WorkerLimits] = {}
        self._task: asyncio.Task[None] | None = None
        self._decoder = BatchDecoder(LoadReport, LOAD_TOPIC)
        self._last_capacity: WorkerCapacity | None = None

    def start(self, plane: EventPlane) -> None:
        self._task = asyncio.create_task(self._follow(plane), name=f"planner-{self.pool}-load")

    async def _follow(self, plane: EventPlane) -> None:
        endpoint = self.endpoint
        while True:
            try:
                sub = await plane.subscribe(endpoint.namespace, endpoint.component, LOAD_TOPIC)
                try:
                    while (batch := await take_ready(sub)) is not None:
                        for report in self._decoder.decode(batch):
                            self.on_load(report)
                finally:
                    await sub.close()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("load reports of the %s pool: %s; subscribing again", self.pool, exc)
            await asyncio.sleep(RETRY_S)

    def on_load(self, report: LoadReport) -> None:
        if report.worker_id not in self._limits:
            return  # not (yet) a worker of this pool in discovery: keep nothing for it
        self._load[report.worker_id] = (report.num_running, report.num_waiting)
        self.models.on_load(report)

    async def refresh(self) -> set[int]:
        """Read the pool's cards: its live workers and their limits; forget the others."""
        prefix = f"{MDC_ROOT}/{self.endpoint.path()}/"
        kvs = await asyncio.wait_for(self._store.get_prefix(prefix), STORE_TIMEOUT)
        limits: dict[int, WorkerLimits] = {}
        for kv in kvs:
            try:  # v1/mdc/{endpoint}/{instance:x}[/{lora}]
                instance = int(kv.key[len(prefix) :].split("/", 1)[0], 16)
                card = msgspec.json.decode(kv.value, type=ModelDeploymentCard)
            except (ValueError, msgspec.DecodeError) as exc:
                log.warning("skipping the malformed card %s: %s", kv.key, exc)
                continue
            rc = card.runtime_config
            blocks = rc.total_kv_blocks or 0
            limits[instance] = WorkerLimits(
                max_num_seqs=rc.max_num_seqs or DEFAULT_MAX_SEQS,
                kv_tokens=blocks * card.kv_cache_block_size,
            )
        for gone in set(self._limits) - set(limits):
            self._load.pop(gone, None)
            self.models.remove_worker(gone)
        self._limits = limits
        return set(limits)

    def least_loaded(self) -> list[int]:
        """Live workers, the least loaded first (those that never reported count as idle)."""
        return sorted(self._limits, key=lambda i: sum(self._load.get(i, (0, 0))))

    def queues(self) -> dict[str, int]:
        """Requests running and waiting on the pool's workers, as last reported."""
        loads = [self._load[i] for i in self._limits if i in self._load]
        return {
            "workers_running": sum(r for r, _ in loads),
            "workers_waiting": sum(w for _, w in loads),
        }

    def capacity(
        self, prompt_tokens: float, output_tokens: float, ttft_slo: float, itl_slo: float
    ) -> WorkerCapacity:
        """The mean of the workers' capacities (the step-time prior's for a pool that has not
        reported), rising by at most ``CAPACITY_RISE`` per call and falling at once: a fit
        that has seen only light load extrapolates to heavy load, and an estimate that jumps
        up would shed the workers a burst then needs."""
        estimate = self._estimate(prompt_tokens, output_tokens, ttft_slo, itl_slo)
        last = self._last_capacity
        if last is not None and last.source == estimate.source:
            estimate = WorkerCapacity(
                min(estimate.prefill_tokens_per_s, last.prefill_tokens_per_s * CAPACITY_RISE),
                min(estimate.decode_tokens_per_s, last.decode_tokens_per_s * CAPACITY_RISE),
                estimate.source,
            )
        self._last_capacity = estimate
        return estimate

    def _estimate(
        self, prompt_tokens: float, output_tokens: float, ttft_slo: float, itl_slo: float
    ) -> WorkerCapacity:
        estimates = []
        for instance, limits in self._limits.items():
            fitted = any(k.worker_id == instance for k, _ in self.models.items())
            model = self.models.get(WorkerKey(instance, 0))
            estimates.append(
                from_step_model(
                    model, limits, pool=self.pool, prompt_tokens=prompt_tokens,
                    output_tokens=output_tokens, ttft_slo=ttft_slo, itl_slo=itl_slo,
                    source="step-model" if fitted else "step-prior",
                )
            )  # fmt: skip
        if not estimates:
            return from_step_model(
                self.models.default, WorkerLimits(), pool=self.pool, prompt_tokens=prompt_tokens,
                output_tokens=output_tokens, ttft_slo=ttft_slo, itl_slo=itl_slo,
                source="step-prior",
            )  # fmt: skip
        n = len(estimates)
        source = "step-model" if any(e.source == "step-model" for e in estimates) else "step-prior"
        return WorkerCapacity(
            sum(e.prefill_tokens_per_s for e in estimates) / n,
            sum(e.decode_tokens_per_s for e in estimates) / n,
            source,
        )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
