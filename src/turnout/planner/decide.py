"""The planner's decision: how many workers each pool should run next, and why.

A pure function of what was observed, what is predicted, what a worker sustains and the
pool's history (``PoolState``), with the time passed in: tests replay recorded observations
with no process and no clock. The rules, in order, each named in the decision's ``reasons``:

1. **load**: enough workers for the larger of the observed and the predicted request rate,
   plus the requests waiting (for a batch slot on the workers; for admission at the
   frontends, but for a decode pool) spread over ``queue_horizon``, at the worker's capacity
   within the SLOs (``capacity``), times a correction learnt from breaches:
   ``ceil(rate / (capacity · correction))``. Waiting requests show a burst an interval before
   their latency does: they have none yet.
2. **slo**: the observed TTFT (aggregated, prefill) or ITL (aggregated, decode) percentile
   above its target (over at least ``MIN_SAMPLES`` requests), or requests queued or rejected
   at the frontends, asks for more workers
   than now, in proportion to the overshoot (``ceil(current · min(observed/target, 2))``, at
   least one more); and the rate each worker carried when a steady pool (not grown within
   ``up_cooldown``) breached caps the correction (halving it at most per breach; it wears
   off by 10% per calm interval), so the load rule does not scale back into the breach.
3. **hysteresis**: a pool shrinks only when the load fits the smaller pool at
   ``down_utilization`` of its capacity, and only after that slack has lasted
   ``scale_down_after`` seconds; it sheds at most half its workers at once.
4. **cool-down**: ``up_cooldown`` seconds after growing before growing again (new workers
   must show up in the figures first; a pool that just shrank grows at once), and
   ``down_cooldown`` after any change before shrinking.
5. **bound**: ``min_replicas``/``max_replicas`` of the pool.
6. **budget**: ``max_workers`` and ``max_gpus`` over all pools (``fit_budget``), shared in
   proportion to what each pool asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from turnout.planner.capacity import WorkerCapacity
from turnout.planner.predict import Load

#: Largest overshoot the SLO rule scales by at once (a queue makes latency grow without bound
#: under overload; doubling, then looking again, is what the figures support).
MAX_BREACH_FACTOR = 2.0
#: How fast a breach's capacity correction wears off per decision without a breach.
CORRECTION_RECOVERY = 1.1
#: Most a single breach lowers the capacity correction by (a factor).
CORRECTION_STEP = 0.5
#: Fewest requests whose latency percentile can count as a breach: one slow request of two
#: is not a fleet missing its target.
MIN_SAMPLES = 5


@dataclass(frozen=True, slots=True)
class PoolLimits:
    min_replicas: int = 1
    max_replicas: int = 8
    gpus_per_worker: int = 1


@dataclass(frozen=True, slots=True)
class Policy:
    """The SLOs and the rules' settings (see the module docstring)."""

    ttft_slo: float
    itl_slo: float
    up_cooldown: float = 30.0
    down_cooldown: float = 60.0
    scale_down_after: float = 60.0
    down_utilization: float = 0.7
    max_workers: int | None = None
    max_gpus: int | None = None
    #: Seconds in which requests waiting now should be served (the planner's interval): they
    #: add ``waiting / queue_horizon`` to the load.
    queue_horizon: float = 10.0


@dataclass(frozen=True, slots=True)
class Observed:
    """One interval at the frontends (``observe``): the load, latency percentiles (None when
    no request gave one), queue and rejections."""

    load: Load
    ttft_s: float | None = None
    itl_s: float | None = None
    queued: int = 0
    rejected: int = 0
    #: Requests the latency percentiles come from (those that got a first token).
    samples: int = 0
    #: Requests waiting for a batch slot on the pool's workers (their last load reports).
    waiting: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.load.as_dict(),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
            "itl_s": None if self.itl_s is None else round(self.itl_s, 5),
            "queued": self.queued,
            "rejected": self.rejected,
            "samples": self.samples,
            "waiting": self.waiting,
        }


@dataclass(slots=True)
class PoolState:
    """What the planner remembers of a pool between decisions."""

    #: When the pool last changed, either way (the down cool-down counts from it) ...
    last_change: float | None = None
    #: ... and when it last grew (the up cool-down counts from it: a pool that just shrank
    #: grows again at once when the load comes back).
    last_up: float | None = None
    slack_since: float | None = None
    #: Multiplies the capacity estimate; below 1 after a breach showed it optimistic.
    correction: float = 1.0


