"""A frontend's record in the discovery store (``protocols.frontend``), kept under its lease.

``FrontendRegistration`` grants a lease (its id is the frontend's id), writes the record
under it, and writes it again when what the frontend holds back changes: the owner sets
``changed``, and the record is rebuilt and written when it differs from the last one written,
at most once per ``min_interval`` (a rolling upgrade of many workers changes the set many
times a second; one write a second says the same). A lost lease (the store ended it during
an outage) is followed by a new one and the record again, as instances do. ``stop`` revokes
the lease: the record vanishes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from turnout.protocols.frontend import MAX_HELD_BACK, FrontendRecord, HeldBackCard
from turnout.runtime.identity import identity_fields
from turnout.runtime.lease import Lease

if TYPE_CHECKING:
    from turnout.runtime.component import DistributedRuntime

logger = logging.getLogger("turnout.runtime")

#: Least seconds between two writes of the record.
DEFAULT_MIN_INTERVAL = 1.0
#: Backoff between attempts to write after a failure (the store is unreachable).
RETRY_MIN_DELAY = 0.5
RETRY_MAX_DELAY = 10.0

_encoder = msgspec.json.Encoder()


class FrontendRegistration:
    """One frontend's record; see the module docstring.

    ``held_back``: what the frontend routes no request to, read when ``changed`` is set
    (this registration clears it).
    """

    def __init__(
        self,
        runtime: DistributedRuntime,
        *,
        http_address: str,
        router_mode: str,
        namespace: str | None,
        held_back: Callable[[], list[HeldBackCard]],
        changed: asyncio.Event,
        min_interval: float = DEFAULT_MIN_INTERVAL,
    ) -> None:
        self._runtime = runtime
        self._http_address = http_address
        self._router_mode = router_mode
        self._namespace = namespace
        self._held_back = held_back
        self._changed = changed
        self._min_interval = min_interval
        self._lease: Lease | None = None
        #: The record last written under the current lease (None: none yet).
        self._written: FrontendRecord | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def frontend_id(self) -> int:
        """The id of the current record (its lease's); 0 before ``start``."""
        return self._lease.id if self._lease is not None else 0

    @property
    def record(self) -> FrontendRecord | None:
        """The record last written."""
        return self._written

    async def start(self) -> None:
        """Grant the lease and write the record (errors raise: the store is reachable at
        start, or the frontend would not have opened its runtime)."""
        await self._register()
        self._task = asyncio.get_running_loop().create_task(
            self._keep_current(), name="frontend-record"
        )

    async def stop(self) -> None:
        """Revoke the lease (the record vanishes). Idempotent."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
            self._task = None
        if self._lease is not None:
            await self._lease.revoke()

    def _make_record(self, lease_id: int) -> FrontendRecord:
        held = self._held_back()
        return FrontendRecord(
            frontend_id=lease_id,
            http_address=self._http_address,
            router_mode=self._router_mode,
            namespace=self._namespace,
            held_back=held[:MAX_HELD_BACK],
            held_back_total=len(held),
            **identity_fields(self._runtime),
        )

    async def _register(self) -> None:
        runtime = self._runtime
        lease = await Lease.grant(runtime.store, runtime.lease_ttl)
        self._lease, self._written = lease, None
        await self._write()
        logger.info("frontend registered as %x", lease.id)

    async def _write(self) -> None:
        """Write the record if it differs from the last one written under this lease."""
        assert self._lease is not None
        self._changed.clear()
        record = self._make_record(self._lease.id)
        if record == self._written:
            return
        await self._runtime.store.put(
            record.key(), _encoder.encode(record), lease_id=self._lease.id
        )
        self._written = record

    async def _keep_current(self) -> None:
        delay = RETRY_MIN_DELAY
        while True:
            assert self._lease is not None
            lost = self._lease.lost
            await _first_of(self._changed, lost)
            try:
                if lost.is_set():
                    logger.warning("frontend %x lost its lease; registering again", self._lease.id)
                    await self._lease.revoke()
                    await self._register()
                else:
                    await self._write()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning(
                    "writing the frontend record failed (retrying in %.1fs): %s", delay, exc
                )
                self._changed.set()  # try again after the delay
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_DELAY)
                continue
            delay = RETRY_MIN_DELAY
            await asyncio.sleep(self._min_interval)


async def _first_of(*events: asyncio.Event) -> None:
    """Until one of ``events`` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
        await asyncio.wait(waits)
