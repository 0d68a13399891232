"""``turnout_disagg_*``: what the prefill routers did, per model and stage.

* ``turnout_disagg_requests_total{model,stage}``: requests through each stage: ``prefill``
  and ``decode`` (the two stages of a disaggregated request), ``local`` (an active prefill
  router let the request run whole on its decode worker).
* ``turnout_disagg_local_total{model,reason}``: why (``short_prompt``, ``cached_on_decode``,
  ``max_tokens_1``, ``lora``, ``pinned``, ``card_mismatch``, ``no_prefill_worker`` for a
  decode-role model without prefill workers, ``no_handle``, ``kv_retries_exhausted``).
* ``turnout_disagg_stage_seconds{model,stage}``: ``prefill`` from dispatch to the prefill
  worker's answer; ``decode`` from the decode dispatch to its first output (the KV transfer
  included); ``local`` from dispatch to the first token.
* ``turnout_disagg_transfer_bytes_total{model}``: KV bytes decode workers took over.
* ``turnout_disagg_retries_total{model,reason}``: prefills re-run (``prefill_worker_failed``,
  ``kv_transfer``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter

from turnout.frontend.metrics.frontend import LATENCY_BUCKETS, LoopHistogram
from turnout.router.prefill_policy import LocalReason
from turnout.router.prefill_router import Stage


class DisaggMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "turnout_disagg_requests", "Requests through each stage of disaggregated serving",
            ["model", "stage"], registry=r,
        )  # fmt: skip
        self.local = Counter(
            "turnout_disagg_local",
            "Requests an active prefill router ran whole on a decode worker, by reason",
            ["model", "reason"], registry=r,
        )  # fmt: skip
        self.seconds = LoopHistogram(
            "turnout_disagg_stage_seconds",
            "Time per stage of disaggregated serving (decode: to its first output)",
            ["model", "stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "turnout_disagg_transfer_bytes", "KV bytes moved from prefill to decode workers",
            ["model"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "turnout_disagg_retries", "Prefills re-run, by reason", ["model", "reason"],
            registry=r,
        )  # fmt: skip

    def observer(self, model: str) -> ModelDisaggMetrics:
        return ModelDisaggMetrics(self, model)


class ModelDisaggMetrics:
    """One model's children (a ``router.prefill_router.DisaggObserver``)."""

    __slots__ = ("_bytes", "_local", "_metrics", "_model", "_requests", "_retries", "_seconds")

    def __init__(self, metrics: DisaggMetrics, model: str) -> None:
        self._metrics = metrics
        self._model = model
        self._requests = {s: metrics.requests.labels(model, s.value) for s in Stage}
        self._seconds = {s: metrics.seconds.labels(model, s.value) for s in Stage}
        self._local = {r: metrics.local.labels(model, r.value) for r in LocalReason}
        self._bytes = metrics.transfer_bytes.labels(model)
        self._retries: dict[str, Any] = {}

    def stage(self, stage: Stage, seconds: float) -> None:
        self._requests[stage].inc()
        self._seconds[stage].observe(seconds)

    def local(self, reason: LocalReason) -> None:
        self._local[reason].inc()

    def transferred(self, num_bytes: int) -> None:
        self._bytes.inc(num_bytes)

    def retry(self, reason: str) -> None:
        child = self._retries.get(reason)
        if child is None:
            child = self._retries[reason] = self._metrics.retries.labels(self._model, reason)
        child.inc()
