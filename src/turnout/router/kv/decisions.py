"""The KV router's recent decisions, explained, and how its cache predictions turned out per
worker, for people watching the fleet.

Building a decision's explanation costs more than the decision, so it is built for a sample
of requests: at most ``per_second`` a second (a token bucket, ``burst`` at once), and for
every request whose client or trace asked for it anyway. The last ``capacity`` are kept.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

#: Decisions kept per router.
DEFAULT_CAPACITY = 50


class DecisionLog:
    """A bounded log of explained routing decisions, newest last."""

    __slots__ = ("_clock", "_entries", "_last", "_per_second", "_tokens", "burst")

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        *,
        per_second: float = 2.0,
        burst: int = 5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self._per_second = per_second
        self.burst = burst
        self._tokens = float(burst)
        self._clock = clock
        self._last = clock()

    def wants_sample(self) -> bool:
        """Whether the next decision should be explained for the log (takes a token)."""
        now = self._clock()
        tokens = min(self.burst, self._tokens + (now - self._last) * self._per_second)
        self._last = now
        if tokens < 1.0:
            self._tokens = tokens
            return False
        self._tokens = tokens - 1.0
        return True

    def record(self, entry: dict[str, Any]) -> None:
        self._entries.append(entry)

    def entries(self) -> list[dict[str, Any]]:
        """The kept decisions, newest first."""
        return list(reversed(self._entries))


class WorkerHits:
    """One worker's KV-routed prompts: tokens, those the router predicted cached, and those
    the worker reported cached (the per-worker hit-rate gap)."""

    __slots__ = ("predicted", "prompt", "reported")

    def __init__(self) -> None:
        self.prompt = self.predicted = self.reported = 0

    def add(self, prompt: int, predicted: int, reported: int) -> None:
        self.prompt += prompt
        self.predicted += predicted
        self.reported += reported

    @property
    def gap(self) -> float:
        """Predicted minus reported hit rate (0 before any prompt)."""
        return (self.predicted - self.reported) / self.prompt if self.prompt else 0.0
