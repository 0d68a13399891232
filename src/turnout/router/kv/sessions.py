"""Which worker served each session's last turn: a soft routing preference, not a pin.

A conversation (or an agent's run) sends its turns with one session id (``x-session-id``).
Its next turn is likely to share the whole previous context, so the worker that served the
last turn is credited with a bonus in the cost; a worker whose cost exceeds the others' by
more than the bonus loses the session (a hot worker sheds sessions instead of queueing them).

The table is bounded twice: an entry lives ``ttl_s`` after the session's last turn, and past
``max_sessions`` the least recently used entry goes.
"""

from __future__ import annotations

from collections import OrderedDict

from turnout.router.kv.base import WorkerKey


class SessionTable:
    """session id -> (worker of its last turn, when). Synchronous."""

    def __init__(self, *, ttl_s: float, max_sessions: int) -> None:
        if ttl_s <= 0 or max_sessions <= 0:
            raise ValueError(f"bad session table bounds: ttl {ttl_s}, size {max_sessions}")
        self._ttl_s = ttl_s
        self._max = max_sessions
        self._entries: OrderedDict[str, tuple[WorkerKey, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str, now: float) -> WorkerKey | None:
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        if now - entry[1] > self._ttl_s:
            del self._entries[session_id]
            return None
        return entry[0]

    def record(self, session_id: str, worker_key: WorkerKey, now: float) -> None:
        entries = self._entries
        entries[session_id] = (worker_key, now)
        entries.move_to_end(session_id)
        while len(entries) > self._max:
            entries.popitem(last=False)
        # Expired entries at the old end go too (LRU order is also last-use order).
        while entries:
            _, (_, at) = next(iter(entries.items()))
            if now - at <= self._ttl_s:
                break
            entries.popitem(last=False)

    def remove_worker(self, worker_id: int) -> None:
        """The worker left: its sessions are free to go anywhere."""
        for sid in [s for s, (key, _) in self._entries.items() if key.worker_id == worker_id]:
            del self._entries[sid]
