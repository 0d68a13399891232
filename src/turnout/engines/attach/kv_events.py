"""An attached server's native KV events, fed to turnout's routers.

The engine publishes its cache's events on ZMQ (vLLM's and SGLang's ``--kv-events-config``);
one ``NativeKvSubscriber`` per publisher (``--kv-events``, one per data-parallel rank)
repairs gaps through the replay socket (``--kv-events-replay``), and one
``NativeKvTranslator`` per server re-keys the blocks by turnout's own hashes at the card's
block size. What comes out is published as ``KvEventBatch``es by the attach engine, stamped
with the instance id (known only once the worker registered: ``bind``).
"""

from __future__ import annotations

from collections.abc import Callable

from turnout.protocols.kv import KvCacheEvent, KvEventBatch, KvSnapshot

from .native_kv import NativeKvTranslator
from .native_kv_subscriber import NativeKvSubscriber

__all__ = ["KvEventsFeed"]


class KvEventsFeed:
    """The publishers of one server (``endpoints[i]`` is rank ``i``; ``replays[i]`` its
    replay socket or None), translated at ``block_size``."""

    def __init__(self, endpoints: list[str], replays: list[str | None], *, block_size: int) -> None:
        if not endpoints:
            raise ValueError("a KV events feed needs at least one publisher endpoint")
        if len(replays) != len(endpoints):
            raise ValueError("one replay endpoint (or None) per publisher endpoint")
        self.endpoints = endpoints
        self.replays = replays
        self.translator = NativeKvTranslator(block_size=block_size)
        self._subscribers: list[NativeKvSubscriber] = []

    def bind(self, worker_id: int) -> None:
        self.translator.worker_id = worker_id

    async def start(self, publish: Callable[[KvEventBatch], None]) -> None:
        def on_events(events: list[KvCacheEvent]) -> None:
            if events:
                publish(KvEventBatch(events=events))

        for rank, (endpoint, replay) in enumerate(zip(self.endpoints, self.replays, strict=True)):
            subscriber = NativeKvSubscriber(
                endpoint,
                translator=self.translator,
                on_events=on_events,
                dp_rank=rank,
                replay_endpoint=replay,
            )
            await subscriber.start()
            self._subscribers.append(subscriber)

    async def stop(self) -> None:
        subscribers, self._subscribers = self._subscribers, []
        for subscriber in subscribers:
            await subscriber.stop()

    def snapshot(self, dp_rank: int = 0) -> KvSnapshot:
        return self.translator.snapshot(dp_rank)
