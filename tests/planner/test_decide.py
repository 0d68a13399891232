"""Each decision rule on recorded observations, replayed through ``decide`` with the time a
plain number the test advances: no process, no clock, no sleep.

One worker of ``CAPACITY`` sustains exactly 10 requests/s at the lengths observed here
(aggregated: 200 prompt tokens at 4000/s plus 5 output tokens at 100/s is 0.1 s a request;
a prefill or a decode worker alone: 20/s), so every expected count is worked out by hand in
the comment beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from turnout.planner.capacity import WorkerCapacity
from turnout.planner.decide import (
    MIN_SAMPLES,
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

PROMPT = 200.0
OUTPUT = 5.0
CAPACITY = WorkerCapacity(prefill_tokens_per_s=4000.0, decode_tokens_per_s=100.0, source="test")
POLICY = Policy(
    ttft_slo=1.0,
    itl_slo=0.05,
    up_cooldown=30.0,
    down_cooldown=60.0,
    scale_down_after=60.0,
    down_utilization=0.7,
)
LIMITS = PoolLimits(min_replicas=1, max_replicas=10)


def obs(
    rate: float,
    *,
    ttft: float | None = 0.4,
    itl: float | None = 0.02,
    queued: int = 0,
    rejected: int = 0,
    samples: int = 50,
) -> Observed:
    """One interval as ``observe.interval`` reports it."""
    return Observed(
        Load(rate, PROMPT, OUTPUT), ttft_s=ttft, itl_s=itl, queued=queued, rejected=rejected,
        samples=samples,
    )  # fmt: skip


@dataclass
class Replay:
    """One pool fed recorded intervals. ``now`` is the injected clock: each ``step`` moves it
    forward and decides; the decision is carried out (``record_change``) as the planner does
    once its connector has acted."""

    current: int
    pool: str = "aggregated"
    limits: PoolLimits = LIMITS
    policy: Policy = POLICY
    now: float = 0.0
    state: PoolState = field(default_factory=PoolState)

    def decide(self, observed: Observed, predicted: Load | None = None) -> Decision:
        """Decide at ``now`` without carrying it out (for the budget, which comes after)."""
        return decide(
            now=self.now, pool=self.pool, current=self.current, observed=observed,
            predicted=predicted, capacity=CAPACITY, limits=self.limits, policy=self.policy,
            state=self.state,
        )  # fmt: skip

    def carry_out(self, decision: Decision) -> None:
        record_change(decision, self.state)
        self.current = decision.chosen

    def at(self, now: float, observed: Observed, predicted: Load | None = None) -> Decision:
        assert now >= self.now, "the clock only goes forward"
        self.now = now
        decision = self.decide(observed, predicted)
        self.carry_out(decision)
        return decision


def test_the_capacity_the_counts_below_are_computed_from() -> None:
    assert CAPACITY.requests_per_s("aggregated", PROMPT, OUTPUT) == 10.0
    assert CAPACITY.requests_per_s("prefill", PROMPT, OUTPUT) == 20.0
    assert CAPACITY.requests_per_s("decode", PROMPT, OUTPUT) == 20.0


# -- load ---------------------------------------------------------------------------------


def test_load_rule_is_rate_over_capacity_rounded_up() -> None:
    d = Replay(1).at(0, obs(25))  # 25 / 10: 3
    assert (d.wanted, d.chosen, d.action) == (3, 3, "scale_up")
    assert d.reasons == ["load: 25.00 req/s needs 3"]
    assert d.per_worker_rps == 10.0
    assert Replay(1).at(0, obs(30)).chosen == 3  # exactly 3 workers' worth: not 4
    assert Replay(1).at(0, obs(30.01)).chosen == 4
    d = Replay(5).at(0, obs(50))
    assert (d.chosen, d.action) == (5, "hold")


def test_load_rule_takes_the_larger_rate_and_the_predicted_lengths() -> None:
    d = Replay(1).at(0, obs(12), predicted=Load(41, PROMPT, OUTPUT))  # 41 / 10: 5
    assert d.chosen == 5 and d.reasons == ["load: 41.00 req/s needs 5"]
    assert Replay(1).at(0, obs(41), predicted=Load(3, PROMPT, OUTPUT)).chosen == 5
    # Predicted prompts of 600 tokens: 0.15 + 0.05 s a request, 5/s a worker: 12 / 5 -> 3.
    d = Replay(1).at(0, obs(12), predicted=Load(12, 600, OUTPUT))
    assert d.chosen == 3 and d.per_worker_rps == pytest.approx(5.0)
    # A prediction that knows no length keeps the observed ones.
    assert Replay(1).at(0, obs(12), predicted=Load(12, 0, 0)).chosen == 2


def test_no_requests_need_no_workers_but_the_minimum() -> None:
    d = Replay(0).at(0, obs(0, ttft=None, itl=None, samples=0))
    assert (d.wanted, d.chosen) == (0, 1)
    assert d.reasons == ["load: 0.00 req/s needs 0", "bound: min 1"]


# -- SLO breach ---------------------------------------------------------------------------


def test_ttft_breach_scales_up_in_proportion() -> None:
    # 2 workers, load for 1, TTFT 1.5x its target: ceil(2 x 1.5) = 3.
    d = Replay(2).at(0, obs(5, ttft=1.5))
    assert (d.wanted, d.chosen) == (3, 3)
    assert d.reasons == ["load: 5.00 req/s needs 1", "slo: ttft 1500ms over 1000ms, asks 3"]
    # 3x: the factor is capped at 2, so 4.
    d = Replay(2).at(0, obs(5, ttft=3.0))
    assert d.chosen == 4 and d.reasons[-1] == "slo: ttft 3000ms over 1000ms, asks 4"
    # 5 workers at 1.5x: ceil(7.5) = 8.
    assert Replay(5).at(0, obs(5, ttft=1.5)).chosen == 8


def test_a_slight_breach_asks_one_more() -> None:
    d = Replay(4).at(0, obs(5, ttft=1.01))  # ceil(4 x 1.01) = 5 = 4 + 1
    assert d.chosen == 5
    d = Replay(1).at(0, obs(5, ttft=1.2))  # ceil(1.2) = 2
    assert d.chosen == 2


def test_the_worse_of_ttft_and_itl_speaks_for_an_aggregated_pool() -> None:
    d = Replay(2).at(0, obs(5, ttft=1.2, itl=0.09))  # ITL 1.8x beats TTFT 1.2x: 4
    assert d.chosen == 4 and d.reasons[-1] == "slo: itl 90ms over 50ms, asks 4"


def test_the_load_rule_wins_when_it_asks_more_than_the_breach() -> None:
    d = Replay(2).at(0, obs(55, ttft=1.1))  # load: 6; breach: 3
    assert d.chosen == 6
    assert d.reasons == ["load: 55.00 req/s needs 6", "slo: ttft 1100ms over 1000ms, asks 3"]


def test_queued_or_rejected_requests_are_a_breach_of_one_more() -> None:
    d = Replay(3).at(0, obs(5, rejected=4))
    assert d.chosen == 4 and d.reasons[-1] == "slo: 0 queued, 4 rejected, asks 4"
    assert d.extra["correction"] == 0.5  # 5/3 req/s a worker: a sixth, halved at most
    # Queued: plus 2 waiting over the 10 s horizon, 5.2 req/s at the halved 5 a worker: 2.
    d = Replay(3).at(0, obs(5, queued=2))
    assert d.chosen == 4
    assert d.reasons == [
        "load: 5.20 req/s (with 2 waiting) needs 2",
        "slo: 2 queued, 0 rejected, asks 4",
    ]


def test_a_percentile_of_too_few_requests_is_not_a_breach() -> None:
    d = Replay(2).at(0, obs(5, ttft=3.0, samples=MIN_SAMPLES - 1))
    assert d.chosen == 2 and all(not r.startswith("slo") for r in d.reasons)
    assert Replay(2).at(0, obs(5, ttft=3.0, samples=MIN_SAMPLES)).chosen == 4


# -- the correction a breach leaves -------------------------------------------------------


def test_a_breach_caps_the_capacity_so_the_next_interval_holds() -> None:
    pool = Replay(2)
    d = pool.at(0, obs(10, ttft=1.5))  # each worker carried 5 req/s and breached
    assert d.chosen == 3
    assert d.extra["correction"] == 0.5 and d.per_worker_rps == 5.0
    # Calm next interval at the same load. Uncorrected, 10 req/s would need 1 worker (2 at
    # 70%) and slack would start towards 2. Corrected (0.5, worn off by 10%: 0.55, so 5.5
    # req/s a worker), it needs 2, and 3 at 70%: the pool holds, no slack starts.
    d = pool.at(15, obs(10))
    assert d.chosen == 3
    assert d.extra["correction"] == pytest.approx(0.55)
    assert d.reasons == [
        "load: 10.00 req/s needs 2",
        "hysteresis: 10.00 req/s needs 3 at 70% utilization",
    ]
    assert pool.state.slack_since is None
    # The same calm interval without the breach's memory starts the slack clock.
    fresh = Replay(3)
    d = fresh.at(15, obs(10))
    assert d.reasons[-1] == "slack for 0s of 60s before scaling down"
    assert fresh.state.slack_since == 15


def test_the_correction_is_what_each_worker_carried_at_most_halved_per_breach() -> None:
    d = Replay(4).at(0, obs(30, ttft=1.5))  # 7.5 req/s a worker of 10: 0.75
    assert d.extra["correction"] == 0.75 and d.per_worker_rps == 7.5
    d = Replay(4).at(0, obs(60, ttft=1.5))  # 15 a worker: more than the estimate, no cut
    assert d.extra["correction"] == 1.0
    pool = Replay(10, limits=PoolLimits(1, 40))
    assert pool.at(0, obs(10, ttft=1.5)).extra["correction"] == 0.5  # 0.1 carried: halved
    # A second breach in a pool steady for the up cool-down halves it again.
    assert pool.at(15, obs(10, ttft=1.5)).extra["correction"] == 0.5  # 15 s after a change
    assert pool.at(45, obs(10, ttft=1.5)).extra["correction"] == 0.25


def test_a_breach_with_no_load_or_no_workers_leaves_the_correction() -> None:
    d = Replay(2).at(0, obs(0, ttft=1.5))
    assert d.chosen == 3 and d.extra["correction"] == 1.0
    d = Replay(0).at(0, obs(5, ttft=1.5))
    assert d.chosen == 1 and d.extra["correction"] == 1.0


# -- cool-downs ---------------------------------------------------------------------------


def test_up_cooldown_holds_a_scale_up_after_a_change() -> None:
    pool = Replay(2)
    assert pool.at(100, obs(25)).chosen == 3
    assert pool.state.last_change == 100
    d = pool.at(110, obs(45))  # wants 5, 10 s after the change
    assert (d.wanted, d.chosen, d.action) == (5, 3, "hold")
    assert d.reasons[-1] == "cool-down: 10s of 30s since the last scale-up"
    d = pool.at(129.5, obs(45))
    assert d.chosen == 3 and d.reasons[-1] == "cool-down: 30s of 30s since the last scale-up"
    assert pool.state.last_change == 100  # a hold is no change
    assert pool.at(130, obs(45)).chosen == 5


def test_a_decision_not_carried_out_starts_no_cooldown() -> None:
    pool = Replay(2)
    d = pool.decide(obs(25))
    assert d.chosen == 3 and pool.state.last_change is None  # until ``record_change``
    pool.now = 5
    assert pool.decide(obs(25)).chosen == 3


def test_a_pool_that_just_shrank_grows_again_at_once() -> None:
    """The up cool-down waits for added workers to show; after a scale-down there are none."""
    pool = Replay(
        4, policy=Policy(ttft_slo=1.0, itl_slo=0.05, scale_down_after=0.0, down_cooldown=0.0)
    )
    assert pool.at(0, obs(5)).chosen == 2  # slack at once: down by half
    d = pool.at(20, obs(35))
    assert (d.wanted, d.chosen) == (4, 4)
    assert pool.state.last_up == 20 and pool.state.last_change == 20


def test_down_cooldown_counts_from_the_last_change() -> None:
    policy = Policy(ttft_slo=1.0, itl_slo=0.05, scale_down_after=30.0, down_cooldown=120.0)
    pool = Replay(3, policy=policy)
    assert pool.at(0, obs(35)).chosen == 4  # a change at t=0
    assert pool.at(10, obs(5)).chosen == 4  # slack from t=10
    d = pool.at(40, obs(5))  # slack for 30 s, but 40 s since the change
    assert d.chosen == 4 and d.reasons[-1] == "cool-down: 40s of 120s since the last change"
    d = pool.at(119, obs(5))
    assert d.chosen == 4 and d.reasons[-1] == "cool-down: 119s of 120s since the last change"
    d = pool.at(120, obs(5))
    assert d.chosen == 2 and d.reasons[-1] == "slack for 110s: down to 2"


# -- slack and hysteresis -----------------------------------------------------------------


def test_slack_scales_down_only_after_it_lasts_and_by_half_at_most() -> None:
    pool = Replay(8)
    for now in (0.0, 30.0, 59.0):
        d = pool.at(now, obs(10))  # needs 1, and 2 at 70%
        assert d.chosen == 8
    assert d.reasons == ["load: 10.00 req/s needs 1", "slack for 59s of 60s before scaling down"]
    d = pool.at(60, obs(10))  # 60 s of slack: down, but 8 sheds 4 at most
    assert (d.chosen, d.action) == (4, "scale_down")
    assert d.reasons[-1] == "slack for 60s: down to 4"
    # Slack starts over after the change, and the down cool-down runs from it.
    assert pool.at(70, obs(10)).chosen == 4
    d = pool.at(120, obs(10))
    assert d.chosen == 4 and d.reasons[-1] == "slack for 50s of 60s before scaling down"
    d = pool.at(130, obs(10))  # slack 60 s, 70 s since the change: max(2 at 70%, 4 - 2)
    assert d.chosen == 2
    d = pool.at(400, obs(10))  # 10 req/s at 70% of 10 needs 2: it stays
    assert d.chosen == 2 and d.reasons[-1] == "hysteresis: 10.00 req/s needs 2 at 70% utilization"


def test_an_odd_pool_sheds_less_than_half() -> None:
    pool = Replay(5, policy=Policy(ttft_slo=1.0, itl_slo=0.05, scale_down_after=0.0))
    assert pool.at(0, obs(1)).chosen == 3  # 5 // 2 = 2 shed
    pool = Replay(3, policy=Policy(ttft_slo=1.0, itl_slo=0.05, scale_down_after=0.0))
    assert pool.at(0, obs(1)).chosen == 2


def test_a_busy_interval_resets_the_slack() -> None:
    pool = Replay(4)
    pool.at(0, obs(5))
    assert pool.state.slack_since == 0
    pool.at(30, obs(40))  # the load fits exactly: no slack
    assert pool.state.slack_since is None
    pool.at(40, obs(5))
    d = pool.at(70, obs(5))  # 30 s of new slack, not 70
    assert d.chosen == 4 and d.reasons[-1] == "slack for 30s of 60s before scaling down"
    assert pool.at(100, obs(5)).chosen == 2


def test_hysteresis_holds_a_load_that_fits_one_less_only_at_full_utilization() -> None:
    # 18 req/s on 3: 2 workers carry it at 100% (18 / 10), but 70% needs 3 (18 / 7).
    pool = Replay(3)
    for now in (0.0, 100.0, 1000.0):
        d = pool.at(now, obs(18))
        assert (d.wanted, d.chosen) == (2, 3)
        assert d.reasons[-1] == "hysteresis: 18.00 req/s needs 3 at 70% utilization"
        assert pool.state.slack_since is None
    # 14 req/s fits 2 at 70% exactly: slack, then down to 2 after it lasted.
    assert pool.at(1010, obs(14)).chosen == 3
    assert pool.state.slack_since == 1010
    assert pool.at(1070, obs(14)).chosen == 2


# -- bounds -------------------------------------------------------------------------------


def test_bounds_cap_the_count_and_say_so() -> None:
    d = Replay(3, limits=PoolLimits(1, 4)).at(0, obs(5, ttft=3.0))  # asks 6
    assert (d.wanted, d.chosen) == (6, 4)
    assert d.reasons[-1] == "bound: max 4"
    d = Replay(6, limits=PoolLimits(1, 4)).at(0, obs(55))  # a lowered maximum: down to it
    assert (d.chosen, d.action) == (4, "scale_down") and d.reasons[-1] == "bound: max 4"
    d = Replay(0, limits=PoolLimits(2, 8)).at(0, obs(5))
    assert (d.chosen, d.action) == (2, "scale_up") and d.reasons[-1] == "bound: min 2"


def test_slack_never_goes_under_the_minimum() -> None:
    pool = Replay(
        2, limits=PoolLimits(2, 8), policy=Policy(ttft_slo=1.0, itl_slo=0.05, scale_down_after=0.0)
    )
    d = pool.at(0, obs(0, ttft=None, itl=None, samples=0))
    assert (d.chosen, d.action) == (2, "hold")
    assert d.reasons[-1] == "bound: min 2"


# -- budget -------------------------------------------------------------------------------


def decided(pools: dict[str, tuple[int, Observed, PoolLimits]], policy: Policy) -> list[Decision]:
    """Each pool's decision at t=0, then the budget over all of them."""
    decisions = [
        Replay(current, pool=pool, limits=limits, policy=policy).decide(observed)
        for pool, (current, observed, limits) in pools.items()
    ]
    fit_budget(decisions, {pool: limits for pool, (_, _, limits) in pools.items()}, policy)
    return decisions