@dataclass(slots=True)
class Decision:
    """One pool's decision and everything it was made from."""

    at: float
    pool: str
    current: int
    #: What the load and SLO rules ask for, before hysteresis, cool-down, bounds and budget.
    wanted: int
    chosen: int
    reasons: list[str]
    observed: Observed
    predicted: Load | None
    capacity: WorkerCapacity
    per_worker_rps: float
    acted: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def action(self) -> str:
        if self.chosen > self.current:
            return "scale_up"
        if self.chosen < self.current:
            return "scale_down"
        return "hold"

    def as_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "pool": self.pool,
            "action": self.action,
            "current": self.current,
            "wanted": self.wanted,
            "chosen": self.chosen,
            "reasons": self.reasons,
            "acted": self.acted,
            "observed": self.observed.as_dict(),
            "predicted": None if self.predicted is None else self.predicted.as_dict(),
            "capacity": {
                **self.capacity.as_dict(),
                "per_worker_rps": round(self.per_worker_rps, 4),
            },
            **self.extra,
        }

    def summary(self) -> str:
        """The decision as one log line."""
        o = self.observed
        return (
            f"pool {self.pool}: {self.action} {self.current} -> {self.chosen} "
            f"(wanted {self.wanted}; {'; '.join(self.reasons)}); observed "
            f"{o.load.request_rate:.2f} req/s, ttft {_ms(o.ttft_s)}, itl {_ms(o.itl_s)}, "
            f"queued {o.queued}, rejected {o.rejected}; predicted "
            f"{self.predicted.request_rate if self.predicted else 0.0:.2f} req/s; capacity "
            f"{self.per_worker_rps:.2f} req/s per worker ({self.capacity.source})"
        )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms"


def _breach(pool: str, observed: Observed, policy: Policy) -> tuple[float, str] | None:
    """How far over its targets the pool is (a factor above 1) and the reason; None: within."""
    worst: tuple[float, str] | None = None
    checks: list[tuple[float | None, float, str]] = []
    if pool in ("aggregated", "prefill"):
        checks.append((observed.ttft_s, policy.ttft_slo, "ttft"))
    if pool in ("aggregated", "decode"):
        checks.append((observed.itl_s, policy.itl_slo, "itl"))
    for value, target, name in checks:
        if value is not None and value > target and observed.samples >= MIN_SAMPLES:
            factor = value / target
            if worst is None or factor > worst[0]:
                worst = (factor, f"slo: {name} {_ms(value)} over {_ms(target)}")
    if worst is None and pool != "decode" and (observed.queued > 0 or observed.rejected > 0):
        worst = (1.0, f"slo: {observed.queued} queued, {observed.rejected} rejected")
    return worst


