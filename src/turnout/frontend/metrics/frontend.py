"""Prometheus metrics of the frontend, under the prefix ``turnout_``, with the process's own
(``process_*``) and the build line (``turnout_build_info``, see ``runtime.process_metrics``).

One ``FrontendMetrics`` per frontend, with its own registry (several frontends can live in
one test process). Per-token work is one histogram observation for inter-token latency.

Hot-path costs: ``prometheus_client``'s ``labels()`` takes a lock and builds a key on every
call, and its ``Histogram.observe`` takes a lock per bucket and sum. The frontend observes
from one thread (the event loop, which also renders ``/metrics``), so the histograms here are
``LoopHistogram`` (plain integer increments, no lock) and the per-model children are looked up
once and cached in a ``ModelMetrics`` record (``FrontendMetrics.model``).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from turnout.runtime.http import HttpServer
from turnout.runtime.process_metrics import register_process_metrics

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)

CONTENT_TYPE = CONTENT_TYPE_LATEST

#: The ``model`` label of requests whose model the frontend does not serve (or that failed
#: before naming one): clients choose model strings, and one series per string would let
#: them grow the metrics without bound.
UNKNOWN_MODEL = "__unknown__"


class _HistogramChild:
    """One label set of a ``LoopHistogram``: ``counts[i]`` observations fell in bucket ``i``
    (not cumulative; the last bucket is +Inf). Written only by ``observe``."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, i.e. Prometheus' "le" bucket.
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


