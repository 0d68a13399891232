"""Admission control: how many requests the frontend runs at once, and who waits for a slot.

Two limits, checked before a request is preprocessed (tokenizing is work worth guarding):

* ``max_inflight``: requests in flight in the whole frontend (0: unlimited);
* ``max_inflight_per_model``: requests in flight for one model (0: unlimited), so one hot
  model cannot take every slot.

A request that finds no room waits in one bounded queue, ordered by priority (higher first;
``nvext.priority``) and first-come-first-served within a priority. When a slot frees, the
first waiter in that order whose model has room takes it. A waiter leaves the queue

* admitted (a ``Ticket``, released when the request ends);
* rejected when its wait passes ``queue_timeout`` seconds (``FrontendOverloaded``, reason
  ``queue_timeout``, or ``model_limit`` when its own model's limit held it back);
* rejected at once when the queue is full (reason ``queue_full`` / ``model_limit``); a
  newcomer of strictly higher priority than the last waiter takes that waiter's place and
  the displaced one is rejected instead, so a full queue of bulk traffic never shuts out
  urgent requests;
* at once when its task is cancelled (the client disconnected): its place is free again.

Memory is bounded whatever the offered load: at most ``queue_size`` waiters (each with one
timer), and per-model counters only for models that have requests in flight.

Invariant (kept by ``_dispatch`` after every change): no waiter could be admitted now. So
the fast path of ``acquire`` is a room check and two increments: when there is room for the
request's model, nobody queued could have used it.

Time comes from an injected ``Clock`` (``now`` and ``call_later``), so tests drive queue
timeouts without waiting on the wall clock.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from turnout.errors import ConfigError, FrontendOverloaded

#: Rejection reasons (bounded: they are metric label values).
QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
MODEL_LIMIT = "model_limit"


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The admission settings (``--max-inflight``, ``--max-inflight-per-model``,
    ``--queue-size``, ``--queue-timeout``)."""

    #: Requests in flight in the whole frontend; 0: unlimited.
    max_inflight: int = 1024
    #: Requests in flight per model; 0: unlimited.
    max_inflight_per_model: int = 0
    #: Requests that may wait for a slot; 0: none wait, a request without room is rejected.
    queue_size: int = 1024
    #: Seconds a request may wait for a slot before it is rejected.
    queue_timeout: float = 30.0

    def validate(self) -> None:
        """``ConfigError`` naming the flag, for a value that makes no sense."""
        for flag, value in (
            ("--max-inflight", self.max_inflight),
            ("--max-inflight-per-model", self.max_inflight_per_model),
            ("--queue-size", self.queue_size),
        ):
            if value < 0:
                raise ConfigError(f"{flag} must be >= 0 (0: unlimited), got {value}")
        if not self.queue_timeout > 0:
            raise ConfigError(f"--queue-timeout must be > 0 seconds, got {self.queue_timeout}")


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Where admission reads time and schedules queue timeouts."""

    def now(self) -> float: ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable: ...


class LoopClock:
    """The running event loop's monotonic clock and timers."""

    __slots__ = ()

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable:
        return asyncio.get_running_loop().call_later(delay, callback)


class Ticket:
    """One admitted request's slot; ``release()`` it when the request ends (idempotent)."""

    __slots__ = ("_controller", "model", "waited")

    def __init__(self, controller: AdmissionController, model: str, waited: float) -> None:
        self._controller: AdmissionController | None = controller
        self.model = model
        #: Seconds spent in the queue (0.0 when admitted at once).
        self.waited = waited

    def release(self) -> None:
        controller = self._controller
        if controller is not None:
            self._controller = None
            controller._release(self.model)


class _Waiter:
    __slots__ = ("enqueued", "future", "key", "model", "timer")

    def __init__(
        self, model: str, key: tuple[int, int], enqueued: float, future: asyncio.Future[Ticket]
    ) -> None:
        self.model = model
        #: ``(priority, -arrival)``: the queue is sorted ascending on it, so its *end* is the
        #: next to admit (highest priority, earliest arrival) and its start the first to
        #: displace.
        self.key = key
        self.enqueued = enqueued
        self.future = future
        self.timer: Cancellable | None = None


def _key(waiter: _Waiter) -> tuple[int, int]:
    return waiter.key