def decide(
    *,
    now: float,
    pool: str,
    current: int,
    observed: Observed,
    predicted: Load | None,
    capacity: WorkerCapacity,
    limits: PoolLimits,
    policy: Policy,
    state: PoolState,
) -> Decision:
    """The replica count for ``pool`` before the budget (``fit_budget``); updates ``state``
    as if the decision is carried out (the caller calls ``record_change`` when it is)."""
    rate = observed.load.request_rate
    prompt, output = observed.load.prompt_tokens, observed.load.output_tokens
    if predicted is not None:
        rate = max(rate, predicted.request_rate)
        prompt = predicted.prompt_tokens or prompt
        output = predicted.output_tokens or output
    model_rps = capacity.requests_per_s(pool, prompt, output)
    breach = _breach(pool, observed, policy)
    steady = state.last_up is None or now - state.last_up >= policy.up_cooldown
    if breach is not None and steady and current > 0 and observed.load.request_rate > 0:
        # What each worker carried while the pool breached bounds what one can carry. Not
        # right after a change: new workers may not have served yet, and a queue built
        # before them is still draining.
        carried = observed.load.request_rate / current
        floor = state.correction * CORRECTION_STEP
        state.correction = min(state.correction, max(carried / model_rps, floor))
    elif breach is None:
        state.correction = min(1.0, state.correction * CORRECTION_RECOVERY)
    per_worker = model_rps * state.correction
    reasons: list[str] = []
    backlog = observed.waiting + (observed.queued if pool != "decode" else 0)
    if backlog and policy.queue_horizon > 0:
        rate += backlog / policy.queue_horizon
    load_need = math.ceil(rate / per_worker - 1e-9) if rate > 0 else 0
    wanted = load_need
    waiting = f" (with {backlog} waiting)" if backlog else ""
    reasons.append(f"load: {rate:.2f} req/s{waiting} needs {load_need}")
    if breach is not None:
        factor, why = breach
        slo_need = max(current + 1, math.ceil(current * min(factor, MAX_BREACH_FACTOR)))
        if slo_need > wanted:
            wanted = slo_need
        reasons.append(f"{why}, asks {slo_need}")
    chosen = current
    if wanted > current:
        state.slack_since = None
        if state.last_up is not None and now - state.last_up < policy.up_cooldown:
            reasons.append(
                f"cool-down: {now - state.last_up:.0f}s of {policy.up_cooldown:.0f}s since "
                "the last scale-up"
            )
        else:
            chosen = wanted
    elif wanted < current and breach is None:
        # Hysteresis: the smaller pool must carry the load with room to spare.
        down_need = math.ceil(rate / (per_worker * policy.down_utilization) - 1e-9)
        target = max(down_need, current - max(1, current // 2))
        if target >= current:
            state.slack_since = None
            reasons.append(
                f"hysteresis: {rate:.2f} req/s needs {down_need} at "
                f"{policy.down_utilization:.0%} utilization"
            )
        else:
            if state.slack_since is None:
                state.slack_since = now
            slack_for = now - state.slack_since
            since_change = None if state.last_change is None else now - state.last_change
            if slack_for < policy.scale_down_after:
                reasons.append(
                    f"slack for {slack_for:.0f}s of {policy.scale_down_after:.0f}s before "
                    "scaling down"
                )
            elif since_change is not None and since_change < policy.down_cooldown:
                reasons.append(
                    f"cool-down: {since_change:.0f}s of {policy.down_cooldown:.0f}s since the "
                    "last change"
                )
            else:
                chosen = target
                reasons.append(f"slack for {slack_for:.0f}s: down to {target}")
    else:
        state.slack_since = None
    bounded = min(max(chosen, limits.min_replicas), limits.max_replicas)
    if bounded != chosen:
        side = "min" if bounded > chosen else "max"
        reasons.append(f"bound: {side} {bounded}")
        chosen = bounded
    return Decision(
        at=now,
        pool=pool,
        current=current,
        wanted=wanted,
        chosen=chosen,
        reasons=reasons,
        observed=observed,
        predicted=predicted,
        capacity=capacity,
        per_worker_rps=per_worker,
        extra={"correction": round(state.correction, 4)},
    )


def fit_budget(decisions: list[Decision], limits: dict[str, PoolLimits], policy: Policy) -> None:
    """Cut the chosen counts to ``max_workers`` and ``max_gpus`` over all pools, each pool in
    proportion to what it chose (largest remainders first), never under its minimum; a pool
    that grows gets no more than the budget leaves it. Reasons name the budget."""
    if not decisions:
        return

    def cost(pool: str, replicas: int, gpus: bool) -> int:
        return replicas * (limits[pool].gpus_per_worker if gpus else 1)

    for gpus, budget, name in (
        (False, policy.max_workers, "max-workers"),
        (True, policy.max_gpus, "max-gpus"),
    ):
        if budget is None:
            continue
        total = sum(cost(d.pool, d.chosen, gpus) for d in decisions)
        if total <= budget:
            continue
        floors = {d.pool: limits[d.pool].min_replicas for d in decisions}
        scale = budget / total
        shares = {d.pool: max(floors[d.pool], math.floor(d.chosen * scale)) for d in decisions}
        spare = budget - sum(cost(p, n, gpus) for p, n in shares.items())
        # A pool lifted to its minimum took more than its share: take it back from the pools
        # furthest above their own minimums (none left: the minimums alone exceed the budget).
        while spare < 0:
            above = [d for d in decisions if shares[d.pool] > floors[d.pool]]
            if not above:
                break
            d = max(above, key=lambda d: shares[d.pool] - floors[d.pool])
            shares[d.pool] -= 1
            spare += cost(d.pool, 1, gpus)
        by_remainder = sorted(
            decisions, key=lambda d: d.chosen * scale - shares[d.pool], reverse=True
        )
        for d in by_remainder:
            step = cost(d.pool, 1, gpus)
            if spare >= step and shares[d.pool] < d.chosen:
                shares[d.pool] += 1
                spare -= step
        for d in decisions:
            if shares[d.pool] < d.chosen:
                d.reasons.append(f"budget: {name} {budget} leaves {shares[d.pool]}")
                d.chosen = shares[d.pool]


def record_change(decision: Decision, state: PoolState) -> None:
    """The decision changed the pool: cool-downs count from now, slack starts over."""
    if decision.chosen != decision.current:
        state.last_change = decision.at
        state.slack_since = None
        if decision.chosen > decision.current:
            state.last_up = decision.at
