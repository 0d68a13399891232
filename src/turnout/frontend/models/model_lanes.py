"""The model watcher's event queue: one lane of events a model, handled in store order.

Events of one model are handled one at a time, in store order (a model's DELETE after the
PUT it undoes); different models' events are handled concurrently, at most
``max_concurrent`` at once, so that a model whose build waits on a slow artifact fetch (a
tokenizer fetch running to its deadline) never holds up the others. A DELETE follows the
lane its key's last PUT was queued in, whatever the model it names.

At most ``max_queued`` events wait in all the lanes together; past it ``dispatch`` waits, so
a model whose build is stalled cannot make the watcher hold an unbounded backlog.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from turnout.frontend.models.card_intake import card_lane_name
from turnout.runtime.discovery.base import WatchEvent, WatchEventKind

__all__ = ["ModelLanes"]


@dataclass(slots=True, eq=False)
class _Lane:
    """The events of one model waiting to be handled, in store order, and the task handling
    them (None when there are none)."""

    events: deque[WatchEvent] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None


class ModelLanes:
    """Queues store events by model and hands each to ``handle`` (which must not raise but
    for cancellation) in its lane's order."""

    def __init__(
        self,
        handle: Callable[[WatchEvent], Awaitable[None]],
        *,
        max_concurrent: int,
        max_queued: int,
    ) -> None:
        self._handle = handle
        # Per model name, its events waiting to be handled; key -> the model name its last
        # PUT was queued under (so its DELETE follows it). Both hold only keys in the store
        # and models with events in flight.
        self._lanes: dict[str, _Lane] = {}
        self._lane_of_key: dict[str, str] = {}
        self._handling = asyncio.Semaphore(max_concurrent)
        self._room = asyncio.Semaphore(max_queued)
        self._queued = 0
        self._settled = asyncio.Event()
        self._settled.set()

    async def settled(self) -> None:
        """Return once every event dispatched so far has been handled."""
        await self._settled.wait()

    async def dispatch(self, event: WatchEvent) -> None:
        """Queue ``event`` behind its model's earlier events. Events that belong to no model
        (a value that is not a card, the DELETE of a key never queued) are handled here: they
        build nothing, so they cannot hold the watch up."""
        key = event.kv.key
        name: str | None
        if event.kind is WatchEventKind.PUT:
            name = card_lane_name(event.kv.value)
            if name is not None:
                self._lane_of_key[key] = name
        else:
            name = self._lane_of_key.pop(key, None)
        if name is None:
            await self._handle(event)
            return
        await self._room.acquire()
        self._queued += 1
        self._settled.clear()
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes[name] = _Lane()
        lane.events.append(event)
        if lane.task is None:
            lane.task = asyncio.get_running_loop().create_task(
                self._run_lane(name, lane), name=f"model-events-{name}"
            )

    async def cancel(self) -> None:
        """Cancel the events still being handled (a build in progress rolls back) and those
        waiting, and wait for their lanes to end."""
        lanes = [lane.task for lane in self._lanes.values() if lane.task is not None]
        for task in lanes:
            task.cancel()
        if lanes:
            await asyncio.wait(lanes)

    async def _run_lane(self, name: str, lane: _Lane) -> None:
        """Handle ``name``'s queued events in order, holding one of the concurrent slots for
        each; the lane is gone once it is empty."""
        try:
            while lane.events:
                event = lane.events.popleft()
                try:
                    async with self._handling:
                        await self._handle(event)
                finally:
                    self._done_one()
        finally:
            for _ in lane.events:  # cancelled: what was left will not be handled
                self._done_one()
            lane.events.clear()
            if self._lanes.get(name) is lane:
                del self._lanes[name]

    def _done_one(self) -> None:
        self._room.release()
        self._queued -= 1
        if self._queued == 0:
            self._settled.set()