def test_max_workers_splits_across_prefill_and_decode() -> None:
    policy = Policy(ttft_slo=1.0, itl_slo=0.05, max_workers=6)
    prefill, decode = decided(
        {
            "prefill": (2, obs(5, ttft=3.0), LIMITS),  # asks 4
            "decode": (3, obs(5, itl=0.1), LIMITS),  # asks 6
        },
        policy,
    )
    # 10 asked, 6 allowed: 2.4 and 3.6, so 2 and 3, and the spare one to the larger
    # remainder (decode's 0.6).
    assert (prefill.chosen, decode.chosen) == (2, 4)
    assert prefill.reasons[-1] == "budget: max-workers 6 leaves 2"
    assert decode.reasons[-1] == "budget: max-workers 6 leaves 4"
    assert (prefill.wanted, decode.wanted) == (4, 6)  # what was asked stays on record


def test_within_the_budget_nothing_changes() -> None:
    policy = Policy(ttft_slo=1.0, itl_slo=0.05, max_workers=10, max_gpus=10)
    prefill, decode = decided(
        {"prefill": (2, obs(5, ttft=3.0), LIMITS), "decode": (3, obs(5, itl=0.1), LIMITS)},
        policy,
    )
    assert (prefill.chosen, decode.chosen) == (4, 6)
    assert not any(r.startswith("budget") for r in prefill.reasons + decode.reasons)


