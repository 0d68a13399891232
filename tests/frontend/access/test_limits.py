"""Tenants' limits: rps, tokens per minute (prompt at admission, output into debt), requests
in flight, policy reloads, the bound on tenants' state, and the refusals counted."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from turnout.frontend.access.limits import (
    CONCURRENCY_RETRY_AFTER,
    EVICTION_SCAN,
    OUTPUT_FLUSH_TOKENS,
    TenantLimitExceeded,
    TenantLimits,
    check_policy,
)
from turnout.frontend.access.principal import ANONYMOUS, Principal, TenantPolicy
from turnout.frontend.access.usage import TenantUsage


class Clock:
    def __init__(self) -> None:
        self.time = 100.0

    def __call__(self) -> float:
        return self.time


def rejections(registry: CollectorRegistry, tenant: str, limit: str) -> float | None:
    return registry.get_sample_value(
        "turnout_tenant_rejections_total", {"tenant": tenant, "limit": limit}
    )


def who(tenant: str, **policy: float) -> Principal:
    return Principal(tenant=tenant, key_id=f"{tenant}-key", policy=TenantPolicy(**policy))  # type: ignore[arg-type]


def test_an_unlimited_tenant_keeps_no_state() -> None:
    limits = TenantLimits(Clock())
    for _ in range(1000):
        ticket = limits.admit(ANONYMOUS)
        ticket.charge_prompt(10**6)
        ticket.charge_output(10**6)
        ticket.release()
    assert len(limits) == 0


def test_rps_refuses_past_one_seconds_worth_with_retry_after() -> None:
    clock = Clock()
    registry = CollectorRegistry()
    limits = TenantLimits(clock, rejections=TenantUsage(registry))
    alice = who("alice", rps=2)
    limits.admit(alice).release()
    limits.admit(alice).release()
    with pytest.raises(TenantLimitExceeded) as caught:
        limits.admit(alice)
    exc = caught.value
    assert (exc.tenant, exc.limit) == ("alice", "rps")
    assert exc.retry_after == pytest.approx(0.5)
    assert "'rps'" in str(exc) and "(2)" in str(exc)
    # Another tenant is not affected; time refills alice.
    limits.admit(who("bob", rps=2)).release()
    clock.time += 0.5
    limits.admit(alice).release()
    assert rejections(registry, "alice", "rps") == 1
    assert rejections(registry, "bob", "rps") is None


def test_a_fractional_rps_still_admits_one_request() -> None:
    clock = Clock()
    limits = TenantLimits(clock)
    slow = who("slow", rps=0.1)
    limits.admit(slow).release()
    with pytest.raises(TenantLimitExceeded) as caught:
        limits.admit(slow)
    assert caught.value.retry_after == pytest.approx(10.0)


def test_max_concurrent_counts_tickets_until_released_once() -> None:
    limits = TenantLimits(Clock())
    alice = who("alice", max_concurrent=2)
    first, second = limits.admit(alice), limits.admit(alice)
    with pytest.raises(TenantLimitExceeded) as caught:
        limits.admit(alice)
    assert caught.value.limit == "max_concurrent"
    assert caught.value.retry_after == CONCURRENCY_RETRY_AFTER
    first.release()
    first.release()  # idempotent: frees one slot, not two
    third = limits.admit(alice)
    with pytest.raises(TenantLimitExceeded):
        limits.admit(alice)
    second.release()
    third.release()


def test_a_refusal_takes_nothing() -> None:
    """A request refused for concurrency does not spend the tenant's rps."""
    limits = TenantLimits(Clock())
    alice = who("alice", rps=1, max_concurrent=1)
    held = limits.admit(alice)
    with pytest.raises(TenantLimitExceeded) as caught:
        limits.admit(alice)
    assert caught.value.limit == "max_concurrent"
    held.release()
    with pytest.raises(TenantLimitExceeded) as caught:
        limits.admit(alice)  # the one rps token went to ``held``
    assert caught.value.limit == "rps"


def test_prompt_tokens_are_charged_and_refused_when_the_budget_cannot_pay() -> None:
    clock = Clock()
    registry = CollectorRegistry()
    limits = TenantLimits(clock, rejections=TenantUsage(registry))
    alice = who("alice", tokens_per_minute=600)  # 10 a second
    ticket = limits.admit(alice)
    ticket.charge_prompt(500)
    ticket.release()
    ticket = limits.admit(alice)
    with pytest.raises(TenantLimitExceeded) as caught:
        ticket.charge_prompt(200)
    assert caught.value.limit == "tokens_per_minute"
    assert caught.value.retry_after == pytest.approx(10.0)
    ticket.charge_prompt(100)  # the refused charge took nothing
    ticket.release()
    assert rejections(registry, "alice", "tokens_per_minute") == 1


