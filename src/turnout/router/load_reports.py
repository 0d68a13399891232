"""Workers' load reports for the simple router modes: which instances say they are busy.

Every worker publishes ``LoadReport`` s on its component's ``load`` topic (the KV router reads
them for its own decisions). ``BusyReports`` subscribes to them for one endpoint and feeds
each report's ``busy`` flag (the worker refuses new requests now: its waiting queue is at its
bound) into the push router's ``InstanceLoad``, so that round-robin, random and the
load-based modes skip an instance that says it would refuse, as the KV router does. Reports
are taken a batch at a time (those that arrived since the feed last ran, ``take_ready``),
and only each worker's latest of a batch is fed.

The topic is the component's, shared by its other endpoints (and other cards' instances):
only reports of instances ``announced`` for this endpoint are fed, so the load view holds
state for this endpoint's instances alone.

A subscription that fails (the event plane is unreachable, its transport raised) is logged
and made again after a backoff that doubles up to ``retry_max_s``: the busy view must not
stop for good on one failure. The feed ends when its subscription ends (its plane closed it)
or on ``aclose``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from turnout.protocols.kv import LOAD_TOPIC
from turnout.protocols.model import EndpointId
from turnout.router.event_batches import BatchDecoder, take_ready
from turnout.router.instance_load import InstanceLoad
from turnout.runtime.event_plane import EventPlane

__all__ = ["BusyReports"]

log = logging.getLogger("turnout.router")

#: First wait before subscribing again after a failure, and the most it grows to.
RETRY_MIN_S = 0.1
RETRY_MAX_S = 5.0


class BusyFlag(msgspec.Struct, frozen=True):
    """The fields of a ``LoadReport`` the busy view reads: decoding skips the rest (the step
    samples are most of a report)."""

    worker_id: int
    dp_rank: int = 0
    busy: bool = False


class BusyReports:
    """Feeds ``endpoint``'s load reports into ``load`` from ``start`` until ``aclose``
    (the subscription lives in the feed's own task, which closes it). ``announced(id)``:
    whether the instance belongs to the endpoint (reports of others are dropped)."""

    def __init__(
        self,
        plane: EventPlane[Any, Any],
        endpoint: EndpointId,
        load: InstanceLoad,
        announced: Callable[[int], bool],
        *,
        retry_min_s: float = RETRY_MIN_S,
        retry_max_s: float = RETRY_MAX_S,
    ) -> None:
        self._plane = plane
        self._endpoint = endpoint
        self.load = load
        self._announced = announced
        self._retry_min_s = retry_min_s
        self._retry_max_s = retry_max_s
        self._task: asyncio.Task[None] | None = None
        self._backoff = retry_min_s
        self._decoder = BatchDecoder(BusyFlag, LOAD_TOPIC)
        #: Subscriptions that failed (for logs and tests).
        self.failures = 0

    def start(self) -> None:
        """Subscribe and feed, in a task of the running loop."""
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"busy-reports-{self._endpoint.path()}"
        )

    async def _run(self) -> None:
        while True:
            try:
                await self._feed()
                return  # the plane closed the subscription
            except Exception as exc:
                self.failures += 1
                backoff = self._backoff
                log.warning(
                    "load reports of %s: subscription failed (%s); subscribing again in %gs",
                    self._endpoint.path(),
                    exc,
                    backoff,
                )
            await asyncio.sleep(backoff)
            self._backoff = min(backoff * 2, self._retry_max_s)

    async def _feed(self) -> None:
        endpoint = self._endpoint
        sub = await self._plane.subscribe(endpoint.namespace, endpoint.component, LOAD_TOPIC)
        self._backoff = self._retry_min_s  # subscribed: a later failure starts over
        try:
            on_report = self.load.on_load_report
            announced = self._announced
            decoder = self._decoder
            while (batch := await take_ready(sub)) is not None:
                latest: dict[tuple[int, int], bool] = {}
                for report in decoder.decode(batch):
                    latest[(report.worker_id, report.dp_rank)] = report.busy
                for (worker_id, dp_rank), busy in latest.items():
                    if announced(worker_id):
                        on_report(worker_id, dp_rank, busy)
        finally:
            await sub.close()

    async def aclose(self) -> None:
        """Stop feeding and wait until the subscription is closed. Never raises (a feed
        that failed closing is logged): closing a card's routing must go on past it."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            try:
                await task
            except Exception:
                log.exception("load reports of %s: closing the feed failed", self._endpoint.path())