def test_max_gpus_counts_each_pool_s_gpus_per_worker() -> None:
    policy = Policy(ttft_slo=1.0, itl_slo=0.05, max_gpus=10)
    prefill, decode = decided(
        {
            "prefill": (2, obs(5, ttft=3.0), PoolLimits(1, 10, gpus_per_worker=1)),  # 4 GPUs
            "decode": (3, obs(5, itl=0.1), PoolLimits(1, 10, gpus_per_worker=2)),  # 12 GPUs
        },
        policy,
    )
    # 16 GPUs asked, 10 allowed (5/8): 2.5 and 3.75 workers, so 2 and 3 (8 GPUs); the spare
    # 2 GPUs go to the larger remainder, decode's, one 2-GPU worker: 2 + 4 x 2 = 10.
    assert (prefill.chosen, decode.chosen) == (2, 4)
    assert decode.reasons[-1] == "budget: max-gpus 10 leaves 4"


def test_both_budgets_apply_one_after_the_other() -> None:
    policy = Policy(ttft_slo=1.0, itl_slo=0.05, max_workers=5, max_gpus=6)
    prefill, decode = decided(
        {
            "prefill": (2, obs(5, ttft=3.0), PoolLimits(1, 10)),  # asks 4
            "decode": (2, obs(5, itl=0.1), PoolLimits(1, 10, gpus_per_worker=2)),  # asks 4
        },
        policy,
    )
    # Workers: 8 to 5 (2.5 each: 2 and 2, the spare to the first of equal remainders):
    # 3 and 2. GPUs: 3 + 4 = 7 to 6 (6/7: 2.57 and 1.71, so 2 and 1, 4 GPUs), the spare 2
    # to decode's larger remainder: 2 and 2, 6 GPUs.
    assert (prefill.chosen, decode.chosen) == (2, 2)
    assert prefill.reasons[-2:] == ["budget: max-workers 5 leaves 3", "budget: max-gpus 6 leaves 2"]
    assert decode.reasons[-1] == "budget: max-workers 5 leaves 2"