def test_output_tokens_overdraw_and_the_debt_refuses_the_next_request() -> None:
    clock = Clock()
    limits = TenantLimits(clock)
    alice = who("alice", tokens_per_minute=60)  # 1 a second
    ticket = limits.admit(alice)
    ticket.charge_prompt(50)
    for _ in range(40):
        ticket.charge_output(1)  # never refused: the stream goes on
    ticket.release()
    with pytest.raises(TenantLimitExceeded) as caught:
        limits.admit(alice)
    assert caught.value.limit == "tokens_per_minute"
    assert caught.value.retry_after == pytest.approx(30.0)
    clock.time += 30
    limits.admit(alice).release()


def test_a_streams_output_reaches_the_budget_while_it_streams_and_the_rest_at_release() -> None:
    clock = Clock()
    limits = TenantLimits(clock)
    alice = who("alice", tokens_per_minute=60)  # 1 a second, 60 at most
    stream = limits.admit(alice)
    stream.charge_prompt(60)
    for _ in range(OUTPUT_FLUSH_TOKENS - 1):
        stream.charge_output(1)
    limits.admit(alice).release()  # nothing taken yet: not in debt
    stream.charge_output(1)
    with pytest.raises(TenantLimitExceeded) as caught:
        limits.admit(alice)  # the stream's output so far overdrew the budget
    assert caught.value.retry_after == pytest.approx(OUTPUT_FLUSH_TOKENS)
    stream.charge_output(3)
    stream.release()
    stream.release()  # charges the 3 owed once
    with pytest.raises(TenantLimitExceeded) as caught:
        limits.admit(alice)
    assert caught.value.retry_after == pytest.approx(OUTPUT_FLUSH_TOKENS + 3)


def test_a_reloaded_policy_applies_at_the_next_admission() -> None:
    clock = Clock()
    limits = TenantLimits(clock)
    limits.admit(who("alice", rps=1)).release()
    with pytest.raises(TenantLimitExceeded):
        limits.admit(who("alice", rps=1))
    # Raised to 5 a second: the bucket keeps its (empty) level and refills faster.
    with pytest.raises(TenantLimitExceeded) as caught:
        limits.admit(who("alice", rps=5))
    assert caught.value.retry_after == pytest.approx(0.2)
    clock.time += 0.2
    limits.admit(who("alice", rps=5)).release()
    # Limits removed: unlimited, and no longer counted.
    for _ in range(10):
        limits.admit(who("alice")).release()


def test_tenants_state_is_bounded_and_an_idle_tenant_is_evicted_first() -> None:
    clock = Clock()
    limits = TenantLimits(clock, max_tenants=3)
    busy = limits.admit(who("t0", max_concurrent=1))
    for i in (1, 2):
        limits.admit(who(f"t{i}", rps=1)).release()
    assert len(limits) == 3
    limits.admit(who("t3", rps=1)).release()  # evicts t1, the oldest idle, not busy t0
    assert len(limits) == 3
    with pytest.raises(TenantLimitExceeded):
        limits.admit(who("t0", max_concurrent=1))
    limits.admit(who("t1", rps=1)).release()  # from full buckets again
    busy.release()


def test_an_evicted_tenants_ticket_still_releases() -> None:
    limits = TenantLimits(Clock(), max_tenants=1)
    ticket = limits.admit(who("a", max_concurrent=1))
    limits.admit(who("b", max_concurrent=1))  # all busy: the oldest goes anyway
    assert len(limits) == 1
    ticket.release()
    limits.admit(who("a", max_concurrent=1))


def test_eviction_scans_a_bounded_window() -> None:
    n = EVICTION_SCAN + 5
    limits = TenantLimits(Clock(), max_tenants=n)
    held = [limits.admit(who(f"t{i}", max_concurrent=1)) for i in range(EVICTION_SCAN)]
    for i in range(EVICTION_SCAN, n):
        limits.admit(who(f"t{i}", max_concurrent=1)).release()
    limits.admit(who("new", max_concurrent=1)).release()
    # Every tenant in the window was busy: the oldest (t0) was evicted.
    limits.admit(who("t0", max_concurrent=1)).release()
    for ticket in held:
        ticket.release()


@pytest.mark.parametrize(
    "policy",
    [TenantPolicy(rps=0), TenantPolicy(tokens_per_minute=-5), TenantPolicy(max_concurrent=0),
     TenantPolicy(rps=float("inf")), TenantPolicy(rps=float("nan"))],
)  # fmt: skip
def test_check_policy_refuses_what_no_bucket_holds(policy: TenantPolicy) -> None:
    with pytest.raises(ValueError, match="finite number > 0"):
        check_policy(policy)


def test_check_policy_accepts_limits_and_none() -> None:
    check_policy(TenantPolicy())
    check_policy(TenantPolicy(rps=0.5, tokens_per_minute=1000, max_concurrent=3, priority=-2))
