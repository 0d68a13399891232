"""Quantiles of Prometheus-style histograms: what the dashboard and the planner read from
bucket counts (of an interval: the difference of two cumulative readings)."""

from __future__ import annotations

from collections.abc import Sequence


def quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """The ``q`` quantile of observations counted per bucket (``counts[i]`` in the bucket
    ending at ``bounds[i]``; the last count is above every bound), interpolated linearly
    within its bucket. None: no observation."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, n in enumerate(counts):
        if n > 0 and seen + n >= rank:
            if i >= len(bounds):  # above the last bound: all that can be said
                return bounds[-1]
            lower = bounds[i - 1] if i else 0.0
            return lower + (bounds[i] - lower) * ((rank - seen) / n)
        seen += n
    return bounds[-1]
