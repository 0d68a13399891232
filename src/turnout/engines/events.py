"""Engines' KV events and load reports onto the event plane.

Topics (per ``namespace``/``component`` of the worker's endpoint): ``kv_events`` carries
``KvEventBatch`` and ``load`` carries ``LoadReport``, both msgpack. Every message names its
worker, so one publisher serves all the simulated workers of a process.
"""

from __future__ import annotations

import msgspec

from turnout.protocols.kv import KV_EVENTS_TOPIC, LOAD_TOPIC, KvEventBatch, LoadReport
from turnout.runtime.event_plane import EventPublisher

_encode = msgspec.msgpack.Encoder().encode


class EventPlaneSink:
    """A ``KvEventSink`` (see the mocker) that publishes on the event plane, synchronously."""

    def __init__(self, publisher: EventPublisher) -> None:
        self._publish = publisher.publish_nowait

    def publish_kv(self, batch: KvEventBatch) -> None:
        self._publish(KV_EVENTS_TOPIC, _encode(batch))

    def publish_load(self, report: LoadReport) -> None:
        self._publish(LOAD_TOPIC, _encode(report))
