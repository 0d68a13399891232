"""The planner's loop: every interval, observe, predict, decide each pool, and act when this
planner leads and is not a dry run. Every decision is a log line, an entry of the bounded
log served at ``/planner/decisions``, and the ``turnout_planner_*`` metrics.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from turnout.planner.capacity import WorkerCapacity
from turnout.planner.connectors.base import Connector, ConnectorError
from turnout.planner.connectors.metrics_only import desired_replicas_gauge
from turnout.planner.decide import (
    Decision,
    Policy,
    PoolLimits,
    PoolState,
    decide,
    fit_budget,
    record_change,
)
from turnout.planner.leader import LeaderElection
from turnout.planner.observe import FrontendScraper
from turnout.planner.pools import PoolView
from turnout.planner.predict import LoadPredictor

log = logging.getLogger("turnout.planner")

#: Decisions kept for ``/planner/decisions`` (one per pool per interval).
MAX_DECISIONS = 500


@dataclass(slots=True)
class PlannerSettings:
    interval: float
    percentile: float
    policy: Policy
    limits: dict[str, PoolLimits]
    dry_run: bool = False
    profile: dict[str, WorkerCapacity] = field(default_factory=dict)


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.desired = desired_replicas_gauge(registry)
        self.replicas = Gauge(
            "turnout_planner_replicas", "Replicas each pool runs, as the planner counts them",
            ["pool"], registry=registry,
        )  # fmt: skip
        self.actions = Counter(
            "turnout_planner_scaling_actions", "Scaling actions carried out, by pool and direction",
            ["pool", "direction"], registry=registry,
        )  # fmt: skip
        self.leader = Gauge(
            "turnout_planner_leader", "1 while this planner leads (acts), else 0", registry=registry
        )
        self.failures = Counter(
            "turnout_planner_connector_failures", "Scaling actions the connector failed",
            ["pool"], registry=registry,
        )  # fmt: skip


class Planner:
    """See the module docstring."""

    def __init__(
        self,
        settings: PlannerSettings,
        *,
        scraper: FrontendScraper,
        pools: dict[str, PoolView],
        connector: Connector,
        election: LeaderElection,
        predictor: LoadPredictor,
        metrics: PlannerMetrics,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self._scraper = scraper
        self._pools = pools
        self._connector = connector
        self.election = election
        self._predictor = predictor
        self._metrics = metrics
        self._clock = clock
        self._wall_clock = wall_clock
        self._states = {pool: PoolState() for pool in pools}
        self.decisions: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_DECISIONS)
        self._last_at: float | None = None
        #: No frontend's interval could be read (logged once per streak).
        self._blind = False

    async def step(self) -> list[Decision]:
        """One interval: observe, predict, decide, act (if leading and not a dry run)."""
        now = self._clock()
        seconds = self.settings.interval if self._last_at is None else now - self._last_at
        self._last_at = now
        observed, frontends = await self._scraper.observe(seconds, self.settings.percentile)
        if frontends == 0:
            if not self._blind:
                self._blind = True
                log.warning("no frontend read twice in a row yet: no decision until one is")
            return []
        if self._blind:
            self._blind = False
            log.info("frontends read: deciding")
        self._predictor.add(observed.load)
        predicted = self._predictor.predict()
        load = predicted or observed.load
        leading = self.election.leading
        self._metrics.leader.set(1 if leading else 0)
        decisions: list[Decision] = []
        for pool, view in self._pools.items():
            try:
                await view.refresh()
                current = await self._connector.replicas(pool)
            except Exception as exc:  # the store or the connector: no decision this time
                log.warning("cannot count the %s pool's workers: %s; no decision", pool, exc)
                continue
            if current is None:
                current = len(view.least_loaded())
            policy = self.settings.policy
            capacity = self.settings.profile.get(pool) or view.capacity(
                load.prompt_tokens or 1.0,
                load.output_tokens or 1.0,
                policy.ttft_slo,
                policy.itl_slo,
            )
            seen = dataclasses.replace(observed, waiting=view.queues()["workers_waiting"])
            decisions.append(
                decide(
                    now=now, pool=pool, current=current, observed=seen, predicted=predicted,
                    capacity=capacity, limits=self.settings.limits[pool], policy=policy,
                    state=self._states[pool],
                )
            )  # fmt: skip
        fit_budget(decisions, self.settings.limits, self.settings.policy)
        for decision in decisions:
            decision.extra.update(self._pools[decision.pool].queues())
            await self._carry_out(decision, leading)
        return decisions

    async def _carry_out(self, decision: Decision, leading: bool) -> None:
        pool = decision.pool
        self._metrics.desired.labels(pool).set(decision.chosen)
        self._metrics.replicas.labels(pool).set(decision.current)
        if decision.chosen != decision.current:
            if self.settings.dry_run:
                decision.reasons.append("dry run: not acting")
            elif not leading:
                decision.reasons.append("standing by: the leader acts")
            else:
                try:
                    await self._connector.scale(
                        pool, decision.chosen, drain_first=self._pools[pool].least_loaded()
                    )
                except ConnectorError as exc:
                    self._metrics.failures.labels(pool).inc()
                    decision.reasons.append(f"connector failed: {exc}")
                    log.error("scaling the %s pool to %d failed: %s", pool, decision.chosen, exc)
                else:
                    decision.acted = True
                    record_change(decision, self._states[pool])
                    direction = "up" if decision.chosen > decision.current else "down"
                    self._metrics.actions.labels(pool, direction).inc()
        entry = decision.as_dict()
        entry["at"] = round(self._wall_clock(), 3)
        entry["leader"] = leading
        self.decisions.append(entry)
        level = logging.INFO if decision.chosen != decision.current else logging.DEBUG
        log.log(level, "%s", decision.summary())

    async def run(self) -> None:
        """Decide every interval until cancelled; a failed interval is logged, not fatal."""
        while True:
            started = self._clock()
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("planning interval failed")
            await asyncio.sleep(max(0.0, self.settings.interval - (self._clock() - started)))

    def report(self) -> dict[str, Any]:
        """``/planner/decisions``' body: who leads, the settings, and the decisions, newest
        last."""
        leader = self.election.leader
        return {
            "leader": self.election.leading,
            "leading_planner": None
            if leader is None
            else {"host": leader.host, "pid": leader.pid, "url": leader.url},
            "dry_run": self.settings.dry_run,
            "connector": self._connector.name,
            "interval_s": self.settings.interval,
            "ttft_slo_s": self.settings.policy.ttft_slo,
            "itl_slo_s": self.settings.policy.itl_slo,
            "decisions": list(self.decisions),
        }