def test_the_budget_keeps_each_pool_s_minimum() -> None:
    policy = Policy(ttft_slo=1.0, itl_slo=0.05, max_workers=4)
    prefill, decode = decided(
        {
            "prefill": (1, obs(5), PoolLimits(1, 10)),  # 1
            "decode": (5, obs(5, itl=0.1), PoolLimits(1, 10)),  # asks 10
        },
        policy,
    )
    # 11 to 4: prefill's 0.36 would round to 0, its minimum keeps 1; decode 3.6 -> 3.
    assert (prefill.chosen, decode.chosen) == (1, 3)


def test_a_minimum_lifted_share_is_taken_from_the_other_pools() -> None:
    """``max_workers`` 6: prefill (minimum 2) keeps 2, so decode gets the 4 left, not 5."""
    policy = Policy(ttft_slo=1.0, itl_slo=0.05, max_workers=6)
    prefill, decode = decided(
        {
            "prefill": (2, obs(5), PoolLimits(2, 10)),  # 2 (its minimum)
            "decode": (5, obs(5, itl=0.1), PoolLimits(1, 10)),  # asks 10
        },
        policy,
    )
    # 12 to 6 (half): prefill 1, lifted to its minimum 2; decode 5: 7 workers. Within the
    # budget, the decode pool has 4.
    assert prefill.chosen + decode.chosen <= 6
    assert (prefill.chosen, decode.chosen) == (2, 4)


