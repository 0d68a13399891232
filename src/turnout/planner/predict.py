"""Forecasts of the next interval's load from the intervals observed: simple enough that a
decision can say why it expected what it did.

* ``moving-average``: the least-squares line through the last ``window`` intervals,
  read one interval ahead (a moving average that follows a trend: on flat load it is the
  mean, on a ramp it leads by the slope);
* ``seasonal-naive``: what was seen one season ago (a day, by default), the last value until
  a whole season is known;
* ``last``: the last interval again.

Each series (request rate, prompt length, output length) is forecast on its own, never below 0.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

PREDICTORS = ("moving-average", "seasonal-naive", "last")


@dataclass(frozen=True, slots=True)
class Load:
    """Requests per second and their mean prompt and output lengths (tokens)."""

    request_rate: float
    prompt_tokens: float
    output_tokens: float

    def as_dict(self) -> dict[str, float]:
        return {
            "request_rate": round(self.request_rate, 4),
            "prompt_tokens": round(self.prompt_tokens, 1),
            "output_tokens": round(self.output_tokens, 1),
        }


class SeriesPredictor(Protocol):
    def add(self, value: float) -> None: ...

    def predict(self) -> float | None:
        """The next value, or None before any was added."""


class LastValue:
    def __init__(self) -> None:
        self._last: float | None = None

    def add(self, value: float) -> None:
        self._last = value

    def predict(self) -> float | None:
        return self._last


class MovingAverageTrend:
    """The least-squares line through the last ``window`` values, one step past the newest."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        self._values: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        self._values.append(value)

    def predict(self) -> float | None:
        values = self._values
        n = len(values)
        if n == 0:
            return None
        mean = sum(values) / n
        if n == 1:
            return mean
        centre = (n - 1) / 2
        spread = sum((i - centre) ** 2 for i in range(n))
        slope = sum((i - centre) * (v - mean) for i, v in enumerate(values)) / spread
        return max(mean + slope * (n - centre), 0.0)


class SeasonalNaive:
    """The value ``season`` steps ago; the newest until that many are known."""

    def __init__(self, season: int) -> None:
        if season < 1:
            raise ValueError("season must be at least 1 interval")
        self._values: deque[float] = deque(maxlen=season)

    def add(self, value: float) -> None:
        self._values.append(value)

    def predict(self) -> float | None:
        values = self._values
        if not values:
            return None
        if len(values) < (values.maxlen or 0):
            return values[-1]
        return values[0]  # ``season`` steps before the next one


def make_series(name: str, *, window: int, season: int) -> SeriesPredictor:
    if name == "moving-average":
        return MovingAverageTrend(window)
    if name == "seasonal-naive":
        return SeasonalNaive(season)
    if name == "last":
        return LastValue()
    raise ValueError(f"unknown predictor {name!r} (one of: {', '.join(PREDICTORS)})")


class LoadPredictor:
    """One ``SeriesPredictor`` per series of ``Load``. Intervals without requests feed a rate of
    0 and leave the lengths as they were (no request says nothing about lengths)."""

    def __init__(self, name: str, *, window: int = 6, season: int = 8640) -> None:
        self.name = name
        self._rate = make_series(name, window=window, season=season)
        self._prompt = make_series(name, window=window, season=season)
        self._output = make_series(name, window=window, season=season)

    def add(self, load: Load) -> None:
        self._rate.add(load.request_rate)
        if load.request_rate > 0:
            self._prompt.add(load.prompt_tokens)
            self._output.add(load.output_tokens)

    def predict(self) -> Load | None:
        rate = self._rate.predict()
        if rate is None:
            return None
        return Load(rate, self._prompt.predict() or 0.0, self._output.predict() or 0.0)
