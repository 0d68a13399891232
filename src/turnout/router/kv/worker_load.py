"""Workers' own load reports, kept to tell which workers are busy.

The cost function uses the router's *predicted* load (``ActiveSequences``): it is current at
every decision, whereas reports arrive at a steady rate. Reports decide only whether a worker
is a candidate at all: one above a threshold (KV cache nearly full, too many requests
waiting) is left out until a report says otherwise or its report goes stale.
"""

from __future__ import annotations

from turnout.protocols.kv import LoadReport
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.config import KvRouterConfig


class WorkerLoads:
    """Latest ``LoadReport`` per worker and the derived busy set. Synchronous."""

    def __init__(
        self,
        *,
        busy_kv_usage_threshold: float | None = None,
        busy_num_waiting_threshold: int | None = None,
        report_ttl_s: float = 10.0,
    ) -> None:
        self._kv_threshold = busy_kv_usage_threshold
        self._waiting_threshold = busy_num_waiting_threshold
        self._report_ttl_s = report_ttl_s
        self._reports: dict[WorkerKey, tuple[LoadReport, float]] = {}
        #: worker -> time of the report that made it busy; updated on every report.
        self._busy_since: dict[WorkerKey, float] = {}

    @classmethod
    def from_config(cls, config: KvRouterConfig) -> WorkerLoads:
        return cls(
            busy_kv_usage_threshold=config.busy_kv_usage_threshold,
            busy_num_waiting_threshold=config.busy_num_waiting_threshold,
            report_ttl_s=config.load_report_ttl_s,
        )

    def on_load(self, report: LoadReport, now: float) -> bool:
        """Record a report; returns whether it marks the worker busy."""
        key = WorkerKey(report.worker_id, report.dp_rank)
        self._reports[key] = (report, now)
        busy = self._is_over_threshold(report)
        if busy:
            self._busy_since[key] = now
        else:
            self._busy_since.pop(key, None)
        return busy

    @property
    def busy_kv_usage_threshold(self) -> float | None:
        return self._kv_threshold

    @property
    def busy_num_waiting_threshold(self) -> int | None:
        return self._waiting_threshold

    def set_thresholds(
        self, *, kv_usage: float | None = None, num_waiting: int | None = None
    ) -> None:
        """Change the thresholds at run time (``POST /busy_threshold``); None leaves one as
        it is. The latest reports are judged again at once, under their own timestamps, so
        a worker over a lowered threshold is left out from the next decision on."""
        if kv_usage is not None and not (0.0 <= kv_usage <= 1.0):
            raise ValueError(f"kv usage threshold must be in [0, 1], got {kv_usage}")
        if num_waiting is not None and num_waiting < 0:
            raise ValueError(f"waiting threshold must be >= 0, got {num_waiting}")
        if kv_usage is not None:
            self._kv_threshold = kv_usage
        if num_waiting is not None:
            self._waiting_threshold = num_waiting
        over = self._is_over_threshold
        self._busy_since = {key: at for key, (report, at) in self._reports.items() if over(report)}

    def _is_over_threshold(self, report: LoadReport) -> bool:
        if report.busy:  # the worker says so itself (e.g. its waiting queue is full)
            return True
        kv = self._kv_threshold
        waiting = self._waiting_threshold
        return (kv is not None and report.kv_usage > kv) or (
            waiting is not None and report.num_waiting > waiting
        )

    def is_busy(self, worker_key: WorkerKey, now: float) -> bool:
        """Busy per its latest report, unless that report is older than the report TTL."""
        at = self._busy_since.get(worker_key)
        return at is not None and now - at <= self._report_ttl_s

    @property
    def any_busy(self) -> bool:
        """False lets the selector skip busy checks entirely (the common case)."""
        return bool(self._busy_since)

    def get_report(self, worker_key: WorkerKey) -> LoadReport | None:
        entry = self._reports.get(worker_key)
        return None if entry is None else entry[0]

    def remove_worker(self, worker_id: int) -> None:
        for key in [k for k in self._reports if k.worker_id == worker_id]:
            del self._reports[key]
            self._busy_since.pop(key, None)