# -- disaggregated pools ------------------------------------------------------------------


def test_ttft_breach_moves_prefill_not_decode() -> None:
    observed = obs(5, ttft=2.0)
    prefill = Replay(2, pool="prefill").at(0, observed)
    decode = Replay(2, pool="decode").at(0, observed)
    assert prefill.chosen == 4 and prefill.reasons[-1] == "slo: ttft 2000ms over 1000ms, asks 4"
    assert (decode.chosen, decode.action) == (2, "hold")
    assert not any(r.startswith("slo") for r in decode.reasons)


def test_itl_breach_moves_decode_not_prefill() -> None:
    observed = obs(5, itl=0.075)
    prefill = Replay(2, pool="prefill").at(0, observed)
    decode = Replay(2, pool="decode").at(0, observed)
    assert (prefill.chosen, prefill.action) == (2, "hold")
    assert decode.chosen == 3 and decode.reasons[-1] == "slo: itl 75ms over 50ms, asks 3"


def test_the_frontends_queue_is_the_prefill_pool_s_breach_not_decode_s() -> None:
    observed = obs(5, queued=3, rejected=1)
    assert Replay(2, pool="prefill").at(0, observed).chosen == 3
    decode = Replay(2, pool="decode").at(0, observed)
    assert decode.chosen == 2 and decode.reasons[0] == "load: 5.00 req/s needs 1"
    assert not any(r.startswith("slo") for r in decode.reasons)
    assert decode.extra["correction"] == 1.0


