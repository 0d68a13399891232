"""``MemoryStore``: the discovery store of one process, kept in dicts on the event loop.

Every mutation happens synchronously on the loop (no ``await`` inside), so a change, its
revision, its history entry and its delivery to every watcher's queue are one atomic step:
a watcher registered at revision R sees exactly the changes after R, in order, once.

Leases expire by a timer (``loop.call_at``) that ``keep_alive`` pushes back; expiry deletes
the lease's keys like ``revoke_lease`` does.

The history of changes is bounded (``HISTORY_LIMIT``, or ``compact``). A watcher resuming
from before it is brought up to date from the current keys and a tombstone per deleted key
(the revision of its last deletion): PUTs of keys changed since, DELETEs of keys deleted
since, in revision order. It never keeps a key that vanished while it was away.

Tombstones are bounded: one is dropped once it is older than ``DELETE_GRACE_SECONDS`` (on
``clock``) and every open watch is past it, as the base contract says. An open watch is past
every revision it has been handed, and past the store's revision when nothing is pending for
it (its queue is empty and its backlog delivered).
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from turnout.errors import DiscoveryError
from turnout.runtime.discovery.base import (
    DELETE_GRACE_SECONDS,
    DiscoveryStore,
    KeyValue,
    WatchEvent,
    WatchEventKind,
)

#: How many past changes are kept for watchers that resume from a revision.
HISTORY_LIMIT = 10_000

_CLOSED = object()


@dataclass(slots=True)
class _Lease:
    ttl: float
    #: Owned by the store: the expiry timer, replaced on every keep-alive.
    timer: asyncio.TimerHandle | None = None
    keys: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Watcher:
    prefix: str
    queue: asyncio.Queue[WatchEvent | object]
    #: The revision of the last event handed to the consumer (or where it started).
    delivered: int
    #: True while backlog events remain to be handed over.
    in_backlog: bool = True


class MemoryStore(DiscoveryStore):
    """In-process discovery store; for single-process deployments and tests."""

    kind = "memory"

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        delete_grace: float = DELETE_GRACE_SECONDS,
    ) -> None:
        """``clock`` and ``delete_grace``: when tombstones may be dropped (see the module
        docstring); tests inject both."""
        self._clock = clock
        self._delete_grace = delete_grace
        self._revision = 0
        self._kvs: dict[str, KeyValue] = {}
        self._leases: dict[int, _Lease] = {}
        self._history: collections.deque[WatchEvent] = collections.deque(maxlen=HISTORY_LIMIT)
        #: Deleted keys → the revision of their last deletion (dropped when put again).
        self._tombstones: dict[str, int] = {}
        #: (clock time, revision, key) of each deletion, oldest first: what pruning walks.
        self._deletions: collections.deque[tuple[float, int, str]] = collections.deque()
        self._watchers: list[_Watcher] = []
        self._closed = False

    # -- leases ---------------------------------------------------------------------------

    async def grant_lease(self, ttl: float) -> int:
        self._check_open()
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")
        lease_id = secrets.randbits(63) or 1
        while lease_id in self._leases:
            lease_id = secrets.randbits(63) or 1
        lease = _Lease(ttl=ttl)
        self._leases[lease_id] = lease
        self._arm(lease_id, lease)
        return lease_id

    async def keep_alive(self, lease_id: int) -> bool:
        self._check_open()
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        self._arm(lease_id, lease)
        return True

    async def revoke_lease(self, lease_id: int) -> None:
        self._check_open()
        self._end_lease(lease_id)

    def _arm(self, lease_id: int, lease: _Lease) -> None:
        if lease.timer is not None:
            lease.timer.cancel()
        loop = asyncio.get_running_loop()
        lease.timer = loop.call_later(lease.ttl, self._end_lease, lease_id)

    def _end_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        if lease.timer is not None:
            lease.timer.cancel()
        for key in sorted(lease.keys):
            self._delete(key)

    # -- keys -----------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, *, lease_id: int | None = None) -> int:
        self._check_open()
        if lease_id is not None and lease_id not in self._leases:
            raise DiscoveryError(f"cannot put {key!r}: lease {lease_id:x} does not exist")
        old = self._kvs.get(key)
        if old is not None and old.lease_id is not None and old.lease_id != lease_id:
            old_lease = self._leases.get(old.lease_id)
            if old_lease is not None:
                old_lease.keys.discard(key)
        self._revision += 1
        kv = KeyValue(key=key, value=bytes(value), revision=self._revision, lease_id=lease_id)
        self._kvs[key] = kv
        self._tombstones.pop(key, None)
        if lease_id is not None:
            self._leases[lease_id].keys.add(key)
        self._publish(WatchEvent(WatchEventKind.PUT, kv))
        return self._revision

    async def get(self, key: str) -> KeyValue | None:
        self._check_open()
        return self._kvs.get(key)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        self._check_open()
        return [kv for key, kv in sorted(self._kvs.items()) if key.startswith(prefix)]

    async def delete(self, key: str) -> bool:
        self._check_open()
        return self._delete(key)

    def _delete(self, key: str) -> bool:
        old = self._kvs.pop(key, None)
        if old is None:
            return False
        if old.lease_id is not None:
            lease = self._leases.get(old.lease_id)
            if lease is not None:
                lease.keys.discard(key)
        self._revision += 1
        self._tombstones[key] = self._revision
        self._deletions.append((self._clock(), self._revision, key))
        kv = KeyValue(key=key, value=b"", revision=self._revision, lease_id=old.lease_id)
        self._publish(WatchEvent(WatchEventKind.DELETE, kv))
        self._prune_tombstones()
        return True

    def _position(self, watcher: _Watcher) -> int:
        """The revision ``watcher`` is current at: past everything when nothing is pending."""
        if watcher.in_backlog or not watcher.queue.empty():
            return watcher.delivered
        return self._revision

    def _prune_tombstones(self) -> None:
        """Drop the tombstones no resuming watcher can need any more: older than the grace
        and passed by every open watch (all such when none is open)."""
        horizon = self._clock() - self._delete_grace
        lowest = min((self._position(w) for w in self._watchers), default=self._revision)
        deletions = self._deletions
        while deletions:
            when, revision, key = deletions[0]
            if when > horizon or revision > lowest:
                return
            deletions.popleft()
            if self._tombstones.get(key) == revision:  # not put (and deleted) again since
                del self._tombstones[key]

    # -- watches --------------------------------------------------------------------------

    def _publish(self, event: WatchEvent) -> None:
        self._history.append(event)
        key = event.kv.key
        for watcher in self._watchers:
            if key.startswith(watcher.prefix):
                watcher.queue.put_nowait(event)

    async def compact(self, revision: int) -> None:
        """Forget the history up to ``revision``; watchers resuming before it resync."""
        self._check_open()
        while self._history and self._history[0].kv.revision <= revision:
            self._history.popleft()

    def _backlog(self, prefix: str, start_revision: int | None) -> list[WatchEvent]:
        """What a new watcher sees before live changes: history after ``start_revision``; a
        snapshot when no revision is given; a resync (see the module docstring) when the
        history no longer reaches back to it."""
        oldest = self._history[0].kv.revision if self._history else self._revision + 1
        if start_revision is None:
            return [
                WatchEvent(WatchEventKind.PUT, kv)
                for key, kv in sorted(self._kvs.items())
                if key.startswith(prefix)
            ]
        if start_revision + 1 >= oldest:
            return [
                ev
                for ev in self._history
                if ev.kv.revision > start_revision and ev.kv.key.startswith(prefix)
            ]
        events = [
            WatchEvent(WatchEventKind.PUT, kv)
            for key, kv in self._kvs.items()
            if key.startswith(prefix) and kv.revision > start_revision
        ]
        events += [
            WatchEvent(WatchEventKind.DELETE, KeyValue(key=key, value=b"", revision=rev))
            for key, rev in self._tombstones.items()
            if key.startswith(prefix) and rev > start_revision
        ]
        events.sort(key=lambda ev: ev.kv.revision)
        return events

    async def watch_prefix(
        self, prefix: str, *, start_revision: int | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        if self._closed:
            return
        # Backlog and registration happen with no await between them: nothing can slip in.
        backlog = self._backlog(prefix, start_revision)
        start = self._revision if start_revision is None else start_revision
        watcher = _Watcher(prefix=prefix, queue=asyncio.Queue(), delivered=start)
        self._watchers.append(watcher)
        try:
            for event in backlog:
                # A snapshot (sorted by key) is current at ``start`` as a whole.
                watcher.delivered = max(watcher.delivered, event.kv.revision)
                yield event
            watcher.in_backlog = False
            while True:
                item = await watcher.queue.get()
                if item is _CLOSED:
                    return
                assert isinstance(item, WatchEvent)
                watcher.delivered = item.kv.revision
                yield item
        finally:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for lease in self._leases.values():
            if lease.timer is not None:
                lease.timer.cancel()
        for watcher in self._watchers:
            watcher.queue.put_nowait(_CLOSED)

    def _check_open(self) -> None:
        if self._closed:
            raise DiscoveryError("memory store is closed")