class AdmissionController:
    """Counts requests in flight against the limits and runs the wait queue (module doc)."""

    def __init__(self, limits: AdmissionLimits, *, clock: Clock | None = None) -> None:
        limits.validate()
        self.limits = limits
        self.clock: Clock = clock or LoopClock()
        self._max = limits.max_inflight or None
        self._max_model = limits.max_inflight_per_model or None
        #: Requests admitted and not yet released.
        self.inflight = 0
        #: Per model, only while a model limit is set and the model has requests in flight.
        self._per_model: dict[str, int] = {}
        #: Sorted by ``_Waiter.key``; the next to admit is the last.
        self._queue: list[_Waiter] = []
        self._arrivals = 0

    @property
    def queued(self) -> int:
        """Requests waiting for a slot now."""
        return len(self._queue)

    def model_inflight(self, model: str) -> int:
        """Requests of ``model`` in flight (counted only while a per-model limit is set)."""
        return self._per_model.get(model, 0)

    # ------------------------------------------------------------------ admission

    def _model_full(self, model: str) -> bool:
        return self._max_model is not None and self._per_model.get(model, 0) >= self._max_model

    def _grant(self, model: str, waited: float) -> Ticket:
        self.inflight += 1
        if self._max_model is not None:
            self._per_model[model] = self._per_model.get(model, 0) + 1
        return Ticket(self, model, waited)

    async def acquire(self, model: str, priority: int = 0) -> Ticket:
        """A slot for one request of ``model``: at once when there is room, else after a
        wait in the queue. Raises ``FrontendOverloaded`` when the request is rejected; a cancelled
        caller leaves the queue (or gives back a slot granted in the same instant)."""
        if (self._max is None or self.inflight < self._max) and not self._model_full(model):
            return self._grant(model, 0.0)
        return await self._wait(model, priority)

    def _reject_reason(self, model: str, default: str) -> str:
        return MODEL_LIMIT if self._model_full(model) else default

    def _rejection(self, model: str, reason: str, waited: float) -> FrontendOverloaded:
        limits = self.limits
        if reason == MODEL_LIMIT:
            why = (
                f"model {model!r} has {self._per_model.get(model, 0)} requests in flight, "
                f"its limit (--max-inflight-per-model {limits.max_inflight_per_model})"
            )
            if waited:
                why += f"; waited {waited:.1f} s for a slot"
            elif limits.queue_size:
                why += f", and the wait queue is full ({limits.queue_size})"
        elif reason == QUEUE_TIMEOUT:
            why = (
                f"no request slot freed within {limits.queue_timeout:g} s "
                f"(--queue-timeout; {self.inflight} in flight, limit {limits.max_inflight})"
            )
        else:
            why = (
                f"{self.inflight} requests in flight (--max-inflight {limits.max_inflight}) "
                f"and {len(self._queue)} waiting (--queue-size {limits.queue_size})"
            )
        return FrontendOverloaded(
            f"server overloaded: {why}; retry later", reason=reason, waited=waited
        )

    async def _wait(self, model: str, priority: int) -> Ticket:
        queue = self._queue
        size = self.limits.queue_size
        if len(queue) >= size:
            # Full: a newcomer of strictly higher priority displaces the last waiter.
            if not queue or priority <= queue[0].key[0]:
                raise self._rejection(model, self._reject_reason(model, QUEUE_FULL), 0.0)
            displaced = queue.pop(0)
            self._fail(displaced, QUEUE_FULL)
        clock = self.clock
        self._arrivals += 1
        future: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(model, (priority, -self._arrivals), clock.now(), future)
        bisect.insort(queue, waiter, key=_key)
        waiter.timer = clock.call_later(self.limits.queue_timeout, lambda: self._expire(waiter))
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().release()  # granted in the same instant: give it back
            else:
                self._remove(waiter)
            raise

    def _remove(self, waiter: _Waiter) -> bool:
        """Take ``waiter`` out of the queue (False when it was not there) and stop its timer."""
        if waiter.timer is not None:
            waiter.timer.cancel()
            waiter.timer = None
        queue = self._queue
        i = bisect.bisect_left(queue, waiter.key, key=_key)
        if i < len(queue) and queue[i] is waiter:
            del queue[i]
            return True
        return False

    def _fail(self, waiter: _Waiter, reason: str) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
            waiter.timer = None
        if not waiter.future.done():
            waited = max(self.clock.now() - waiter.enqueued, 0.0)
            reason = self._reject_reason(waiter.model, reason)
            waiter.future.set_exception(self._rejection(waiter.model, reason, waited))

    def _expire(self, waiter: _Waiter) -> None:
        waiter.timer = None
        if self._remove(waiter):
            self._fail(waiter, QUEUE_TIMEOUT)

    def _release(self, model: str) -> None:
        self.inflight -= 1
        if self._max_model is not None:
            n = self._per_model.get(model, 0) - 1
            if n > 0:
                self._per_model[model] = n
            else:
                self._per_model.pop(model, None)
        if self._queue:
            self._dispatch()

    def _dispatch(self) -> None:
        """Admit waiters, best first, while there is room (restores the invariant)."""
        queue = self._queue
        now = self.clock.now()
        i = len(queue) - 1
        while i >= 0 and (self._max is None or self.inflight < self._max):
            waiter = queue[i]
            if self._model_full(waiter.model):
                i -= 1  # held back by its model's limit: look at the next in line
                continue
            del queue[i]
            i -= 1
            if waiter.timer is not None:
                waiter.timer.cancel()
                waiter.timer = None
            if not waiter.future.done():
                waiter.future.set_result(self._grant(waiter.model, max(now - waiter.enqueued, 0.0)))

    def close(self) -> None:
        """Reject every waiter (the frontend is stopping)."""
        queue, self._queue = self._queue, []
        for waiter in queue:
            self._fail(waiter, QUEUE_FULL)
