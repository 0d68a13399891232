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
from typing import Any

from turnout.protocols.kv import LOAD_TOPIC, LoadReport
from turnout.protocols.model import EndpointId
from turnout.router.instance_load import InstanceLoad
from turnout.runtime.event_plane import EventPlane

__all__ = ["BusyReports"]


class BusyReports:
    """Feeds ``endpoint``'s load reports into ``load`` from ``start`` until ``close`` (both
    synchronous: the subscription lives in the feed's own task, which closes it)."""

    def __init__(self, plane: EventPlane[Any, Any], endpoint: EndpointId, load: InstanceLoad):
        self._plane = plane
        self._endpoint = endpoint
        self.load = load
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Subscribe and feed, in a task of the running loop."""
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"busy-reports-{self._endpoint.path()}"
        )

    async def _run(self) -> None:
        endpoint = self._endpoint
        sub = await self._plane.subscribe(endpoint.namespace, endpoint.component, LOAD_TOPIC)
        try:
            on_report = self.load.on_load_report
            async for report in sub.messages(LoadReport):
                on_report(report.worker_id, report.dp_rank, report.busy)
        finally:
            await sub.close()

    def close(self) -> None:
        """Stop feeding (the task ends, closing its subscription)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def aclose(self) -> None:
        """``close``, and wait until the subscription is closed."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
