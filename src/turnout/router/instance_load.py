"""Requests in flight per instance, as this router counts them (Dynamo's routing occupancy).

The push router counts a stream to an instance from the moment it is opened until it ends,
for whatever reason (finished, failed, cancelled, re-routed): ``on_stream_started`` returns a
``LoadTicket`` and ``on_stream_ended`` takes it back. The load-based selectors
(``power-of-two``, ``least-loaded``, ``device-aware-weighted``) read ``in_flight``.

Bounded by the live instances: an entry exists only while its instance has a stream in flight
(it is dropped when the count returns to 0), and ``retain`` forgets instances that left
discovery. A ticket holds its entry, not the id: a stream of a forgotten instance that ends
later decrements an orphaned entry and never a newer entry of an instance that came back
under the same id.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

__all__ = ["InstanceLoad", "LoadTicket"]


class LoadTicket:
    """One instance's in-flight count. Only ``InstanceLoad`` changes ``count``."""

    __slots__ = ("count", "instance_id")

    def __init__(self, instance_id: int) -> None:
        self.instance_id = instance_id
        self.count = 0


class InstanceLoad:
    """Instance id -> requests in flight; one per model, shared by its pipelines."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        # Only instances with at least one stream in flight (invariant: count > 0).
        self._entries: dict[int, LoadTicket] = {}

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

    def retain(self, live_ids: Collection[int]) -> None:
        """Forget every instance not in ``live_ids`` (it left discovery)."""
        for instance_id in [i for i in self._entries if i not in live_ids]:
            del self._entries[instance_id]
