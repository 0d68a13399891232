"""What the dashboard shows, as one JSON-ready snapshot of the frontend's view of its fleet.

Read at request time from what the frontend already keeps for routing: the models and their
instances (the model manager, the prefill watch), each card's in-flight counts (its push
routers' load view), and under the KV router the workers' latest load reports, the router's
predicted against realised TTFT and its predicted against reported cache hits per worker,
and its sample of explained decisions; admission from its controller and the rejection
counters; latency from the history sampler. Nothing here runs per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

from turnout import __version__
from turnout.frontend.admission.limiter import AdmissionController
from turnout.frontend.dashboard.history import QUANTILES, LatencyHistory
from turnout.frontend.metrics.frontend import FrontendMetrics
from turnout.frontend.models.factory import PipelineFactory
from turnout.frontend.models.manager import ModelManager
from turnout.router.kv.router import KvRouter
from turnout.router.kv.selector import WorkerKey

#: Decisions shown per model.
DECISIONS_SHOWN = 20


class FleetView:
    """Builds ``snapshot()`` from the frontend's parts (any of the optional ones absent: its
    section is empty)."""

    def __init__(
        self,
        manager: ModelManager,
        metrics: FrontendMetrics,
        history: LatencyHistory,
        *,
        factory: PipelineFactory | None = None,
        admission: AdmissionController | None = None,
        prefill: Callable[[str], Collection[int] | None] | None = None,
        router_mode: str = "",
    ) -> None:
        self.manager = manager
        self.metrics = metrics
        self.history = history
        self.factory = factory
        self.admission = admission
        self.prefill = prefill
        self.router_mode = router_mode

    def snapshot(self) -> dict[str, Any]:
        return {
            "time": time.time(),
            "version": __version__,
            "router_mode": self.router_mode,
            "models": [self._model(name) for name in sorted(self.manager.list_models())],
            "series": self._series(),
            "quantiles": list(QUANTILES),
            "admission": self._admission(),
        }

    # ------------------------------------------------------------------------ models

    def _model(self, name: str) -> dict[str, Any]:
        roles = {card.worker_role.value for card in self.manager.entries_for_model(name)}
        role = "decode" if roles == {"decode"} else "aggregated"
        kv = self.factory.kv_routers.get(name) if self.factory is not None else None
        in_flight = self._in_flight(name)
        instances = [
            self._instance(i, role, in_flight.get(i, 0), kv)
            for i in sorted(self.manager.model_instances(name))
        ]
        prefill = self.prefill(name) if self.prefill is not None else None
        instances += [self._instance(i, "prefill", None, None) for i in sorted(prefill or [])]
        out: dict[str, Any] = {"name": name, "instances": instances, "kv_router": kv is not None}
        if kv is not None:
            hits = kv.hits
            if hits.prompt:
                out["predicted_hit_rate"] = hits.predicted / hits.prompt
                out["reported_hit_rate"] = hits.reported / hits.prompt
                out["hit_rate_gap"] = hits.gap
            out["decisions"] = [_decision(d) for d in kv.decisions.entries()[:DECISIONS_SHOWN]]
        return out

    def _in_flight(self, name: str) -> dict[int, int]:
        """This frontend's streams per instance of ``name`` (its cards' load views)."""
        out: dict[int, int] = {}
        if self.factory is None:
            return out
        for routing in list(self.factory.cards.values()):
            if routing.card.display_name == name and routing.load is not None:
                for instance, count in routing.load.snapshot().items():
                    out[instance] = out.get(instance, 0) + count
        return out

    @staticmethod
    def _instance(
        instance: int, role: str, in_flight: int | None, kv: KvRouter | None
    ) -> dict[str, Any]:
        row: dict[str, Any] = {"id": f"{instance:x}", "role": role, "in_flight": in_flight}
        if kv is None:
            return row
        core = kv.core
        key = WorkerKey(instance, 0)
        report = core.loads.get_report(key)
        if report is not None:
            row.update(
                kv_usage=report.kv_usage,
                waiting=report.num_waiting,
                running=report.num_running,
                busy=report.busy,
            )
        # The KV router books its requests itself (with its replicas' when they share).
        counters = core.active.counters.get(key)
        row["in_flight"] = counters.num_requests if counters is not None else 0
        accuracy = core.ttft_accuracy.get(key)
        if accuracy is not None and accuracy.count:
            row["ttft_predicted_s"] = accuracy.predicted_s / accuracy.count
            row["ttft_realised_s"] = accuracy.realised_s / accuracy.count
        hits = kv.worker_hits.get(instance)
        if hits is not None and hits.prompt:
            row["predicted_hit_rate"] = hits.predicted / hits.prompt
            row["reported_hit_rate"] = hits.reported / hits.prompt
            row["hit_rate_gap"] = hits.gap
        return row

    # ------------------------------------------------------------------------ the rest

    def _series(self) -> list[dict[str, Any]]:
        return [
            {
                "time": p.time,
                "requests_per_s": p.requests_per_s,
                "ttft_s": list(p.ttft),
                "itl_s": list(p.itl),
            }
            for p in list(self.history.points)
        ]

    def _admission(self) -> dict[str, Any]:
        admission = self.admission
        out: dict[str, Any] = {"rejected": self.metrics.rejections_by_reason()}
        if admission is not None:
            limits = admission.limits
            out.update(
                in_flight=admission.inflight,
                queued=admission.queued,
                max_inflight=limits.max_inflight or None,
                queue_size=limits.queue_size,
            )
        return out


def _decision(entry: dict[str, Any]) -> dict[str, Any]:
    """A logged decision for the page: when, prompt, chosen worker and why, and per candidate
    its overlap, load and predicted TTFT."""
    return {
        "time": entry.get("time"),
        "request_id": entry.get("request_id"),
        "prompt_tokens": entry.get("prompt_tokens"),
        "status": entry.get("status"),
        "worker_id": entry.get("worker_id"),
        "overlap_blocks": entry.get("overlap_blocks"),
        "predicted_ttft_s": entry.get("predicted_ttft_s"),
        "candidates": [
            {
                "worker_id": c.get("worker_id"),
                "overlap_blocks": c.get("overlap_blocks"),
                "active_blocks": (c.get("active_prefill_blocks") or 0)
                + (c.get("active_decode_blocks") or 0),
                "cost": c.get("cost"),
                "predicted_ttft_s": c.get("predicted_ttft_s"),
            }
            for c in entry.get("candidates", [])
        ],
        "busy": entry.get("busy", []),
    }
