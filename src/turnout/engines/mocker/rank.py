"""One data-parallel rank of a ``MockerEngine``: its scheduler, the output streams of its
requests and its loop's counters; and where a worker's KV events and load reports go.

A stream is a deque and a waiter future (cheaper than an ``asyncio.Queue`` per token), filled
by the rank's loop and drained by the request's ``generate`` consumer. It is bounded by
back-pressure, not by refusing outputs: once it holds ``STREAM_HIGH_WATER`` undelivered
outputs the engine pauses the request in its scheduler (no more steps for it), and once the
consumer has taken it down to ``STREAM_LOW_WATER`` it resumes it and wakes the rank's loop.
A request's stream thus holds at most ``STREAM_HIGH_WATER`` outputs plus a final one.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from turnout.engines.mocker.scheduler import Scheduler, StepResult
from turnout.protocols.disagg import PrefillParams
from turnout.protocols.kv import KvEventBatch, LoadReport, StepSample
from turnout.protocols.llm import LLMEngineOutput
from turnout.runtime.context import RequestContext
from turnout.runtime.request_plane.framing import WINDOW

#: Undelivered outputs (one token each) at which a request is paused. Behind a stream sit the
#: worker's output buffer and the request plane's credit window, which hold their own share
#: when the client stalls; twice the window lets a consumer that reads in window-sized
#: bursts keep up without ever pausing, while a stalled one costs a few kilobytes.
STREAM_HIGH_WATER = 2 * WINDOW
#: Undelivered outputs at or below which a paused request resumes (hysteresis, so that a
#: reader slightly behind does not pause and resume its request at every token).
STREAM_LOW_WATER = WINDOW

#: Step timings sent with one load report at most (a uniform sample of the steps since the
#: previous one): reports go out on every change, so this bounds a report, not the data.
STEP_SAMPLES_PER_REPORT = 32


class KvEventSink(Protocol):
    """Where a worker's KV events and load reports go (the event plane, or a test recorder).

    Called synchronously from the engine loop, in order; must not block.
    """

    def publish_kv(self, batch: KvEventBatch) -> None: ...

    def publish_load(self, report: LoadReport) -> None: ...


class NullEventSink:
    """Drops everything: the default when nobody listens."""

    def publish_kv(self, batch: KvEventBatch) -> None:
        pass

    def publish_load(self, report: LoadReport) -> None:
        pass


class Stream:
    """One request's outputs, from the engine loop to its ``generate`` consumer.

    ``items`` and ``waiter`` are shared by the loop (``push``) and the consumer; ``paused``
    and ``watcher`` are changed only by the engine's pause / resume (see the module
    docstring).
    """

    __slots__ = ("ctx", "items", "num_prompt_tokens", "paused", "prefill", "waiter", "watcher")

    def __init__(
        self,
        ctx: RequestContext,
        prefill: PrefillParams | None = None,
        num_prompt_tokens: int = 0,
    ) -> None:
        self.ctx = ctx
        self.items: deque[LLMEngineOutput] = deque()
        self.waiter: asyncio.Future[None] | None = None
        #: A prefill-stage request: where its KV goes (its blocks are parked when it ends).
        self.prefill = prefill
        self.num_prompt_tokens = num_prompt_tokens
        #: The request is paused in the scheduler because this stream is full.
        self.paused = False
        #: While paused: a task that wakes the rank's loop if ``ctx`` is cancelled (a parked
        #: loop would not notice otherwise).
        self.watcher: asyncio.Task[None] | None = None

    @property
    def is_full(self) -> bool:
        """At the high-water mark: the request must not be stepped until it drains."""
        return len(self.items) >= STREAM_HIGH_WATER

    @property
    def has_drained(self) -> bool:
        """At or below the low-water mark: a paused request may resume."""
        return len(self.items) <= STREAM_LOW_WATER

    def stop_watching(self) -> None:
        """Cancel the cancellation watcher, if any (the pause ended, or the stream did)."""
        watcher = self.watcher
        if watcher is not None:
            self.watcher = None
            watcher.cancel()

    def push(self, out: LLMEngineOutput) -> None:
        self.items.append(out)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


@dataclass(slots=True)
class MockerStats:
    """Counters of one rank's loop, for benchmarks: is the simulation keeping up?"""

    #: Steps run, and their summed simulated GPU time (before the speedup).
    num_steps: int = 0
    simulated_s: float = 0.0
    #: Wall seconds the loop fell behind real time and wrote off (0 when it keeps up).
    late_s: float = 0.0

    def add(self, other: MockerStats) -> MockerStats:
        return MockerStats(
            self.num_steps + other.num_steps,
            self.simulated_s + other.simulated_s,
            self.late_s + other.late_s,
        )


class Rank:
    """One data-parallel rank: a scheduler, its streams and its loop's state."""

    __slots__ = (
        "dp_rank",
        "last_beat",
        "last_load_key",
        "next_report",
        "scheduler",
        "stats",
        "step_samples",
        "steps_since_report",
        "streams",
        "task",
        "wake",
    )

    def __init__(self, scheduler: Scheduler, dp_rank: int) -> None:
        self.scheduler = scheduler
        self.dp_rank = dp_rank
        self.streams: dict[str, Stream] = {}
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.last_load_key: tuple[int, ...] | None = None
        self.next_report = 0.0
        self.stats = MockerStats()
        #: When the loop last went round (the health probe's heartbeat).
        self.last_beat = 0.0
        #: A uniform sample (reservoir) of the steps since the last load report.
        self.step_samples: list[StepSample] = []
        self.steps_since_report = 0

    def sample_step(self, result: StepResult, speedup: float, rng: random.Random) -> None:
        """Offer a finished step to the reservoir sent with the next load report."""
        seconds = result.duration_s / speedup if speedup > 0 else 0.0
        sample = StepSample(result.num_prefill_tokens, result.num_decodes, seconds, result.kv_usage)
        self.steps_since_report += 1
        if len(self.step_samples) < STEP_SAMPLES_PER_REPORT:
            self.step_samples.append(sample)
        else:
            slot = rng.randrange(self.steps_since_report)
            if slot < STEP_SAMPLES_PER_REPORT:
                self.step_samples[slot] = sample
