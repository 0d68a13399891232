"""The token bucket on an injected clock: refill, waits, debt, reconfiguration."""

from __future__ import annotations

import pytest

from turnout.frontend.access.buckets import TokenBucket


class Clock:
    def __init__(self) -> None:
        self.time = 100.0

    def __call__(self) -> float:
        return self.time


def test_starts_full_and_refuses_past_capacity_with_the_wait() -> None:
    clock = Clock()
    bucket = TokenBucket(10, 2.0, clock)
    assert bucket.try_take(10) == 0.0
    # Empty: one token comes in half a second at 2 a second; nothing is taken.
    assert bucket.try_take(1) == pytest.approx(0.5)
    assert bucket.try_take(4) == pytest.approx(2.0)
    clock.time += 0.5
    assert bucket.try_take(1) == 0.0
    assert bucket.level == pytest.approx(0.0)


def test_refill_stops_at_capacity() -> None:
    clock = Clock()
    bucket = TokenBucket(5, 1.0, clock)
    bucket.try_take(5)
    clock.time += 1_000
    assert bucket.is_full()
    assert bucket.try_take(5) == 0.0
    assert bucket.try_take(1) == pytest.approx(1.0)


def test_force_take_goes_into_debt_and_debt_wait_says_when_it_is_paid() -> None:
    clock = Clock()
    bucket = TokenBucket(60, 1.0, clock)
    assert bucket.debt_wait() == 0.0
    bucket.force_take(90)
    assert bucket.level == pytest.approx(-30)
    assert bucket.debt_wait() == pytest.approx(30.0)
    clock.time += 10
    assert bucket.debt_wait() == pytest.approx(20.0)
    # While in debt even one token waits for the debt and the token.
    assert bucket.try_take(1) == pytest.approx(21.0)
    clock.time += 20
    assert bucket.debt_wait() == 0.0


def test_a_request_larger_than_the_capacity_waits_for_a_full_bucket_then_overdraws() -> None:
    clock = Clock()
    bucket = TokenBucket(100, 10.0, clock)
    bucket.try_take(50)
    assert bucket.try_take(250) == pytest.approx(5.0)  # until full, not forever
    clock.time += 5
    assert bucket.try_take(250) == 0.0
    assert bucket.debt_wait() == pytest.approx(15.0)


def test_configure_keeps_what_the_bucket_holds_within_the_new_capacity() -> None:
    clock = Clock()
    bucket = TokenBucket(100, 10.0, clock)
    bucket.try_take(40)
    bucket.configure(50, 1.0)
    assert bucket.level == pytest.approx(50)
    bucket.force_take(60)
    bucket.configure(200, 5.0)
    assert bucket.debt_wait() == pytest.approx(2.0)


def test_a_clock_that_goes_back_adds_nothing() -> None:
    clock = Clock()
    bucket = TokenBucket(10, 1.0, clock)
    bucket.try_take(10)
    clock.time -= 50
    assert bucket.try_take(1) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("capacity", "rate"), [(0, 1.0), (1, 0.0), (-1, 1.0), (float("inf"), 1.0), (1, float("nan"))]
)
def test_refuses_a_bucket_that_cannot_work(capacity: float, rate: float) -> None:
    with pytest.raises(ValueError, match="token bucket"):
        TokenBucket(capacity, rate, Clock())
