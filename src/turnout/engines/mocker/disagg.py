"""The mocker's side of disaggregated serving: KV handles on prefill workers, KV arrivals on
decode workers, and the simulated time the bytes take on the link.

Prefill side: a prefill-stage request that ends at its token limit parks its blocks in its
scheduler (``Scheduler.release_parked`` frees them); ``KvHandles.park`` names them with a
``KvHandle``. The handle's blocks go back to the pool exactly once, on the first of:

* a pull served or abandoned (``serve``: the transfer time passes, then the blocks are
  freed; handles are single-use),
* a push acknowledged by the decode instance (or failed: the decode side then retries),
* a release (the frontend says nobody will take them),
* the TTL (``expire``, run by the engine's sweeper: a decode worker that never came).

Decode side: ``obtain`` gets a handle's KV, by pulling it or by waiting for its push, within
``kv_transfer_timeout_s``; the engine then stores those blocks as its own (KV events) and
computes only the rest of the prompt.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turnout.engines.kv_transfer import KvTransport
from turnout.engines.mocker.config import MockerConfig
from turnout.engines.mocker.timing import Clock, Sleep
from turnout.protocols.disagg import (
    KvHandle,
    KvTransferMode,
    KvTransferOp,
    KvTransferReply,
    KvTransferRequest,
)
from turnout.protocols.model import EndpointId
from turnout.runtime import tracing
from turnout.runtime.log_context import current_request

log = logging.getLogger(__name__)

#: Frees the blocks a rank's scheduler parked for a request id.
ReleaseFn = Callable[[int, str], None]

#: Pushed handles a decode worker keeps for a decode request that has not arrived yet, at
#: most (each is a few hundred bytes; they expire with the handle's TTL).
MAX_PENDING_ARRIVALS = 4096


@dataclass(slots=True)
class _Parked:
    """One handle's blocks on this prefill worker."""

    handle: KvHandle
    dp_rank: int
    request_id: str
    expires_at: float
    #: A transfer is moving the blocks now: neither TTL nor release may free them.
    busy: bool = False


class KvHandles:
    """The prefill side: handles parked here, their transfers, their expiry."""

    def __init__(
        self,
        config: MockerConfig,
        release: ReleaseFn,
        *,
        clock: Clock,
        sleep: Sleep,
    ) -> None:
        self._config = config
        self._release = release
        self._clock = clock
        self._sleep = sleep
        self._parked: dict[str, _Parked] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: The handler tasks serving pulls now (cut when the engine stops, as a dead
        #: worker's link would be).
        self._pulls: set[asyncio.Task[Any]] = set()
        self.transport: KvTransport | None = None
        #: Bytes this worker sent (pulls served, pushes acknowledged), for tests and logs.
        self.bytes_sent = 0

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, handle_id: str) -> bool:
        return handle_id in self._parked

    @property
    def num_transferring(self) -> int:
        """Handles whose blocks are on the link now."""
        return sum(1 for entry in self._parked.values() if entry.busy)

    def park(
        self,
        *,
        dp_rank: int,
        request_id: str,
        num_tokens: int,
        endpoint: EndpointId,
        instance_id: int,
        push_to: int | None,
        push_endpoint: EndpointId | None,
    ) -> KvHandle:
        """Name the blocks a request parked; in push mode, start sending them at once."""
        push = (
            self._config.kv_transfer == KvTransferMode.PUSH.value
            and push_to is not None
            and push_endpoint is not None
            and self.transport is not None
        )
        handle = KvHandle(
            handle_id=secrets.token_hex(8),
            endpoint=endpoint,
            instance_id=instance_id,
            num_tokens=num_tokens,
            num_bytes=num_tokens * self._config.kv_bytes_per_token,
            mode=KvTransferMode.PUSH if push else KvTransferMode.PULL,
            ttl_s=self._config.kv_handle_ttl_s,
            pushed_to=push_to if push else None,
        )
        entry = _Parked(handle, dp_rank, request_id, self._clock() + handle.ttl_s)
        self._parked[handle.handle_id] = entry
        if push:
            assert push_endpoint is not None and push_to is not None
            entry.busy = True
            task = asyncio.get_running_loop().create_task(self._push(entry, push_endpoint, push_to))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return handle

    async def serve(self, request: KvTransferRequest) -> KvTransferReply:
        """A pull or release of one of this worker's handles (``KV_TRANSFER_HANDLER``)."""
        entry = self._parked.get(request.handle_id)
        if entry is None:
            return KvTransferReply(
                ok=False, error=f"unknown or expired KV handle {request.handle_id}"
            )
        if request.op is KvTransferOp.RELEASE:
            if not entry.busy:  # else the transfer under way frees them when it ends
                self._free(entry)
            return KvTransferReply(ok=True)
        if entry.busy:
            return KvTransferReply(
                ok=False, error=f"KV handle {request.handle_id} is being transferred already"
            )
        entry.busy = True
        transfer = asyncio.current_task()
        if transfer is not None:
            self._pulls.add(transfer)
        try:
            await self._sleep(self._config.transfer_seconds(entry.handle.num_bytes))
        finally:
            self._pulls.discard(transfer)
            # Across, or the puller left mid-way: handles are single-use (a decode worker
            # that gave up fails back to the frontend, which prefills again), so either way
            # the blocks go back now.
            entry.busy = False
            self._free(entry)
        self.bytes_sent += entry.handle.num_bytes
        return KvTransferReply(ok=True, num_bytes=entry.handle.num_bytes)

    async def _push(self, entry: _Parked, endpoint: EndpointId, target: int) -> None:
        handle = entry.handle
        assert self.transport is not None
        try:
            await self._sleep(self._config.transfer_seconds(handle.num_bytes))
            async with asyncio.timeout(self._config.kv_transfer_timeout_s):
                reply = await self.transport.push(endpoint, target, handle)
            if reply.ok:
                self.bytes_sent += handle.num_bytes
            else:
                log.warning("push of KV handle %s to %x refused: %s", handle.handle_id, target,
                            reply.error)  # fmt: skip
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the decode side times out and the frontend re-prefills
            log.warning("push of KV handle %s to %x failed: %r", handle.handle_id, target, exc)
        finally:
            self._free(entry)

    def expire(self, now: float | None = None) -> int:
        """Free the handles whose TTL passed (not those mid-transfer); how many."""
        now = self._clock() if now is None else now
        expired = [e for e in self._parked.values() if not e.busy and e.expires_at <= now]
        for entry in expired:
            log.info("KV handle %s expired unclaimed after %gs", entry.handle.handle_id,
                     entry.handle.ttl_s)  # fmt: skip
            self._free(entry)
        return len(expired)

    def drop(self, handle_id: str) -> None:
        """Free a handle nobody will claim (its output never reached the frontend)."""
        entry = self._parked.get(handle_id)
        if entry is not None and not entry.busy:
            self._free(entry)

    def _free(self, entry: _Parked) -> None:
        if self._parked.pop(entry.handle.handle_id, None) is not None:
            self._release(entry.dp_rank, entry.request_id)

    async def close(self) -> None:
        """Cut transfers in flight and free every handle."""
        for task in [*self._tasks, *self._pulls]:
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        for entry in list(self._parked.values()):
            self._free(entry)


