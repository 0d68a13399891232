"""``Lease``: a discovery-store lease kept alive by a background task until revoked.

Keys put under ``lease.id`` live as long as this process keeps the lease alive; when the
process dies (or hangs past the TTL), the store ends the lease and every watcher sees the
keys vanish. ``lost`` tells the owner when the keep-alive found the lease already gone (the
keys are gone too; re-register under a new lease).

Only the store says a lease has ended. A keep-alive that fails (the store is unreachable, or
its write lock is held by a stopped process) is retried every interval for as long as it
takes; past the TTL an error is logged once (the keys have probably vanished for the others),
and the first answer decides: ``False`` (etcd ended it meanwhile) sets ``lost``, ``True`` (the
file store gives leases back the time its lock was held) means nothing was lost, and no
instance needs to register again under a new id.
"""

from __future__ import annotations

import asyncio
import logging
import time

from turnout.runtime.discovery.base import DiscoveryStore

logger = logging.getLogger("turnout.runtime")


class Lease:
    """A granted lease and its keep-alive task (every ``ttl / 3`` seconds)."""

    def __init__(self, store: DiscoveryStore, lease_id: int, ttl: float) -> None:
        self.store = store
        self.id = lease_id
        self.ttl = ttl
        #: Set when the store answers a keep-alive with "ended" (expired or revoked
        #: elsewhere); an unreachable store is retried until it answers.
        self.lost = asyncio.Event()
        self._revoked = False
        self._task = asyncio.get_running_loop().create_task(
            self._keep_alive(), name=f"lease-keepalive-{lease_id:x}"
        )

    @classmethod
    async def grant(cls, store: DiscoveryStore, ttl: float) -> Lease:
        """Grant a lease of ``ttl`` seconds on ``store`` and start keeping it alive."""
        lease_id = await store.grant_lease(ttl)
        return cls(store, lease_id, ttl)

    @property
    def revoked(self) -> bool:
        return self._revoked

    async def _keep_alive(self) -> None:
        """Keep the lease alive until it is revoked or the store says it ended. Failures are
        logged once per streak (and once more past the TTL), not once per retry."""
        interval = self.ttl / 3
        last_ok = time.monotonic()
        contact = self.store.contact
        if contact.last_ok is None:
            contact.last_ok = last_ok  # the grant was an answer
        failing = overdue = False
        while True:
            await asyncio.sleep(interval)
            try:
                alive = await self.store.keep_alive(self.id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                contact.failures += 1
                if not failing:
                    failing = True
                    logger.warning("lease %x keep-alive failed, retrying: %s", self.id, exc)
                if not overdue and time.monotonic() - last_ok >= self.ttl:
                    overdue = True
                    logger.error(
                        "lease %x not kept alive for %.1fs, more than its TTL; still trying: %s",
                        self.id,
                        time.monotonic() - last_ok,
                        exc,
                    )
                continue
            contact.last_ok = time.monotonic()  # answered, whatever it said
            if not alive:
                logger.warning(
                    "lease %x ended before its keep-alive; its owner registers again", self.id
                )
                self.lost.set()
                return
            if failing:
                logger.warning("lease %x kept alive again; nothing was lost", self.id)
                failing = overdue = False
            last_ok = contact.last_ok

    async def revoke(self) -> None:
        """End the lease now (its keys vanish) and stop the keep-alive. Idempotent."""
        if self._revoked:
            return
        self._revoked = True
        self._task.cancel()
        # wait(), not await: our own cancellation must propagate, the task's must not.
        await asyncio.wait([self._task])
        if not self.lost.is_set():
            try:
                await self.store.revoke_lease(self.id)
            except Exception as exc:
                # The store is gone or closed: the lease ends by expiry instead.
                logger.warning("lease %x revoke failed (it will expire): %s", self.id, exc)

    def __repr__(self) -> str:
        return f"Lease(id={self.id:x}, ttl={self.ttl}, lost={self.lost.is_set()})"
