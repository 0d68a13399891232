"""The mocker: a simulated vLLM-style engine for CPU-only testing and benchmarking at scale.

It behaves like vLLM from the outside (step timing, a KV cache with prefix reuse and LRU
eviction, KV events, load reports) without doing the math, so KV-aware routing can be tested
with many workers in one process.

* ``MockerConfig``: every knob; ``validate()`` raises ``ConfigError``.
* ``KvBlockPool``: reference-counted, content-addressed blocks (sync).
* ``Scheduler``: waiting/running queues, chunked prefill, preemption (sync, ``step(now)``).
* ``TimingModel`` / ``PolynomialTimingModel``: how long a step takes.
* ``MockerEngine`` / ``make_mocker_engines``: the async ``Engine`` for the worker; a request
  whose stream holds ``STREAM_HIGH_WATER`` unread outputs is paused until it drains to
  ``STREAM_LOW_WATER``.
"""

from turnout.engines.mocker.config import MockerConfig
from turnout.engines.mocker.engine import MockerEngine, make_mocker_engines
from turnout.engines.mocker.kv_pool import KvBlockPool
from turnout.engines.mocker.rank import (
    STREAM_HIGH_WATER,
    STREAM_LOW_WATER,
    KvEventSink,
    MockerStats,
    NullEventSink,
)
from turnout.engines.mocker.request import MockRequest, RequestState
from turnout.engines.mocker.scheduler import Scheduler, SchedulerLoad, StepResult
from turnout.engines.mocker.timing import PolynomialTimingModel, TimingModel
from turnout.engines.mocker.tokens import HashTokenSampler, TokenSampler

__all__ = [
    "STREAM_HIGH_WATER",
    "STREAM_LOW_WATER",
    "HashTokenSampler",
    "KvBlockPool",
    "KvEventSink",
    "MockRequest",
    "MockerConfig",
    "MockerEngine",
    "MockerStats",
    "NullEventSink",
    "PolynomialTimingModel",
    "RequestState",
    "Scheduler",
    "SchedulerLoad",
    "StepResult",
    "TimingModel",
    "TokenSampler",
    "make_mocker_engines",
]