def test_each_phase_is_sized_by_its_own_capacity() -> None:
    assert Replay(1, pool="prefill").at(0, obs(50)).chosen == 3  # 50 / 20
    assert Replay(1, pool="decode").at(0, obs(61)).chosen == 4  # 61 / 20
    assert Replay(1).at(0, obs(50)).chosen == 5  # aggregated: 50 / 10


# -- a recorded sequence ------------------------------------------------------------------


def test_a_recorded_ramp_and_drop_replays_to_exact_counts() -> None:
    """Every 15 s: a ramp, two breaches at the top, then the load falls away.

    t=0    8 req/s            1 (needs 1)
    t=15   14                 2 (needs 2)
    t=30   22                 2 (needs 3: 15 s into the up cool-down)
    t=45   26, TTFT 1.8x      4 (load 3, slo ceil(2 x 1.8) = 4; 13 req/s a worker: no cut)
    t=60   30, TTFT 1.2x      4 (slo asks 5, cool-down; right after a change: no cut)
    t=75   30, TTFT 1.5x      6 (steady pool: correction 7.5/10 = 0.75; slo asks 6)
    t=90   30                 6 (correction 0.825: needs 4, 6 at 70%: hysteresis)
    t=105  28                 6 (correction 0.9075: 5 at 70%: slack from here)
    t=120  24 .. t=150  12    6 (slack for 15, 30, 45 s)
    t=165  8                  3 (slack 60 s, 90 s since the change: half of 6)
    t=180  6 .. t=225  4      3 (slack anew from t=180)
    t=240  4                  2 (slack 60 s: max(1 at 70%, 3 - 1))
    t=255  3                  2 (slack anew)
    """
    recorded = [
        obs(8), obs(14), obs(22), obs(26, ttft=1.8), obs(30, ttft=1.2), obs(30, ttft=1.5),
        obs(30, ttft=0.6), obs(28), obs(24), obs(20), obs(12), obs(8), obs(6), obs(5), obs(4),
        obs(4), obs(4), obs(3),
    ]  # fmt: skip
    pool = Replay(1)
    decisions = [pool.at(15.0 * i, observed) for i, observed in enumerate(recorded)]
    assert [d.chosen for d in decisions] == [1, 2, 2, 4, 4, 6, 6, 6, 6, 6, 6, 3, 3, 3, 3, 3, 2, 2]
    assert [d.extra["correction"] for d in decisions[3:8]] == [1.0, 1.0, 0.75, 0.825, 0.9075]
    assert decisions[4].reasons[-1] == "cool-down: 15s of 30s since the last scale-up"
    assert decisions[6].reasons[-1] == "hysteresis: 30.00 req/s needs 6 at 70% utilization"
    assert decisions[11].reasons[-1] == "slack for 60s: down to 3"
    assert decisions[16].reasons[-1] == "slack for 60s: down to 2"
    assert pool.state.last_change == 240 and pool.state.slack_since == 255
    actions = [d.action for d in decisions]
    assert actions.count("scale_up") == 3 and actions.count("scale_down") == 2
    # Every decision is a record a dashboard can read.
    assert decisions[5].as_dict()["action"] == "scale_up"
    assert "pool aggregated: scale_up 4 -> 6" in decisions[5].summary()