class LoopHistogram(Collector):
    """A Prometheus histogram for one thread: the same exposition as ``prometheus_client``'s
    ``Histogram`` (``_bucket``/``_count``/``_sum``; no ``_created``), without its locks.

    Not thread-safe by design: observe and collect from the event loop thread only.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._doc = documentation
        self._labelnames = list(labelnames)
        self._bounds = tuple(float(b) for b in buckets)
        self._les = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        self._children: dict[tuple[str, ...], _HistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> _HistogramChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name}: expected labels {self._labelnames}")
            child = self._children[values] = _HistogramChild(self._bounds)
        return child

    def describe(self) -> Iterator[Any]:
        yield HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)

    @property
    def bounds(self) -> tuple[float, ...]:
        return self._bounds

    def total_counts(self) -> list[int]:
        """Observations per bucket (not cumulative; the last is +Inf), over all label sets."""
        total = [0] * (len(self._bounds) + 1)
        for child in list(self._children.values()):
            for i, n in enumerate(child.counts):
                total[i] += n
        return total

    def collect(self) -> Iterator[Any]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        for values, child in list(self._children.items()):
            cumulative = 0
            buckets = []
            for le, n in zip(self._les, child.counts, strict=True):
                cumulative += n
                buckets.append((le, cumulative))
            family.add_metric(list(values), buckets, child.sum)
        yield family


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        register_process_metrics(r, "frontend")
        self.requests = Counter(
            "turnout_requests",
            "HTTP requests completed, by model, endpoint, streaming and status",
            ["model", "endpoint", "stream", "status"],
            registry=r,
        )
        self.inflight = Gauge(
            "turnout_inflight_requests", "Requests in flight", ["model"], registry=r
        )
        self.ttft = LoopHistogram(
            "turnout_time_to_first_token_seconds",
            "Time from request arrival to the first generated token",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = LoopHistogram(
            "turnout_inter_token_latency_seconds",
            "Time between consecutive token deliveries of one stream",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = LoopHistogram(
            "turnout_request_duration_seconds",
            "Time from request arrival to its last byte",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.input_tokens = LoopHistogram(
            "turnout_input_sequence_tokens",
            "Prompt tokens per request",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = LoopHistogram(
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
            "turnout_rejections",
            "Requests refused before generation, by reason: queue_full, queue_timeout, "
            "model_limit (admission), unavailable (no instance could take it)",
            ["model", "reason"], registry=r,
        )  # fmt: skip
        self.queued = Gauge(
            "turnout_queued_requests", "Requests waiting for an admission slot", registry=r
        )
        self.queue_wait = LoopHistogram(
            "turnout_queue_wait_seconds",
            "Time requests waited for an admission slot (0 when admitted at once; rejected "
            "waiters included)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.card_switches = Counter(
            "turnout_model_card_switches",
            "Times a model moved to another card (a rolling upgrade: the served card's "
            "instances gone while another card's remained; or back to the previous card "
            "within its grace period)",
            ["model"], registry=r,
        )  # fmt: skip

        self._models: dict[str, ModelMetrics] = {}
        self._requests: dict[tuple[str, str, str, str], Any] = {}

    def model(self, model: str) -> ModelMetrics:
        """The per-model children, looked up once per model (``labels()`` costs a lock)."""
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = ModelMetrics(self, model)
        return m

    def count_request(self, model: str, endpoint: str, stream: bool, status: int) -> None:
        key = (model, endpoint, "true" if stream else "false", str(status))
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.requests.labels(*key)
        child.inc()

    def requests_completed(self) -> float:
        """Requests answered since start, every model, endpoint and status."""
        return sum(child._value.get() for child in list(self._requests.values()))

    def rejections_by_reason(self) -> dict[str, float]:
        """Requests refused before generation since start, by reason (every model)."""
        out: dict[str, float] = {}
        for family in self.rejections.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    reason = sample.labels["reason"]
                    out[reason] = out.get(reason, 0.0) + sample.value
        return out

    def watch_admission(self, queued: Callable[[], float]) -> None:
        """Read ``turnout_queued_requests`` from the admission controller at scrape time."""
        self.queued.set_function(queued)

    def watch_http(self, server: HttpServer) -> None:
        """Expose the HTTP server's connections: open, and closed by the server by reason
        (deadlines, eviction, stalled readers, malformed requests)."""
        self.registry.register(_HttpCollector(server))

    def watch_models(self, instances: Callable[[], Mapping[str, int]]) -> None:
        """Expose ``turnout_model_instances``: each served model's live instances, read at
        scrape time (``instances()``: model name to count)."""
        self.registry.register(_ModelInstancesCollector(instances))

    def watch_kv_routers(self, routers: Mapping[str, Any]) -> None:
        """Expose the KV routers' own counters (read at scrape time: no hot-path cost)."""
        self.registry.register(_KvRouterCollector(routers))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """The label children of one model (read-only after construction)."""

    __slots__ = (
        "cached_tokens", "duration", "inflight", "input_tokens", "itl", "output_tokens",
        "queue_wait", "ttft",
    )  # fmt: skip

    def __init__(self, metrics: FrontendMetrics, model: str) -> None:
        self.inflight = metrics.inflight.labels(model)
        self.ttft = metrics.ttft.labels(model)
        self.itl = metrics.itl.labels(model)
        self.duration = metrics.duration.labels(model)
        self.input_tokens = metrics.input_tokens.labels(model)
        self.output_tokens = metrics.output_tokens.labels(model)
        self.cached_tokens = metrics.cached_tokens.labels(model)
        self.queue_wait = metrics.queue_wait.labels(model)


class StreamTimer:
    """Per-request latency bookkeeping: TTFT at the request's first token, ITL between the
    later tokens of one choice (``n`` > 1: each choice's gaps are its own, not the interleaving
    of several choices' tokens)."""

    __slots__ = ("_itl", "_last", "_lasts", "_ttft", "start", "ttft_s")

    def __init__(self, metrics: ModelMetrics) -> None:
        self.start = time.perf_counter()
        self._ttft = metrics.ttft
        self._itl = metrics.itl
        self._last = 0.0
        #: ``n`` > 1: each choice's last token time (0.0: none yet).
        self._lasts: list[float] = []
        self.ttft_s: float | None = None

    def per_choice(self, n: int) -> None:
        """Time ``n`` choices, each through ``on_choice_tokens``."""
        self._lasts = [0.0] * n

    def on_tokens(self) -> None:
        """One choice's tokens arrived (the request has one choice)."""
        now = time.perf_counter()
        if self.ttft_s is None:
            self.ttft_s = now - self.start
            self._ttft.observe(self.ttft_s)
        else:
            self._itl.observe(now - self._last)
        self._last = now

    def on_choice_tokens(self, index: int) -> None:
        """Tokens of choice ``index`` arrived (after ``per_choice``)."""
        now = time.perf_counter()
        lasts = self._lasts
        if self.ttft_s is None:
            self.ttft_s = now - self.start
            self._ttft.observe(self.ttft_s)
        elif lasts[index]:
            self._itl.observe(now - lasts[index])
        lasts[index] = now


