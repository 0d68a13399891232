"""A token bucket on an injected clock: a budget that refills at a steady rate up to a cap.

The tenants' limits (``access.limits``) keep one per tenant and limit: requests per second
(one token a request) and tokens per minute (a prompt's tokens at admission, output tokens
as they stream). A bucket may go into debt: output tokens are charged after they are made
(``force_take``), so a stream is never cut for them; the tenant's next request then waits
until the debt is paid back (``debt_wait``).

The bucket is a plain synchronous object with no lock: the frontend uses it from the event
loop only. ``clock`` is any monotonic source of seconds (``time.monotonic``; a test's fake).
"""

from __future__ import annotations

import math
from collections.abc import Callable


class TokenBucket:
    """``capacity`` tokens at most, refilled at ``rate`` tokens a second; starts full.

    ``level`` is the tokens available at the last update, negative while in debt; it is
    written only by ``_refill`` and the two ``take`` methods, and ``configure`` clamps it.
    A refill is lazy and may come at any time without changing what the bucket holds later
    (the same elapsed time adds the same tokens, capped the same way), so only a take needs
    one first; ``debt_wait`` skips it when the last level is not in debt.
    """

    __slots__ = ("_clock", "_stamp", "capacity", "level", "rate")

    def __init__(self, capacity: float, rate: float, clock: Callable[[], float]) -> None:
        if not capacity > 0 or not rate > 0 or math.isinf(capacity) or math.isinf(rate):
            raise ValueError(
                f"a token bucket needs a finite capacity and rate > 0, got {capacity}, {rate}"
            )
        self.capacity = capacity
        self.rate = rate
        self._clock = clock
        self._stamp = clock()
        self.level = capacity

    def configure(self, capacity: float, rate: float) -> None:
        """Take another capacity and rate (a reloaded policy), keeping the tokens the bucket
        holds (at most the new capacity) and its debt."""
        if not capacity > 0 or not rate > 0 or math.isinf(capacity) or math.isinf(rate):
            raise ValueError(
                f"a token bucket needs a finite capacity and rate > 0, got {capacity}, {rate}"
            )
        self._refill(None)
        self.capacity = capacity
        self.rate = rate
        self.level = min(self.level, capacity)

    def _refill(self, now: float | None) -> float:
        if now is None:
            now = self._clock()
        elapsed = now - self._stamp
        self._stamp = now
        if elapsed > 0:
            level = self.level + elapsed * self.rate
            capacity = self.capacity
            self.level = level if level < capacity else capacity
        return self.level

    def try_take(self, n: float, now: float | None = None) -> float:
        """Take ``n`` tokens if the bucket holds them: 0.0 when taken, else the seconds until
        it will (nothing taken). A request larger than the whole capacity is taken from a
        full bucket, which it leaves in debt: it is never refused for good, only rationed.
        ``now``: a reading of the bucket's clock the caller already took (None: read it)."""
        level = self._refill(now)
        need = n if n < self.capacity else self.capacity
        if level >= need:
            self.level = level - n
            return 0.0
        return (need - level) / self.rate

    def force_take(self, n: float, now: float | None = None) -> None:
        """Take ``n`` tokens whatever the bucket holds, going into debt if it must."""
        self.level = self._refill(now) - n

    def debt_wait(self, now: float | None = None) -> float:
        """Seconds until the bucket is out of debt (0.0 when it is not in debt). A bucket
        whose last level is not negative is out of debt whatever the time: no refill."""
        if self.level >= 0:
            return 0.0
        level = self._refill(now)
        return 0.0 if level >= 0 else -level / self.rate

    def is_full(self) -> bool:
        """Whether the bucket holds its whole capacity (it would be the same as a new one)."""
        return self._refill(None) >= self.capacity
