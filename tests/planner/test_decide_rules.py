"""The planner's decision function on recorded observations: no process, no clock but the
``now`` each call is given. A worker of the profile below sustains exactly 5 requests/s at
the lengths used (prompt 100 / 1000 tokens/s + output 10 / 100 tokens/s = 0.2 s a request),
so every expected count is a hand computation."""

from __future__ import annotations

from dataclasses import dataclass

from turnout.planner.capacity import WorkerCapacity
from turnout.planner.decide import (
    Decision,
    Observed,
    Policy,
    PoolLimits,
    PoolState,
    decide,
    fit_budget,
    record_change,
)
from turnout.planner.predict import Load

CAPACITY = WorkerCapacity(prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0, source="test")
POLICY = Policy(
    ttft_slo=0.5,
    itl_slo=0.05,
    up_cooldown=30.0,
    down_cooldown=60.0,
    scale_down_after=60.0,
    down_utilization=0.7,
)
LIMITS = PoolLimits(min_replicas=1, max_replicas=10)


def seen(
    rate: float, *, ttft: float = 0.1, itl: float = 0.01, queued: int = 0, samples: int = 100
) -> Observed:
    return Observed(Load(rate, 100.0, 10.0), ttft_s=ttft, itl_s=itl, queued=queued, samples=samples)


@dataclass
class Pool:
    """One pool replayed through ``decide``, carrying out each decision (``record_change``)."""

    current: int
    pool: str = "aggregated"
    limits: PoolLimits = LIMITS
    policy: Policy = POLICY

    def __post_init__(self) -> None:
        self.state = PoolState()

    def at(self, now: float, observed: Observed, predicted: Load | None = None) -> Decision:
        decision = decide(
            now=now, pool=self.pool, current=self.current, observed=observed,
            predicted=predicted, capacity=CAPACITY, limits=self.limits, policy=self.policy,
            state=self.state,
        )  # fmt: skip
        record_change(decision, self.state)
        self.current = decision.chosen
        return decision


def test_a_worker_of_the_profile_sustains_five_requests_a_second() -> None:
    assert CAPACITY.requests_per_s("aggregated", 100, 10) == 5.0
    assert CAPACITY.requests_per_s("prefill", 100, 10) == 10.0
    assert CAPACITY.requests_per_s("decode", 100, 10) == 10.0


def test_load_rule_sizes_for_the_larger_of_observed_and_predicted() -> None:
    d = Pool(1).at(0, seen(12))
    assert (d.chosen, d.action, d.reasons) == (3, "scale_up", ["load: 12.00 req/s needs 3"])
    d = Pool(1).at(0, seen(5), predicted=Load(16, 100, 10))
    assert d.chosen == 4 and d.reasons == ["load: 16.00 req/s needs 4"]
    d = Pool(1).at(0, seen(15), predicted=Load(2, 100, 10))  # the prediction never lowers it
    assert d.chosen == 3


def test_waiting_requests_are_load_to_serve_within_the_horizon() -> None:
    """A burst queues before it shows in latency (a waiting request has no TTFT yet)."""
    waiting = Observed(Load(4, 100, 10), waiting=30, samples=100)
    d = Pool(1).at(0, waiting)  # 4 req/s + 30 waiting over the 10 s horizon: 7 req/s
    assert d.chosen == 2 and d.reasons == ["load: 7.00 req/s (with 30 waiting) needs 2"]
    queued = Observed(Load(4, 100, 10), queued=30, samples=100)  # at the frontends' admission
    assert Pool(1).at(0, queued).reasons[0] == "load: 7.00 req/s (with 30 waiting) needs 2"
    # A decode pool does not see the frontends' admission queue, only its own workers'.
    assert Pool(1, pool="decode").at(0, queued).reasons[0] == "load: 4.00 req/s needs 1"


def test_slo_breach_scales_up_by_the_overshoot_capped_at_double() -> None:
    # TTFT 1.5x its target on 2 workers: 3; the load alone would need 1.
    d = Pool(2).at(0, seen(5, ttft=0.75))
    assert d.chosen == 3
    assert d.reasons == ["load: 5.00 req/s needs 2", "slo: ttft 750ms over 500ms, asks 3"]
    # 3x: capped at 2x, so 4.
    d = Pool(2).at(0, seen(5, ttft=1.5))
    assert d.chosen == 4
    # ITL speaks for an aggregated pool too; 2x on 3 workers: 6.
    d = Pool(3).at(0, seen(5, itl=0.1))
    assert d.chosen == 6 and d.reasons[-1] == "slo: itl 100ms over 50ms, asks 6"
    # Requests queued at the frontends, latency within target: one more.
    d = Pool(2).at(0, seen(5, queued=3))
    assert d.chosen == 3 and d.reasons[-1] == "slo: 3 queued, 0 rejected, asks 3"


