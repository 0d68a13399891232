"""Requests in flight per instance, as this router counts them (Dynamo's routing occupancy).

The push router counts a stream to an instance from the moment it is opened until it ends,
for whatever reason (finished, failed, cancelled, re-routed): ``on_stream_started`` returns a
``LoadTicket`` and ``on_stream_ended`` takes it back. The load-based selectors
(``power-of-two``, ``least-loaded``, ``device-aware-weighted``) read ``in_flight``.

It also keeps which instances are *busy*, and the push router leaves busy instances out of
its candidates while any other is free, whatever the mode:

* one that answered a request with ``overloaded`` (its engine's queue is full) is busy for
  ``busy_hold_s`` seconds (``mark_busy``);
* one whose own load reports say ``busy`` (``LoadReport.busy``: it refuses new requests now),
  every data-parallel rank of it, is busy until a report says otherwise or the reports are
  older than ``report_ttl_s`` (``on_load_report``, fed by ``router.load_reports``).

The KV router has its own busy view, from the same reports and its busy thresholds.

Bounded by the live instances: an entry exists only while its instance has a stream in flight
(it is dropped when the count returns to 0), and ``retain`` forgets instances that left
discovery. A ticket holds its entry, not the id: a stream of a forgotten instance that ends
later decrements an orphaned entry and never a newer entry of an instance that came back
under the same id.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence

__all__ = ["DEFAULT_BUSY_HOLD_S", "InstanceLoad", "LoadTicket"]

#: How long an instance that answered ``overloaded`` is left out of the candidates.
DEFAULT_BUSY_HOLD_S = 1.0
#: A load report older than this no longer marks its instance busy (as the KV router's).
DEFAULT_REPORT_TTL_S = 10.0
#: Ranks remembered per instance (reports of more are ignored).
MAX_RANKS = 256


class LoadTicket:
    """One instance's in-flight count. Only ``InstanceLoad`` changes ``count``."""

    __slots__ = ("count", "instance_id")

    def __init__(self, instance_id: int) -> None:
        self.instance_id = instance_id
        self.count = 0


class InstanceLoad:
    """Instance id -> requests in flight, and the busy instances; one per model, shared by
    its pipelines. ``clock``: seconds, monotonic (injected by tests)."""

    __slots__ = ("_busy_until", "_clock", "_entries", "_reported", "busy_hold_s", "report_ttl_s")

    def __init__(
        self,
        *,
        busy_hold_s: float = DEFAULT_BUSY_HOLD_S,
        report_ttl_s: float = DEFAULT_REPORT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not busy_hold_s >= 0:
            raise ValueError(f"busy_hold_s must be >= 0, got {busy_hold_s}")
        if not report_ttl_s > 0:
            raise ValueError(f"report_ttl_s must be > 0, got {report_ttl_s}")
        self.busy_hold_s = busy_hold_s
        self.report_ttl_s = report_ttl_s
        self._clock = clock
        # Only instances with at least one stream in flight (invariant: count > 0).
        self._entries: dict[int, LoadTicket] = {}
        # Instance id -> when it stops being busy (bounded like ``_entries``: marked only for
        # instances a request was routed to, forgotten by ``retain`` and on expiry).
        self._busy_until: dict[int, float] = {}
        # Instance id -> rank -> when a report said the rank is busy (None: free). Only
        # instances with a busy rank have an entry.
        self._reported: dict[int, dict[int, float | None]] = {}

    def in_flight(self, instance_id: int) -> int:
        entry = self._entries.get(instance_id)
        return entry.count if entry is not None else 0

    def total(self, instance_ids: Iterable[int]) -> int:
        """Requests in flight on ``instance_ids`` together."""
        return sum(self.in_flight(i) for i in instance_ids)

    def snapshot(self) -> dict[int, int]:
        """Instance id -> in flight, for the instances with any (a copy)."""
        return {i: e.count for i, e in self._entries.items()}

    def on_stream_started(self, instance_id: int) -> LoadTicket:
        entry = self._entries.get(instance_id)
        if entry is None:
            entry = self._entries[instance_id] = LoadTicket(instance_id)
        entry.count += 1
        return entry

    def on_stream_ended(self, ticket: LoadTicket) -> None:
        """The stream counted by ``ticket`` ended (call once per ``on_stream_started``)."""
        ticket.count -= 1
        if ticket.count <= 0 and self._entries.get(ticket.instance_id) is ticket:
            del self._entries[ticket.instance_id]

    def mark_busy(self, instance_id: int) -> None:
        """``instance_id`` refused a request as ``overloaded``: busy for ``busy_hold_s``."""
        self._busy_until[instance_id] = self._clock() + self.busy_hold_s

    def on_load_report(self, instance_id: int, dp_rank: int, busy: bool) -> None:
        """A load report of one rank of ``instance_id`` (``LoadReport.busy``)."""
        ranks = self._reported.get(instance_id)
        if ranks is None:
            if not busy:
                return  # free is what an instance without an entry is
            ranks = self._reported[instance_id] = {}
        if dp_rank not in ranks and len(ranks) >= MAX_RANKS:
            return
        ranks[dp_rank] = self._clock() if busy else None
        if not busy and all(at is None for at in ranks.values()):
            del self._reported[instance_id]

    def is_busy(self, instance_id: int) -> bool:
        until = self._busy_until.get(instance_id)
        if until is not None:
            if self._clock() < until:
                return True
            del self._busy_until[instance_id]
        ranks = self._reported.get(instance_id)
        if ranks is None:
            return False
        horizon = self._clock() - self.report_ttl_s
        return all(at is not None and at >= horizon for at in ranks.values())

    def not_busy(self, candidates: Sequence[int]) -> Sequence[int]:
        """``candidates`` less the busy ones; all of them when every one is busy (a busy
        instance may have room again: trying one beats refusing the request here)."""
        if not self._busy_until and not self._reported:
            return candidates
        free = [c for c in candidates if not self.is_busy(c)]
        return free if free else candidates

    def retain(self, live_ids: Collection[int]) -> None:
        """Forget every instance not in ``live_ids`` (it left discovery)."""
        for instance_id in [i for i in self._entries if i not in live_ids]:
            del self._entries[instance_id]
        for instance_id in [i for i in self._busy_until if i not in live_ids]:
            del self._busy_until[instance_id]
        for instance_id in [i for i in self._reported if i not in live_ids]:
            del self._reported[instance_id]
