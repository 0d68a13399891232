"""One acting planner per deployment: a leader elected through leases in the discovery store.

Each planner is a candidate: it writes ``v1/planner/{namespace}/candidates/{lease:x}`` under
a lease of its own, kept alive as instances' are. The candidate whose key the store wrote
first (lowest revision) leads; the others stand by. When the leader stops, its lease is
revoked; when it dies or hangs, its lease expires within the TTL; either way its key
vanishes and the next candidate leads. This is etcd's own election recipe, on the store's
put, lease and revision alone (no transaction needed), so the file store elects too.

A candidate that cannot reach the store for a whole TTL stops leading (its lease may have
expired for the others, who may elect someone else); one whose lease the store ended
becomes a candidate again under a new lease, at the back of the line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec

from turnout.protocols.planner import Candidate, candidates_prefix
from turnout.runtime.discovery.base import DiscoveryStore
from turnout.runtime.lease import Lease

log = logging.getLogger("turnout.planner")

__all__ = ["Candidate", "LeaderElection", "candidates_prefix"]


class LeaderElection:
    """This process's candidacy; ``leading`` says whether it acts now."""

    def __init__(
        self,
        store: DiscoveryStore,
        namespace: str,
        me: Candidate,
        *,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._prefix = candidates_prefix(namespace)
        self._me = me
        self._ttl = ttl
        self._clock = clock
        self._lease: Lease | None = None
        self._key: str | None = None
        self._last_ok: float | None = None
        self._task: asyncio.Task[None] | None = None
        #: The leading candidate's record, as last read (None: unknown).
        self.leader: Candidate | None = None
        self._leading = False

    @property
    def leading(self) -> bool:
        """This candidate leads, and heard from the store within a TTL."""
        if not self._leading or self._last_ok is None:
            return False
        return self._clock() - self._last_ok < self._ttl

    async def start(self) -> None:
        """Stand as a candidate (the store must answer: a planner that cannot is misconfigured)
        and follow the election in the background."""
        await asyncio.wait_for(self._stand(), self._ttl)
        await self.poll()
        self._task = asyncio.create_task(self._follow(), name="planner-election")

    async def _stand(self) -> None:
        self._lease = await Lease.grant(self._store, self._ttl)
        self._key = f"{self._prefix}{self._lease.id:x}"
        await self._store.put(self._key, msgspec.json.encode(self._me), lease_id=self._lease.id)

    async def poll(self) -> None:
        """Read the candidates once: who leads now."""
        kvs = await asyncio.wait_for(self._store.get_prefix(self._prefix), self._ttl / 3)
        self._last_ok = self._clock()
        first = min(kvs, key=lambda kv: (kv.revision, kv.key), default=None)
        leading = first is not None and first.key == self._key
        leader: Candidate | None = None
        if first is not None:
            try:
                leader = msgspec.json.decode(first.value, type=Candidate)
            except msgspec.DecodeError:
                log.warning("the leading planner's record %s is malformed", first.key)
        self.leader = leader
        if leading != self._leading:
            self._leading = leading
            if leading:
                log.info("leading the planners of %s", self._prefix)
            else:
                who = f"{leader.host} pid {leader.pid}" if leader else "another planner"
                log.info("standing by: %s leads", who)

    async def _follow(self) -> None:
        interval = self._ttl / 3
        failing = False
        while True:
            await asyncio.sleep(interval)
            lease = self._lease
            try:
                if lease is not None and lease.lost.is_set():
                    log.warning("the store ended this planner's lease; standing again")
                    self._leading = False
                    await asyncio.wait_for(self._stand(), self._ttl)
                await self.poll()
                if failing:
                    failing = False
                    log.info("the store answers the election again")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not failing:
                    failing = True
                    log.warning("cannot read the planner election: %s", exc)
                if self._leading and not self.leading:
                    self._leading = False
                    log.error("no answer from the store for a TTL: no longer leading")

    async def others(self) -> int:
        """Candidates other than this one (a leader that is the last may tidy up at exit)."""
        kvs = await asyncio.wait_for(self._store.get_prefix(self._prefix), self._ttl / 3)
        return sum(1 for kv in kvs if kv.key != self._key)

    async def stop(self) -> None:
        """Leave the election: the lease is revoked, the next candidate leads at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._leading = False
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._lease.revoke(), self._ttl / 3)
            self._lease = None
