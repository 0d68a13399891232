"""Workers' load reports folded before the KV router applies them.

A fleet of 1,024 workers reports once a second each, and more often under load (a worker
reports on every change of its queue). Applying each report on arrival costs a least-squares
update per report for its step samples (``StepTimeModels.on_load``: a few numpy calls, ~20 us,
whatever the number of samples), which is most of the cost. So the consumer folds:

* per batch (the reports that arrived since the consumer last ran, ``take_ready``): only the
  latest report of each worker updates the busy view, which is all a report's load fields
  feed (``WorkerLoads.on_load``);
* step samples wait in a ``StepBacklog`` per worker and reach the step-time fit together, in
  the order they were reported: when a worker has ``max_samples`` waiting, and for every
  worker at the first batch ``interval_s`` after the last fit. A fit lags the reports by at
  most ``interval_s`` (the fits forget over hundreds of samples: a second is immaterial) and
  costs one update per worker per interval instead of one per report.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from turnout.protocols.kv import LoadReport, StepSample
from turnout.router.kv.base import WorkerKey

__all__ = ["StepBacklog", "latest_per_worker"]

#: Seconds step samples may wait before they are fitted.
DEFAULT_FIT_INTERVAL_S = 1.0
#: Samples of one worker that are fitted at once, without waiting for the interval.
DEFAULT_MAX_SAMPLES = 64
#: Workers with samples waiting, at most (past it, every backlog is fitted at once).
DEFAULT_MAX_WORKERS = 4096


def latest_per_worker(reports: Iterable[LoadReport]) -> list[LoadReport]:
    """The last report of each worker (and rank) among ``reports``, which are in arrival
    order (one worker's reports arrive in the order it sent them)."""
    latest: dict[tuple[int, int], LoadReport] = {}
    for report in reports:
        latest[(report.worker_id, report.dp_rank)] = report
    return list(latest.values())


class _Pending:
    """One worker's reports since its last fit: the latest, and all their samples."""

    __slots__ = ("latest", "steps")

    def __init__(self, report: LoadReport) -> None:
        self.latest = report
        self.steps: list[StepSample] = list(report.steps)


class StepBacklog:
    """Step samples per worker waiting to be fitted; see the module docstring.

    ``add`` every report as it is consumed, then ``take_due`` once per batch: each report it
    returns is a worker's latest, carrying every sample reported since its previous fit
    (oldest first), for ``StepTimeModels.on_load``. Bounded: at most ``max_workers`` workers
    wait, each with fewer than ``max_samples`` samples between batches plus one report's.
    """

    def __init__(
        self,
        *,
        interval_s: float = DEFAULT_FIT_INTERVAL_S,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        max_workers: int = DEFAULT_MAX_WORKERS,
    ) -> None:
        if not interval_s >= 0 or max_samples < 1 or max_workers < 1:
            raise ValueError(
                f"bad step backlog bounds: interval {interval_s}, samples {max_samples}, "
                f"workers {max_workers}"
            )
        self._interval_s = interval_s
        self._max_samples = max_samples
        self._max_workers = max_workers
        self._pending: dict[WorkerKey, _Pending] = {}
        #: Workers that reached ``max_samples`` since the last ``take_due``.
        self._full: list[WorkerKey] = []
        self._overflow = False
        #: When every backlog is fitted next (the first batch is fitted at once).
        self._next_fit = float("-inf")

    def __len__(self) -> int:
        """Workers with a report waiting."""
        return len(self._pending)

    def add(self, report: LoadReport) -> None:
        key = WorkerKey(report.worker_id, report.dp_rank)
        pending = self._pending.get(key)
        if pending is None:
            if len(self._pending) >= self._max_workers:
                self._overflow = True
            pending = self._pending[key] = _Pending(report)
        else:
            pending.latest = report
            pending.steps.extend(report.steps)
        if len(pending.steps) >= self._max_samples:
            self._full.append(key)

    def take_due(self, now: float) -> list[LoadReport]:
        """The folded reports of the workers due at ``now`` (see the class docstring)."""
        if now >= self._next_fit or self._overflow:
            self._next_fit = now + self._interval_s
            self._overflow = False
            self._full.clear()
            return self._take(list(self._pending))
        if not self._full:
            return []
        keys, self._full = self._full, []
        return self._take(keys)

    def take_all(self) -> list[LoadReport]:
        """Every waiting worker's folded report (at close, or in tests)."""
        self._full.clear()
        self._overflow = False
        return self._take(list(self._pending))

    def _take(self, keys: Iterable[WorkerKey]) -> list[LoadReport]:
        out = []
        pop = self._pending.pop
        for key in keys:
            pending = pop(key, None)
            if pending is None:  # listed twice (full, then due): taken already
                continue
            latest = pending.latest
            if len(pending.steps) != len(latest.steps):
                latest = msgspec.structs.replace(latest, steps=pending.steps)
            out.append(latest)
        return out

    def remove_worker(self, worker_id: int) -> None:
        """Drop what every rank of ``worker_id`` has waiting (it left)."""
        for key in [k for k in self._pending if k.worker_id == worker_id]:
            del self._pending[key]