def test_a_breach_caps_the_capacity_at_what_each_worker_carried() -> None:
    pool = Pool(2)
    d = pool.at(0, seen(5, ttft=0.75))  # 2.5 req/s per worker breached: half the profile's
    assert d.extra["correction"] == 0.5 and d.per_worker_rps == 2.5
    # Next interval, calm, same load: the corrected capacity needs 2 workers, not 1, so the
    # pool does not shrink back into the breach (and the correction wears off by 2%).
    d = pool.at(100, seen(5))
    assert d.reasons[0] == "load: 5.00 req/s needs 2"
    assert d.extra["correction"] == 0.55
    # One breach halves the correction at most, whatever the rate that breached.
    pool = Pool(10)
    d = pool.at(0, seen(5, ttft=0.75))  # 0.5 req/s per worker: a tenth of the profile's
    assert d.extra["correction"] == 0.5


def test_a_percentile_of_too_few_requests_is_no_breach() -> None:
    d = Pool(1).at(0, seen(1, ttft=2.0, samples=4))
    assert d.chosen == 1 and not any(r.startswith("slo") for r in d.reasons)
    assert d.extra["correction"] == 1.0
    d = Pool(1).at(0, seen(1, ttft=2.0, samples=5))
    assert d.chosen == 2


def test_up_cooldown_holds_a_second_scale_up() -> None:
    pool = Pool(2)
    assert pool.at(0, seen(5, ttft=0.75)).chosen == 3
    d = pool.at(10, seen(5, ttft=0.75))
    assert (d.chosen, d.action) == (3, "hold")
    assert d.reasons[-1] == "cool-down: 10s of 30s since the last scale-up"
    d = pool.at(30, seen(5, ttft=0.75))
    # Cool-down over: the SLO rule asks ceil(3 x 1.5) = 5. The breach at t=0 set the
    # correction to 0.5 (2.5 req/s carried per worker); the one at t=10 came right after a
    # change and left it; the one at t=30, in a pool steady for 30 s, lowers it to what each
    # worker carried, 5/3 req/s (a third): the load rule needs 3.
    assert d.chosen == 5
    assert d.reasons == ["load: 5.00 req/s needs 3", "slo: ttft 750ms over 500ms, asks 5"]
    assert d.extra["correction"] == 0.3333


def test_slack_scales_down_after_it_lasts_and_at_most_by_half() -> None:
    pool = Pool(6)
    for now in (0, 30, 59):
        d = pool.at(now, seen(5))
        assert d.chosen == 6, now
    assert d.reasons[-1] == "slack for 59s of 60s before scaling down"
    d = pool.at(60, seen(5))  # needs 1 (2 at 70%), but sheds at most half: 3
    assert (d.chosen, d.reasons[-1]) == (3, "slack for 60s: down to 3")
    # Slack starts over after a change, and the down cool-down runs from it too.
    assert pool.at(100, seen(5)).chosen == 3
    d = pool.at(160, seen(5))
    assert d.chosen == 2  # max(2 at 70%, 3 - 1)
    assert pool.at(300, seen(5)).chosen == 2  # 5 req/s at 70% of 5 needs 2: it stays


def test_down_cooldown_counts_from_the_last_change() -> None:
    pool = Pool(4)
    assert pool.at(0, seen(5, ttft=0.6)).chosen == 5  # a change at t=0
    pool.at(1, seen(1))  # slack from t=1 ...
    d = pool.at(61, seen(1))  # ... for 60 s, and 61 s since the change: down, by half at most
    assert d.chosen == 3
    policy = Policy(ttft_slo=0.5, itl_slo=0.05, down_cooldown=120.0, scale_down_after=60.0)
    pool = Pool(4, policy=policy)
    pool.at(0, seen(5, ttft=0.6))
    pool.at(1, seen(1))
    d = pool.at(61, seen(1))
    assert d.chosen == 5 and d.reasons[-1] == "cool-down: 61s of 120s since the last change"
    assert pool.at(120, seen(1)).chosen == 3


def test_hysteresis_holds_a_pool_the_load_fits_only_at_full_utilization() -> None:
    # 10 req/s fits 2 workers at 100% but needs 3 at 70%: hold, slack never starts.
    pool = Pool(3)
    for now in (0, 100, 200):
        d = pool.at(now, seen(10))
        assert d.chosen == 3
    assert d.reasons[-1] == "hysteresis: 10.00 req/s needs 3 at 70% utilization"
    assert pool.state.slack_since is None
    # 6.9 req/s fits 2 at 70%: slack, then down to 2.
    assert pool.at(300, seen(6.9)).chosen == 3
    assert pool.at(360, seen(6.9)).chosen == 2


def test_breach_and_slack_never_mix() -> None:
    pool = Pool(6)
    pool.at(0, seen(5))
    d = pool.at(70, seen(5, ttft=0.6))  # breaching: no scale-down, whatever the load says
    assert d.chosen >= 6


