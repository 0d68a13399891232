"""Prometheus metrics of the frontend, under the prefix ``turnout_``.

One ``FrontendMetrics`` per frontend, with its own registry (several frontends can live in
one test process). Per-token work is one histogram observation for inter-token latency.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "turnout_requests",
            "HTTP requests completed, by model, endpoint, streaming and status",
            ["model", "endpoint", "stream", "status"],
            registry=r,
        )
        self.inflight = Gauge(
            "turnout_inflight_requests", "Requests in flight", ["model"], registry=r
        )
        self.ttft = Histogram(
            "turnout_time_to_first_token_seconds",
            "Time from request arrival to the first generated token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "turnout_inter_token_latency_seconds",
            "Time between consecutive token deliveries of one stream",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "turnout_request_duration_seconds",
            "Time from request arrival to its last byte",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.input_tokens = Histogram(
            "turnout_input_sequence_tokens",
            "Prompt tokens per request",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = Histogram(
            "turnout_output_sequence_tokens",
            "Generated tokens per request",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.cached_tokens = Counter(
            "turnout_cached_tokens", "Prompt tokens served from a worker's KV cache",
            ["model"], registry=r,
        )  # fmt: skip
        self.migrations = Counter(
            "turnout_migrations", "Requests moved to another worker mid-stream",
            ["model"], registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "turnout_rejections", "Requests refused before generation, by reason",
            ["model", "reason"], registry=r,
        )  # fmt: skip

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StreamTimer:
    """Per-request latency bookkeeping: TTFT at the first token, ITL between later ones."""

    __slots__ = ("_itl", "_last", "_model", "_ttft", "start", "ttft_s")

    def __init__(self, metrics: FrontendMetrics, model: str) -> None:
        self.start = time.perf_counter()
        self._ttft = metrics.ttft.labels(model)
        self._itl = metrics.itl.labels(model)
        self._last = 0.0
        self.ttft_s: float | None = None

    def on_tokens(self) -> None:
        now = time.perf_counter()
        if self.ttft_s is None:
            self.ttft_s = now - self.start
            self._ttft.observe(self.ttft_s)
        else:
            self._itl.observe(now - self._last)
        self._last = now
