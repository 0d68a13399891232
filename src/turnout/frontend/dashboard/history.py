"""The last minutes of the frontend's latency and traffic, as a time series for the dashboard.

Nothing is added to the request path: a sampler reads the frontend's own histograms (TTFT,
inter-token latency; their per-bucket counts, summed over models) and its request counter
every ``interval_s`` seconds, and keeps the difference from the previous reading, one point
per interval, in a bounded ring. Percentiles of a point come from its bucket counts, with
linear interpolation inside the bucket as Prometheus' ``histogram_quantile`` does, so they
are as fine as the buckets (``metrics.frontend.LATENCY_BUCKETS``).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from turnout.frontend.metrics.frontend import LATENCY_BUCKETS, FrontendMetrics
from turnout.runtime.histograms import quantile

#: Seconds between two points.
DEFAULT_INTERVAL_S = 5.0
#: Points kept: ten minutes at the default interval.
DEFAULT_POINTS = 120
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True, slots=True)
class Point:
    """One interval: when it ended (wall clock), requests completed per second, and the
    TTFT and ITL quantiles (``QUANTILES``, seconds; None without observations)."""

    time: float
    requests_per_s: float
    ttft: tuple[float | None, ...]
    itl: tuple[float | None, ...]
    ttft_count: int
    itl_count: int


class LatencyHistory:
    """The ring of ``Point`` s; ``sample`` is called every ``interval_s`` (``run``)."""

    def __init__(
        self,
        metrics: FrontendMetrics,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        points: int = DEFAULT_POINTS,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._metrics = metrics
        self.interval_s = interval_s
        self._clock = clock
        self._wall = wall
        self.points: collections.deque[Point] = collections.deque(maxlen=points)
        self._last_at = clock()
        self._last_ttft = metrics.ttft.total_counts()
        self._last_itl = metrics.itl.total_counts()
        self._last_requests = metrics.requests_completed()

    def sample(self) -> Point:
        """Close the interval since the previous sample: one more point."""
        now = self._clock()
        metrics = self._metrics
        ttft, itl = metrics.ttft.total_counts(), metrics.itl.total_counts()
        requests = metrics.requests_completed()
        d_ttft = [a - b for a, b in zip(ttft, self._last_ttft, strict=True)]
        d_itl = [a - b for a, b in zip(itl, self._last_itl, strict=True)]
        elapsed = max(now - self._last_at, 1e-9)
        point = Point(
            time=self._wall(),
            requests_per_s=(requests - self._last_requests) / elapsed,
            ttft=tuple(quantile(q, LATENCY_BUCKETS, d_ttft) for q in QUANTILES),
            itl=tuple(quantile(q, LATENCY_BUCKETS, d_itl) for q in QUANTILES),
            ttft_count=sum(d_ttft),
            itl_count=sum(d_itl),
        )
        self.points.append(point)
        self._last_at, self._last_ttft, self._last_itl = now, ttft, itl
        self._last_requests = requests
        return point