def test_bounds_name_themselves() -> None:
    d = Pool(3, limits=PoolLimits(1, 4)).at(0, seen(5, ttft=1.5))
    assert d.chosen == 4 and d.reasons[-1] == "bound: max 4"
    d = Pool(0, limits=PoolLimits(2, 8)).at(0, seen(0))
    assert d.chosen == 2 and d.reasons[-1] == "bound: min 2"
    assert d.action == "scale_up"


def test_disaggregated_pools_answer_to_their_own_latency() -> None:
    # TTFT over its target: the prefill pool grows, the decode pool does not.
    observed = seen(5, ttft=1.0)
    prefill = Pool(2, pool="prefill").at(0, observed)
    decode = Pool(2, pool="decode").at(0, observed)
    assert prefill.chosen == 4 and any(r.startswith("slo: ttft") for r in prefill.reasons)
    assert decode.chosen == 2 and not any(r.startswith("slo") for r in decode.reasons)
    # ITL over: the decode pool grows.
    observed = seen(5, itl=0.075)
    assert Pool(2, pool="prefill").at(0, observed).chosen == 2
    assert Pool(2, pool="decode").at(0, observed).chosen == 3
    # Each sized to its phase: prompts 100 tokens at 1000/s, outputs 10 at 100/s: 10 req/s.
    assert Pool(1, pool="prefill").at(0, seen(25)).chosen == 3


def _decisions(chosen: dict[str, int]) -> list[Decision]:
    return [
        Decision(at=0, pool=pool, current=1, wanted=n, chosen=n, reasons=[], observed=seen(1),
                 predicted=None, capacity=CAPACITY, per_worker_rps=5.0)
        for pool, n in chosen.items()
    ]  # fmt: skip


def test_budget_of_workers_shares_in_proportion() -> None:
    decisions = _decisions({"prefill": 6, "decode": 4})
    limits = {"prefill": PoolLimits(1, 10), "decode": PoolLimits(1, 10)}
    fit_budget(decisions, limits, Policy(ttft_slo=1, itl_slo=1, max_workers=5))
    assert [(d.pool, d.chosen) for d in decisions] == [("prefill", 3), ("decode", 2)]
    assert decisions[0].reasons == ["budget: max-workers 5 leaves 3"]
    # Within the budget: untouched.
    decisions = _decisions({"prefill": 2, "decode": 3})
    fit_budget(decisions, limits, Policy(ttft_slo=1, itl_slo=1, max_workers=5))
    assert [d.chosen for d in decisions] == [2, 3] and all(not d.reasons for d in decisions)


def test_budget_of_gpus_counts_each_pool_s_gpus_and_keeps_minimums() -> None:
    decisions = _decisions({"prefill": 4, "decode": 4})
    limits = {"prefill": PoolLimits(1, 10, gpus_per_worker=1),
              "decode": PoolLimits(1, 10, gpus_per_worker=2)}  # fmt: skip
    fit_budget(decisions, limits, Policy(ttft_slo=1, itl_slo=1, max_gpus=8))
    # 4 + 8 GPUs asked, 8 allowed: 2/3 each (2 and 2, 6 GPUs), the spare 2 GPUs: one more
    # prefill worker (1 GPU); a decode worker (2) no longer fits.
    assert [(d.pool, d.chosen) for d in decisions] == [("prefill", 3), ("decode", 2)]
    decisions = _decisions({"prefill": 1, "decode": 9})
    limits = {"prefill": PoolLimits(1, 10), "decode": PoolLimits(1, 10)}
    fit_budget(decisions, limits, Policy(ttft_slo=1, itl_slo=1, max_workers=4))
    assert [d.chosen for d in decisions] == [1, 3]  # the minimum stays, decode takes the rest


def test_a_recorded_day_replays_to_exact_counts() -> None:
    """Every 10 s for three minutes: a ramp, a breach at the top, a plateau, a fall."""
    pool = Pool(1, policy=Policy(ttft_slo=0.5, itl_slo=0.05, up_cooldown=20.0,
                                 down_cooldown=30.0, scale_down_after=30.0))  # fmt: skip
    day = [
        seen(2), seen(6), seen(11), seen(14, ttft=0.9), seen(16), seen(16), seen(15),
        seen(15), seen(8), seen(4), seen(3), seen(3), seen(2), seen(2), seen(2), seen(1),
        seen(1), seen(1),
    ]  # fmt: skip
    chosen = [pool.at(10.0 * i, observed).chosen for i, observed in enumerate(day)]
    assert chosen == [1, 2, 2, 4, 4, 4, 4, 4, 4, 4, 4, 2, 2, 2, 2, 1, 1, 1]
    # Why, at the turns: a cool-down held the ramp at t=20, the breach at t=30 asked 2 x 1.8;
    # 15 req/s fits 3 workers but not at 70%; slack from t=80 for 30 s, then half, then 1.
