"""``GET /metrics`` under the engine's own names, so a router that scrapes vLLM or SGLang for
load reads the simulated fleet unchanged.

Two kinds of series:

* **Engine state**, read from the mocker's schedulers at scrape time (no cost per step):
  running and waiting requests, KV usage, preemptions. One series per data-parallel rank
  (vLLM's ``engine`` label; SGLang's ``dp_rank`` when there is more than one).
* **Request counters and histograms**, moved by ``backend.Generation`` as tokens flow: tokens
  in and out, time to first token, inter-token latency, end-to-end latency, how requests
  ended, prefix-cache queries and hits (counted when a request finishes, when its cached
  tokens are known; vLLM counts them when it schedules the prompt).

vLLM (``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``; labels ``model_name``,
``engine``): ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (the name since 0.9; ``vllm:gpu_cache_usage_perc`` before),
``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``,
``vllm:num_preemptions_total``, ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:request_success_total{finished_reason}``,
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:request_prompt_tokens``,
``vllm:request_generation_tokens``, ``vllm:cache_config_info``.

SGLang (``python/sglang/srt/metrics/collector.py``: ``SchedulerMetricsCollector`` with labels
``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``; ``TokenizerMetricsCollector`` with
``model_name``): ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
``sglang:num_used_tokens``, ``sglang:token_usage``, ``sglang:max_total_num_tokens``,
``sglang:cache_hit_rate``, ``sglang:gen_throughput``, ``sglang:num_retracted_reqs``,
``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total``,
``sglang:cached_tokens_total``, ``sglang:num_requests_total``,
``sglang:num_aborted_requests_total``, ``sglang:time_to_first_token_seconds``,
``sglang:inter_token_latency_seconds``, ``sglang:e2e_request_latency_seconds``.
``cache_hit_rate`` is hits over queried prompt tokens since start (SGLang reports the last
logged prefill batch's); ``gen_throughput`` is generated tokens per second since the previous
scrape.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from turnout.engines.mocker import MockerEngine

if TYPE_CHECKING:
    from turnout.engines.mocker_server.backend import Generation


class Api(enum.StrEnum):
    """Which engine the server pretends to be."""

    VLLM = "vllm"
    SGLANG = "sglang"


#: vLLM's buckets (``PrometheusStatLogger``).
_VLLM_TTFT = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_VLLM_ITL = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_VLLM_E2E = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
#: SGLang's default buckets (``TokenizerMetricsCollector``).
_SGLANG_TTFT = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_SGLANG_ITL = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.010,
    0.015,
    0.020,
    0.025,
    0.030,
    0.035,
    0.040,
    0.060,
    0.080,
    0.100,
    0.200,
    0.400,
    0.600,
    0.800,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
)
_SGLANG_E2E = (
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1,
    2,
    4,
    6,
    8,
    10,
    20,
    40,
    60,
    80,
    100,
    200,
    400,
    600,
    1200,
    1800,
    2400,
)


def _one_two_five(limit: int) -> list[float]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``limit``."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return out
            out.append(float(value))
        exponent += 1


class ServerMetrics:
    """The counters both faces keep, and the hooks ``backend.Generation`` calls; a face's
    subclass names the series. Single-threaded (the event loop)."""

    def __init__(self, model_name: str, engine: MockerEngine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.engine = engine
        #: Prompt tokens of finished requests, and those of them served from the cache.
        self.prefix_queries = 0
        self.prefix_hits = 0
        #: Generated tokens since start (throughput).
        self.generated = 0

    def on_first_token(self, ttft: float, prompt_tokens: int) -> None:
        """A generation produced its first token, ``ttft`` seconds after it started."""

    def on_tokens(self, n: int, gap: float) -> None:
        """``n`` more tokens, ``gap`` seconds after the previous ones."""

    def on_generated(self, n: int) -> None:
        self.generated += n

    def on_finished(self, reason: str, generation: Generation, e2e: float) -> None:
        """A generation ended: ``stop``, ``length``, ``abort`` (its client left, or the
        face cut it) or ``error``."""
        if reason in ("stop", "length"):
            self.prefix_queries += generation.num_prompt_tokens
            self.prefix_hits += generation.cached_tokens

    def on_refused(self) -> None:
        """The engine refused a request before running it (queue full, prompt too long)."""

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


class VllmMetrics(ServerMetrics):
    """vLLM's series (see the module docstring)."""

    def __init__(self, model_name: str, engine: MockerEngine, *, max_model_len: int) -> None:
        super().__init__(model_name, engine)
        reg = self.registry
        labels = ["model_name", "engine"]
        values = (model_name, "0")

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=reg).labels(*values)

        def histogram(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(*values)

        self._prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self._hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self._success = {r: success.labels(*values, r) for r in ("stop", "length", "abort")}
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _VLLM_TTFT,
        )
        self._itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _VLLM_ITL,
        )
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _VLLM_E2E,
        )
        length_buckets = _one_two_five(max_model_len)
        self._request_prompt = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", length_buckets
        )
        self._request_generation = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            length_buckets,
        )
        reg.register(_VllmEngineCollector(self))

    def on_first_token(self, ttft: float, prompt_tokens: int) -> None:
        self._ttft.observe(ttft)
        self._prompt_tokens.inc(prompt_tokens)

    def on_tokens(self, n: int, gap: float) -> None:
        self._itl.observe(gap)

    def on_generated(self, n: int) -> None:
        super().on_generated(n)
        self._generation_tokens.inc(n)

    def on_finished(self, reason: str, generation: Generation, e2e: float) -> None:
        super().on_finished(reason, generation, e2e)
        if reason in ("stop", "length"):
            self._queries.inc(generation.num_prompt_tokens)
            self._hits.inc(generation.cached_tokens)
        counter = self._success.get(reason)
        if counter is not None:
            counter.inc()
        self._e2e.observe(e2e)
        self._request_prompt.observe(generation.num_prompt_tokens)
        self._request_generation.observe(generation.num_output_tokens)


