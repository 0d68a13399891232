"""The llama.cpp engine's load, as the event loop sees it, and the ``LoadReport``s made of it.

Given a sink (the engine's ``set_event_sink``; the worker wires the event plane) and its
worker id (``bind_instance``: the instance id, known only once the worker registered; nothing
is published before), the engine publishes a ``LoadReport`` on every change (a request
admitted, taking a slot, producing its first token, ending) and at least every
``load_report_interval_s`` (a task started by ``start``), so the KV router's TTFT cost
calibrates on the real model rather than running on its prior:

* ``num_running``: requests whose native call holds a slot; ``num_waiting``: admitted
  requests waiting in Python for a slot; ``busy`` at the bound where new requests are
  refused as ``overloaded``; ``active_prefill_tokens``: prompt tokens of requests without a
  first token yet (whole prompts: what the slot's prompt cache will save is known only at
  the first token); ``kv_usage``: the tokens of the running requests over ``n_ctx`` (an
  estimate: llama.cpp also keeps idle slots' prompts for reuse, evictable);
  ``max_num_batched_tokens``: llama.cpp's ``n_batch`` (its server loop fills one batch with
  at most that many tokens, capped at ``n_ctx``).
* ``steps`` (at most 32 per report, a uniform sample of those since the previous report)
  come from llama.cpp's per-request timings (``timings_per_token``: ``prompt_n``,
  ``prompt_ms``, ``predicted_n``, ``predicted_ms``, ``cache_n``). A request's first chunk
  gives one prefill sample: ``prompt_n`` tokens computed (cached ones excluded) in
  ``prompt_ms``, beside the requests decoding at that moment (split in ``n_batch`` pieces
  when longer). While it decodes, every ~100 ms of ``predicted_ms`` gives one decode sample,
  the seconds per token over that span, beside the requests decoding then.

  Caveat: these are per-request times, not step times. llama.cpp batches all slots into
  each step, so a prompt's time includes the decode tokens of other slots, and prompts of
  two slots in one batch are each charged the shared batch. With one slot busy at a time
  they are step times; under concurrency they are an approximation the fit averages over.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from typing import Final, Protocol

from turnout.protocols.kv import LoadReport, StepSample

log = logging.getLogger(__name__)

#: Step samples sent with one load report at most (a uniform sample of those since the
#: previous report): reports go out on every change, so this bounds a report, not the data.
STEP_SAMPLES_PER_REPORT: Final = 32

# A request's place, as the event loop sees it (``TrackedRequest.phase``).
WAITING: Final = 0  # admitted, waiting in Python for a slot
RUNNING: Final = 1  # its native call holds a slot
DONE: Final = 2  # its native call returned, or it left before it got a slot


class LoadReportSink(Protocol):
    """Where load reports go (the worker's ``EventPlaneSink``, a test's recorder). Called on
    the event loop; must not block."""

    def publish_load(self, report: LoadReport) -> None: ...


class TrackedRequest(Protocol):
    """What the tracker reads and sets of one request (the engine's ``RequestStream``)."""

    #: Prompt tokens, and tokens generated so far.
    prompt_tokens: int
    num_tokens: int
    #: ``WAITING`` / ``RUNNING`` / ``DONE``, set by the tracker.
    phase: int
    #: Whether its first token came (its prompt is computed), set by the tracker.
    decoding: bool


class LoadTracker:
    """The engine's load, as the event loop sees it, and its ``LoadReport``s.

    Runs on the event loop only: pool threads reach it through ``call_soon_threadsafe``, in
    order (a stream's ``started`` comes before its samples and its ``ended``). Reports go
    out on change (``publish()`` after each transition) and on the steady beat
    (``publish(force=True)``); nothing goes out before the worker id is known.
    """

    def __init__(self, *, n_ctx: int, bound: int, interval_s: float, seed: int) -> None:
        self.n_ctx = n_ctx
        #: Requests in flight at which the engine refuses more (``overloaded``).
        self.bound = bound
        self.interval_s = interval_s
        self.sink: LoadReportSink | None = None
        self.worker_id: int | None = None
        #: False while the engine is stopped: state is kept, nothing is published.
        self.enabled = False
        #: llama.cpp's per-step token budget (``n_batch``, at most ``n_ctx``), once started.
        self.step_budget = 0
        #: Admitted streams (``generate``'s), and those holding a slot.
        self.in_flight = 0
        self.running: dict[TrackedRequest, None] = {}
        self.num_waiting = 0
        self.waiting_tokens = 0
        self.samples: list[StepSample] = []
        self.samples_seen = 0
        self._rng = random.Random(seed)
        self._last_key: tuple[int, int, int, bool] | None = None
        #: ``time.monotonic()`` by which the next report is due.
        self.next_report = 0.0

    # ---- transitions

    def admitted(self, stream: TrackedRequest) -> None:
        """``generate`` took the request: it waits for a slot."""
        self.in_flight += 1
        self.num_waiting += 1
        self.waiting_tokens += stream.prompt_tokens
        self.publish()

    def _leave_waiting(self, stream: TrackedRequest) -> None:
        if stream.phase == WAITING:
            self.num_waiting -= 1
            self.waiting_tokens -= stream.prompt_tokens

    def left(self, stream: TrackedRequest) -> None:
        """``generate`` is done with the stream (finished, cancelled, consumer gone); its
        native call, if any, may still be returning."""
        self.in_flight -= 1
        self._leave_waiting(stream)
        if stream.phase == WAITING:
            stream.phase = DONE
        self.publish()

    def started(self, stream: TrackedRequest) -> None:
        """Its native call began: the request holds a slot."""
        self._leave_waiting(stream)
        stream.phase = RUNNING
        self.running[stream] = None
        self.publish()

    def ended(self, stream: TrackedRequest) -> None:
        """Its native call returned: the slot is free."""
        stream.phase = DONE
        stream.decoding = False
        if stream in self.running:
            del self.running[stream]
            self.publish()

    def first_token(self, stream: TrackedRequest, prompt_n: int, seconds: float) -> None:
        """The request's prompt is computed (``prompt_n`` tokens in ``seconds``)."""
        if stream.phase != RUNNING:
            return
        decodes = self.num_decoding()
        usage = self.kv_usage()
        stream.decoding = True
        if prompt_n > 0 and math.isfinite(seconds) and seconds >= 0:
            # A prompt longer than the budget took several server steps: charge each its
            # share (the per-token work dominates a step on a CPU).
            budget = self.step_budget if self.step_budget > 0 else prompt_n
            left = prompt_n
            while left > 0:
                piece = min(left, budget)
                self._offer(StepSample(piece, decodes, seconds * piece / prompt_n, usage))
                left -= piece
        self.publish()

    def decoded(self, seconds_per_token: float) -> None:
        """A decoding request's recent seconds per token: one decode step's time."""
        if math.isfinite(seconds_per_token) and seconds_per_token >= 0:
            decodes = max(self.num_decoding(), 1)
            self._offer(StepSample(0, decodes, seconds_per_token, self.kv_usage()))

    # ---- the report

    def active_prefill_tokens(self) -> int:
        """Prompt tokens of the requests without a first token (waiting or prefilling)."""
        return self.waiting_tokens + sum(s.prompt_tokens for s in self.running if not s.decoding)

    def num_decoding(self) -> int:
        return sum(1 for s in self.running if s.decoding)

    def kv_usage(self) -> float:
        """Tokens of the running requests over the KV pool (an estimate, see the module)."""
        used = sum(s.prompt_tokens + s.num_tokens for s in self.running)
        return min(used / self.n_ctx, 1.0)

    def _offer(self, sample: StepSample) -> None:
        """Keep a uniform sample (reservoir) of the steps since the last report."""
        self.samples_seen += 1
        if len(self.samples) < STEP_SAMPLES_PER_REPORT:
            self.samples.append(sample)
        else:
            slot = self._rng.randrange(self.samples_seen)
            if slot < STEP_SAMPLES_PER_REPORT:
                self.samples[slot] = sample

    def report(self) -> LoadReport:
        """The current load (without taking the samples)."""
        return LoadReport(
            worker_id=self.worker_id or 0,
            active_prefill_tokens=self.active_prefill_tokens(),
            kv_usage=self.kv_usage(),
            num_waiting=self.num_waiting,
            num_running=len(self.running),
            busy=self.in_flight >= self.bound,
            steps=list(self.samples),
            max_num_batched_tokens=self.step_budget,
        )

    def publish(self, *, force: bool = False) -> None:
        """Publish a report if the load changed since the last one, or if ``force``."""
        sink, worker_id = self.sink, self.worker_id
        if sink is None or worker_id is None or not self.enabled:
            return
        busy = self.in_flight >= self.bound
        key = (self.num_waiting, len(self.running), self.active_prefill_tokens(), busy)
        if not force and key == self._last_key:
            return
        self._last_key = key
        self.next_report = time.monotonic() + self.interval_s
        report = self.report()
        self.samples = []
        self.samples_seen = 0
        try:
            sink.publish_load(report)
        except Exception:  # a sink's failure must not stop the engine
            log.exception("publishing a load report failed (worker %x)", worker_id)

    async def beat(self) -> None:
        """Publish at least every ``interval_s``: routers drop stale reports, and decode
        samples wait for a report to carry them."""
        while True:
            delay = self.next_report - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            self.next_report = time.monotonic() + self.interval_s
            self.publish(force=True)
