"""A manual clock for admission tests: time moves only when the test says so."""

from __future__ import annotations

from collections.abc import Callable


class FakeTimer:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """``now()`` and ``call_later()`` as ``admission.Clock``; ``advance()`` runs due timers."""

    def __init__(self, start: float = 1000.0) -> None:
        self.time = start
        self.timers: list[FakeTimer] = []

    def now(self) -> float:
        return self.time

    def call_later(self, delay: float, callback: Callable[[], None]) -> FakeTimer:
        timer = FakeTimer(self.time + delay, callback)
        self.timers.append(timer)
        return timer

    @property
    def pending(self) -> int:
        """Timers scheduled and neither run nor cancelled."""
        return sum(not t.cancelled for t in self.timers)

    def advance(self, seconds: float) -> None:
        self.time += seconds
        due = sorted(
            (t for t in self.timers if not t.cancelled and t.when <= self.time),
            key=lambda t: t.when,
        )
        self.timers = [t for t in self.timers if not t.cancelled and t.when > self.time]
        for timer in due:
            timer.callback()