class _VllmEngineCollector(Collector):
    """vLLM's scheduler gauges, per rank, read at scrape time."""

    def __init__(self, metrics: VllmMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        m = self._metrics
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels=labels,
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            labels=labels,
        )
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            labels=labels,
        )
        for rank, scheduler in enumerate(m.engine.get_schedulers()):
            values = [m.model_name, str(rank)]
            running.add_metric(values, scheduler.num_running)
            waiting.add_metric(values, scheduler.num_waiting)
            usage.add_metric(values, scheduler.pool.usage)
            preemptions.add_metric(values, scheduler.num_preemptions)
        cfg = m.engine.config
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "num_gpu_blocks", "engine"],
        )
        for rank in range(cfg.dp_size):
            info.add_metric(
                [
                    str(cfg.block_size),
                    str(cfg.enable_prefix_caching),
                    str(cfg.num_gpu_blocks),
                    str(rank),
                ],
                1.0,
            )
        yield from (running, waiting, usage, preemptions, info)


class SglangMetrics(ServerMetrics):
    """SGLang's series (see the module docstring)."""

    def __init__(self, model_name: str, engine: MockerEngine) -> None:
        super().__init__(model_name, engine)
        reg = self.registry
        labels = ["model_name"]

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self._prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = counter(
            "sglang:generation_tokens", "Number of generation tokens processed."
        )
        self._cached_tokens = counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        self._requests = counter("sglang:num_requests", "Number of requests processed.")
        self._aborted = counter("sglang:num_aborted_requests", "Number of requests aborted.")
        self._ttft = histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _SGLANG_TTFT,
        )
        self._itl = histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _SGLANG_ITL,
        )
        self._e2e = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            _SGLANG_E2E,
        )
        #: (time, generated) at the previous scrape, for ``gen_throughput``.
        self.last_scrape = (time.monotonic(), 0)
        reg.register(_SglangEngineCollector(self))

    def on_first_token(self, ttft: float, prompt_tokens: int) -> None:
        self._ttft.observe(ttft)

    def on_tokens(self, n: int, gap: float) -> None:
        self._itl.observe(gap)

    def on_generated(self, n: int) -> None:
        super().on_generated(n)
        self._generation_tokens.inc(n)

    def on_finished(self, reason: str, generation: Generation, e2e: float) -> None:
        super().on_finished(reason, generation, e2e)
        if reason == "abort":
            self._aborted.inc()
            return
        self._requests.inc()
        self._prompt_tokens.inc(generation.num_prompt_tokens)
        if generation.cached_tokens:
            self._cached_tokens.inc(generation.cached_tokens)
        self._e2e.observe(e2e)


class _SglangEngineCollector(Collector):
    """SGLang's scheduler gauges, per rank, read at scrape time."""

    def __init__(self, metrics: SglangMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        m = self._metrics
        schedulers = m.engine.get_schedulers()
        labels = ["model_name", "engine_type", "tp_rank", "pp_rank"]
        if len(schedulers) > 1:
            labels.append("dp_rank")

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        running = gauge("sglang:num_running_reqs", "The number of running requests.")
        queued = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        used = gauge("sglang:num_used_tokens", "The number of used tokens.")
        usage = gauge("sglang:token_usage", "The token usage.")
        total = gauge(
            "sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."
        )
        hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        retracted = gauge("sglang:num_retracted_reqs", "The number of retracted requests.")
        now = time.monotonic()
        then, generated = m.last_scrape
        m.last_scrape = (now, m.generated)
        rate = (m.generated - generated) / (now - then) if now > then else 0.0
        ratio = m.prefix_hits / m.prefix_queries if m.prefix_queries else 0.0
        block_size = m.engine.config.block_size
        for rank, scheduler in enumerate(schedulers):
            values = [m.model_name, "unified", "0", "0"]
            if len(schedulers) > 1:
                values.append(str(rank))
            pool = scheduler.pool
            running.add_metric(values, scheduler.num_running)
            queued.add_metric(values, scheduler.num_waiting)
            used.add_metric(values, pool.num_used * block_size)
            usage.add_metric(values, pool.usage)
            total.add_metric(values, pool.capacity * block_size)
            hit_rate.add_metric(values, ratio)
            throughput.add_metric(values, rate / len(schedulers))
            retracted.add_metric(values, scheduler.num_preemptions)
        yield from (running, queued, used, usage, total, hit_rate, throughput, retracted)


def make_metrics(
    api: Api, model_name: str, engine: MockerEngine, *, max_model_len: int
) -> ServerMetrics:
    """The metrics of the ``api`` face."""
    if api is Api.VLLM:
        return VllmMetrics(model_name, engine, max_model_len=max_model_len)
    return SglangMetrics(model_name, engine)