class _HttpCollector(Collector):
    """``turnout_http_connections`` and ``turnout_http_connections_closed_total``."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Any]:
        server = self._server
        yield GaugeMetricFamily(
            "turnout_http_connections", "Open client connections", value=server.num_connections
        )
        closed = CounterMetricFamily(
            "turnout_http_connections_closed",
            "Client connections the server closed, by reason",
            labels=["reason"],
        )
        for reason, count in server.closed.items():
            closed.add_metric([reason], count)
        yield closed


class _ModelInstancesCollector(Collector):
    """``turnout_model_instances{model}``: workers leaving show as a drop here."""

    def __init__(self, instances: Callable[[], Mapping[str, int]]) -> None:
        self._instances = instances

    def collect(self) -> Iterator[Any]:
        family = GaugeMetricFamily(
            "turnout_model_instances", "Live instances of each served model", labels=["model"]
        )
        for model, count in sorted(self._instances().items()):
            family.add_metric([model], count)
        yield family


class _KvRouterCollector(Collector):
    """``turnout_kv_*``: what each model's KV router predicted, and what workers reported.

    ``turnout_kv_hit_rate_gap`` is predicted minus reported hit rate, both as shares of prompt
    tokens over the requests whose worker reported its cached tokens (the block-based
    ``turnout_kv_predicted_hit_rate`` counts whole blocks only, and would show a gap of a
    partial last block on every short prompt): a router whose index drifts from the workers'
    real caches shows it here. Likewise, per worker,
    ``turnout_kv_ttft_gap_seconds`` is the mean realised minus predicted time to first token
    (TTFT cost): a step-time model that drifts from the hardware shows there, and
    ``turnout_kv_worker_step_model`` shows the fitted coefficients themselves.
    """

    def __init__(self, routers: Mapping[str, Any]) -> None:
        self._routers = routers

    def collect(self) -> Iterator[Any]:
        predicted = GaugeMetricFamily(
            "turnout_kv_predicted_hit_rate",
            "Share of routed prompt blocks the KV router expected cached", labels=["model"],
        )  # fmt: skip
        reported = GaugeMetricFamily(
            "turnout_kv_reported_hit_rate",
            "Share of prompt tokens workers reported served from cache (KV-routed requests)",
            labels=["model"],
        )
        gap = GaugeMetricFamily(
            "turnout_kv_hit_rate_gap",
            "Predicted minus reported share of prompt tokens served from cache, over the "
            "requests whose worker reported it",
            labels=["model"],
        )
        predicted_tokens = CounterMetricFamily(
            "turnout_kv_predicted_cached_tokens", "Prompt tokens predicted cached",
            labels=["model"],
        )  # fmt: skip
        reported_tokens = CounterMetricFamily(
            "turnout_kv_reported_cached_tokens", "Prompt tokens reported cached by workers",
            labels=["model"],
        )  # fmt: skip
        silent = CounterMetricFamily(
            "turnout_kv_silent_workers",
            "Times a worker served KV-routed requests but sent no KV events for too long",
            labels=["model"],
        )
        resyncs = CounterMetricFamily(
            "turnout_kv_resyncs", "Worker caches re-read after a gap in KV event ids",
            labels=["model", "result"],
        )  # fmt: skip
        events = CounterMetricFamily(
            "turnout_kv_events_applied", "KV events applied to the index", labels=["model"]
        )
        gaps = CounterMetricFamily(
            "turnout_kv_event_gaps", "Gaps found in workers' KV event ids", labels=["model"]
        )
        ttft_count = CounterMetricFamily(
            "turnout_kv_ttft_predictions", "Requests whose TTFT was predicted, then realised",
            labels=["model", "worker"],
        )  # fmt: skip
        ttft_predicted = CounterMetricFamily(
            "turnout_kv_ttft_predicted_seconds", "Sum of predicted times to first token",
            labels=["model", "worker"],
        )  # fmt: skip
        ttft_realised = CounterMetricFamily(
            "turnout_kv_ttft_realised_seconds",
            "Sum of realised times to first token (routing to first token, at the router)",
            labels=["model", "worker"],
        )
        ttft_gap = GaugeMetricFamily(
            "turnout_kv_ttft_gap_seconds", "Mean realised minus predicted time to first token",
            labels=["model", "worker"],
        )  # fmt: skip
        ttft_error = GaugeMetricFamily(
            "turnout_kv_ttft_abs_error_seconds",
            "Mean absolute error of the predicted time to first token",
            labels=["model", "worker"],
        )
        step_model = GaugeMetricFamily(
            "turnout_kv_worker_step_model",
            "Fitted step time terms: prefill a + b·P + c·P² + e·B + [B>0](f0 + f1·u + f2·u²), "
            "decode d0 + d1·B + d2·u + d3·u² "
            "(seconds, per token, per token², per decode)",
            labels=["model", "worker", "term"],
        )
        step_samples = CounterMetricFamily(
            "turnout_kv_worker_step_samples", "Step timings received from the worker",
            labels=["model", "worker", "kind"],
        )  # fmt: skip
        decisions = HistogramMetricFamily(
            "turnout_kv_router_decision_seconds",
            "Time of the KV router's routing decisions (candidates, prefix match, cost)",
            labels=["model"],
        )
        for model, router in list(self._routers.items()):
            core = router.core
            for key, acc in list(core.ttft_accuracy.items()):
                worker = _worker_label(key)
                ttft_count.add_metric([model, worker], acc.count)
                ttft_predicted.add_metric([model, worker], acc.predicted_s)
                ttft_realised.add_metric([model, worker], acc.realised_s)
                if acc.count:
                    ttft_gap.add_metric(
                        [model, worker], (acc.realised_s - acc.predicted_s) / acc.count
                    )
                    ttft_error.add_metric([model, worker], acc.abs_error_s / acc.count)
            for key, fit in list(core.step_models.items()):
                worker = _worker_label(key)
                for term, value in fit.terms().items():
                    step_model.add_metric([model, worker, term], value)
                step_samples.add_metric([model, worker, "prefill"], fit.prefill.num_samples)
                step_samples.add_metric([model, worker, "decode"], fit.decode.num_samples)
            timing = router.decision_seconds
            decisions.add_metric([model], _buckets(timing.bounds, timing.counts), timing.sum)
            stats = router.core.get_stats()
            p = stats.predicted_hit_rate
            r = (
                router.reported_cached_tokens / router.reported_prompt_tokens
                if router.reported_prompt_tokens
                else 0.0
            )
            predicted.add_metric([model], p)
            reported.add_metric([model], r)
            gap.add_metric([model], router.hits.gap)
            predicted_tokens.add_metric([model], router.predicted_cached_tokens)
            reported_tokens.add_metric([model], router.reported_cached_tokens)
            silent.add_metric([model], router.num_silent_warnings)
            resyncs.add_metric([model, "ok"], router.num_resyncs)
            resyncs.add_metric([model, "failed"], router.num_resync_failures)
            if stats.indexer is not None:
                events.add_metric([model], stats.indexer.events_applied)
                gaps.add_metric([model], stats.indexer.gaps)
        yield from (
            predicted, reported, gap, predicted_tokens, reported_tokens, silent, resyncs,
            events, gaps, ttft_count, ttft_predicted, ttft_realised, ttft_gap, ttft_error,
            step_model, step_samples, decisions,
        )  # fmt: skip


def _buckets(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, float]]:
    """Per-bucket counts (the last past every bound) as Prometheus' cumulative ``le``
    buckets."""
    out = []
    cumulative = 0
    for le, n in zip([*map(floatToGoString, bounds), "+Inf"], counts, strict=True):
        cumulative += n
        out.append((le, float(cumulative)))
    return out


def _worker_label(key: Any) -> str:
    """A worker as metrics name it: hex instance id, and ``/rank`` past rank 0."""
    worker_id, dp_rank = key
    return f"{worker_id:x}" if not dp_rank else f"{worker_id:x}/{dp_rank}"
