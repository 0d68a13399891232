"""How long the KV router's decisions take, as histogram counts a metrics exporter reads.

The router observes once per decision, on the event loop; the frontend renders the counts
at scrape time (``turnout_kv_router_decision_seconds``). Plain integer increments, no lock
(one thread observes and reads): the observation costs less than a microsecond.
"""

from __future__ import annotations

from bisect import bisect_left

__all__ = ["DECISION_BUCKETS", "DurationHistogram"]

#: Upper bounds (seconds) of the decision-time buckets: 10 us to 10 ms, about three a decade
#: and finer where decisions usually fall (tens to hundreds of microseconds).
DECISION_BUCKETS = (
    10e-6, 15e-6, 20e-6, 30e-6, 40e-6, 50e-6, 75e-6, 100e-6, 150e-6, 200e-6, 300e-6, 400e-6,
    500e-6, 750e-6, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 10e-3,
)  # fmt: skip


class DurationHistogram:
    """Counts of durations per bucket: ``counts[i]`` fell in ``(bounds[i-1], bounds[i]]``
    (not cumulative), the last past every bound (+Inf). Written only by ``observe``."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = DECISION_BUCKETS) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError(f"bucket bounds must be increasing and distinct: {bounds}")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        # bisect_left: the first bound >= seconds, i.e. Prometheus' "le" bucket.
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)
