"""Workers' load reports for the simple router modes: which instances say they are busy.

Every worker publishes ``LoadReport`` s on its component's ``load`` topic (the KV router reads
them for its own decisions). ``BusyReports`` subscribes to them for one endpoint and feeds
each report's ``busy`` flag (the worker refuses new requests now: its waiting queue is at its
bound) into the push router's ``InstanceLoad``, so that round-robin, random and the load-based
modes skip an instance that says it would refuse, as the KV router does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from turnout.protocols.kv import LOAD_TOPIC, LoadReport
from turnout.protocols.model import EndpointId
from turnout.router.instance_load import InstanceLoad
from turnout.runtime.event_plane import EventPlane, EventSubscription

__all__ = ["BusyReports"]

log = logging.getLogger("turnout.router")


class BusyReports:
    """Feeds ``endpoint``'s load reports into ``load`` from ``start`` until ``close``."""

    def __init__(self, plane: EventPlane[Any, Any], endpoint: EndpointId, load: InstanceLoad):
        self._plane = plane
        self._endpoint = endpoint
        self.load = load
        self._sub: EventSubscription[Any] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        endpoint = self._endpoint
        self._sub = await self._plane.subscribe(endpoint.namespace, endpoint.component, LOAD_TOPIC)
        self._task = asyncio.create_task(
            self._consume(self._sub), name=f"busy-reports-{endpoint.path()}"
        )

    async def _consume(self, sub: EventSubscription[Any]) -> None:
        on_report = self.load.on_load_report
        async for report in sub.messages(LoadReport):
            on_report(report.worker_id, report.dp_rank, report.busy)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sub is not None:
            await self._sub.close()
            self._sub = None