class KvArrivals:
    """The decode side: obtaining a handle's KV, by pull or by waiting for its push."""

    def __init__(self, config: MockerConfig, *, clock: Clock) -> None:
        self._config = config
        self._clock = clock
        #: Pushes that arrived before their decode request: handle id -> expiry time.
        self._arrived: OrderedDict[str, float] = OrderedDict()
        #: Decode requests waiting for a push: handle id -> future set on arrival.
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self.transport: KvTransport | None = None
        #: Bytes received (pulls and pushes), for tests and logs.
        self.bytes_received = 0

    def deliver(self, handle: KvHandle) -> KvTransferReply:
        """A push arrived (``KV_TRANSFER_HANDLER``, op push)."""
        waiter = self._waiting.get(handle.handle_id)
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(None)
        else:
            self._forget_expired()
            if len(self._arrived) >= MAX_PENDING_ARRIVALS:
                return KvTransferReply(
                    ok=False, error=f"{MAX_PENDING_ARRIVALS} pushed KV handles are unclaimed"
                )
            self._arrived[handle.handle_id] = self._clock() + handle.ttl_s
        self.bytes_received += handle.num_bytes
        return KvTransferReply(ok=True, num_bytes=handle.num_bytes)

    async def obtain(self, handle: KvHandle, instance_id: int) -> str | None:
        """Get ``handle``'s KV here; None when it is here, else why it could not be."""
        attributes = {
            "turnout.kv.mode": handle.mode.value,
            "turnout.kv.bytes": handle.num_bytes,
            "turnout.kv.from": f"{handle.instance_id:x}",
        }
        try:
            with tracing.traced(current_request(), "kv_transfer", **attributes):
                async with asyncio.timeout(self._config.kv_transfer_timeout_s):
                    if handle.mode is KvTransferMode.PUSH and handle.pushed_to == instance_id:
                        await self._wait_push(handle)
                        return None
                    if self.transport is None:
                        return "this worker has no KV transport"
                    reply = await self.transport.pull(handle)
        except TimeoutError:
            how = "push" if handle.mode is KvTransferMode.PUSH else "pull"
            return (
                f"KV of handle {handle.handle_id} ({how} from {handle.instance_id:x}) did not "
                f"arrive within {self._config.kv_transfer_timeout_s:g}s"
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # peer gone, stream broken: the frontend re-prefills
            return f"pulling KV handle {handle.handle_id} from {handle.instance_id:x} failed: {exc}"
        if not reply.ok:
            return reply.error or f"KV handle {handle.handle_id} was refused"
        self.bytes_received += reply.num_bytes
        return None

    async def _wait_push(self, handle: KvHandle) -> None:
        if self._arrived.pop(handle.handle_id, None) is not None:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[handle.handle_id] = waiter
        try:
            await waiter
        finally:
            self._waiting.pop(handle.handle_id, None)

    def _forget_expired(self) -> None:
        now = self._clock()
        while self._arrived:
            handle_id, expires_at = next(iter(self._arrived.items()))
            if expires_at > now:
                break
            del self._arrived[handle_id]
