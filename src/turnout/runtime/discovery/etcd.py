"""``EtcdStore``: the discovery store of a deployment across hosts, in an etcd v3 cluster.

Mental model: etcd already *is* this contract (keys, leases, revisioned watches); the store is
a thin, defensive translation over etcd's v3 gRPC API (``etcd_client``), in three layers:
``etcd_connection`` (endpoints, channels, credentials, fail-over, the store's generation),
``etcd_watch`` (watch streams, re-opened and resynced by the store) and this module (keys,
leases).

* Revisions are etcd's: a key's ``mod_revision``, a change's header revision. etcd bumps the
  revision once per transaction and every call here is one transaction, so "one change, one
  revision" holds; the one exception is a lease ending, which deletes all its keys in one
  transaction: their DELETEs share a revision (and arrive together, in one watch response).
* Leases are etcd leases. etcd TTLs are whole seconds, so a fractional TTL is rounded **up**
  (at least 1 s), and the cluster may raise it further to its own minimum (1.5 election
  timeouts, 2 s with etcd's default timings). A lease therefore never ends *earlier* than
  asked, only later.
* A lease granted before the store was restored or rebuilt (``generation``) is reported
  ended by its next keep-alive, whether or not the restored store still has it: its keys
  are gone, or an old copy. Its owner registers again under a new lease, so every key is
  put again.
* Every call stays under ``STORE_ROOT`` (the start-up check reads there too), so turnout runs
  under an etcd role granted ``readwrite`` on that prefix alone. Leases need no key
  permission; compaction needs none in etcd 3.4 either.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence
from typing import Any

import grpc
import grpc.aio

from turnout.errors import ConfigError, DiscoveryError
from turnout.runtime.discovery import etcd_v3_pb2 as pb
from turnout.runtime.discovery.base import DiscoveryStore, KeyValue
from turnout.runtime.discovery.etcd_client import LEASE_KEEP_ALIVE
from turnout.runtime.discovery.etcd_connection import (
    Endpoint,
    EtcdUnavailable,
    Unreachable,
    one_line,
)
from turnout.runtime.discovery.etcd_watch import EtcdWatches, SeenKeys

#: The prefix every key turnout writes or reads lives under: a deployment may limit turnout's
#: etcd role to it (``readwrite`` on the prefix ``v1/``), so every call stays inside it.
STORE_ROOT = "v1/"

__all__ = ["STORE_ROOT", "EtcdStore", "EtcdUnavailable", "open_etcd_store"]


class EtcdStore(EtcdWatches, DiscoveryStore):
    """Discovery store in etcd v3; see the module docstring for the design and
    ``EtcdConnection`` for the options."""

    kind = "etcd"

    def __init__(
        self,
        endpoints: Sequence[str] | str = ("http://127.0.0.1:2379",),
        *,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
        connect_timeout: float = 5.0,
    ) -> None:
        super().__init__(
            endpoints,
            ca_cert=ca_cert,
            cert=cert,
            key=key,
            user=user,
            password=password,
            connect_timeout=connect_timeout,
        )
        self._seen = SeenKeys(lambda: asyncio.get_running_loop().time())
        #: Each lease this store granted and still keeps alive → the generation it was
        #: granted in (removed when it is revoked or reported ended).
        self._lease_generations: dict[int, int] = {}

    # -- reachability ---------------------------------------------------------------------

    async def check(self) -> None:
        """Raise ``DiscoveryError`` unless some endpoint answers a read (and, with a user,
        accepts the credentials) within ``connect_timeout``."""

        async def ping(ep: Endpoint) -> None:
            calls = self._connect(ep)
            floor = self._floor()
            key, end = self._range(STORE_ROOT)
            resp = await calls.range(
                pb.RangeRequest(key=key, range_end=end, count_only=True),
                timeout=self.connect_timeout,
                metadata=self._metadata(),
            )
            self._observe(resp.header, floor)

        await self._call("check", ping, retry=False)

    # -- leases ---------------------------------------------------------------------------

    async def grant_lease(self, ttl: float) -> int:
        """A new etcd lease; ``ttl`` is rounded up to whole seconds (at least 1)."""
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")
        seconds = max(1, math.ceil(ttl))

        async def grant(ep: Endpoint) -> int:
            calls = self._connect(ep)
            floor = self._floor()
            resp = await calls.lease_grant(
                pb.LeaseGrantRequest(TTL=seconds),
                timeout=self.connect_timeout,
                metadata=self._metadata(),
            )
            self._observe(resp.header, floor)
            return int(resp.ID)

        generation = self.generation
        lease_id = await self._call("grant lease", grant)
        if self.generation == generation:
            self._lease_generations[lease_id] = generation
        return lease_id

    async def keep_alive(self, lease_id: int) -> bool:
        """Extend the lease; False when it ended, or was granted before the store was
        restored or rebuilt: its keys are gone or an old copy, so it is revoked (the old
        copy goes at once, not a TTL later) and the owner registers again."""
        generation = self._lease_generations.get(lease_id, self.generation)
        if generation == self.generation:

            async def keep(ep: Endpoint) -> bool:
                floor = self._floor()
                # One request on etcd's LeaseKeepAlive stream, then the half-close: etcd
                # answers with the lease's remaining TTL (0: the lease is gone) and ends
                # the call.
                stream = self._open_stream(
                    ep,
                    LEASE_KEEP_ALIVE,
                    pb.LeaseKeepAliveResponse,
                    [pb.LeaseKeepAliveRequest(ID=lease_id)],
                    keep_open=False,
                    timeout=self.connect_timeout,
                )
                try:
                    resp = await stream.read()
                finally:
                    await stream.close()
                if resp is None:
                    raise Unreachable("keep-alive stream ended without an answer")
                self._observe(resp.header, floor)
                return int(resp.TTL) > 0

            alive = await self._call(f"keep-alive of lease {lease_id:x}", keep)
            if not alive:
                self._lease_generations.pop(lease_id, None)
                return False
            if generation == self.generation:
                return True
        # Best effort: a lease the restored store does not know is already gone.
        with contextlib.suppress(DiscoveryError):
            await self.revoke_lease(lease_id)
        return False

    async def revoke_lease(self, lease_id: int) -> None:
        async def revoke(ep: Endpoint) -> None:
            calls = self._connect(ep)
            try:
                await calls.lease_revoke(
                    pb.LeaseRevokeRequest(ID=lease_id),
                    timeout=self.connect_timeout,
                    metadata=self._metadata(),
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                one_line(exc)  # already ended: nothing to do (and no cycle kept)

        self._lease_generations.pop(lease_id, None)
        await self._call(f"revoke of lease {lease_id:x}", revoke)

    # -- keys -----------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, *, lease_id: int | None = None) -> int:
        async def put(ep: Endpoint) -> int:
            calls = self._connect(ep)
            floor = self._floor()
            try:
                resp = await calls.put(
                    pb.PutRequest(key=key.encode(), value=bytes(value), lease=lease_id or 0),
                    timeout=self.connect_timeout,
                    metadata=self._metadata(),
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND and lease_id is not None:
                    one_line(exc)
                    raise DiscoveryError(
                        f"cannot put {key!r}: lease {lease_id:x} does not exist"
                    ) from None
                raise
            self._observe(resp.header, floor)
            return int(resp.header.revision)

        return await self._call(f"put {key!r}", put)

    async def get(self, key: str) -> KeyValue | None:
        async def get(ep: Endpoint) -> tuple[KeyValue | None, int]:
            calls = self._connect(ep)
            floor = self._floor()
            resp = await calls.range(
                pb.RangeRequest(key=key.encode()),
                timeout=self.connect_timeout,
                metadata=self._metadata(),
            )
            self._observe(resp.header, floor)
            return (self._kv(resp.kvs[0]) if resp.kvs else None), int(resp.header.revision)

        kv, revision = await self._call(f"get {key!r}", get)
        # The caller knows of the key now: a watch it resumes must not leave it a ghost.
        self._seen.learn(key, [] if kv is None else [kv], revision, exact=True)
        return kv

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        kvs, revision = await self._list(prefix)
        # The caller knows of these keys now (it may resume a watch from their revisions, as
        # EndpointClient does): a resync past a compaction must report them if they vanish.
        self._seen.learn(prefix, kvs, revision)
        return kvs

    async def delete(self, key: str) -> bool:
        """Delete ``key``: True when this call deleted it.

        A failed attempt (a timeout, a dropped connection) may have deleted the key without
        the answer arriving; the call then retries, and the retry finds nothing to delete.
        It says True then: the key is gone, and this call may well be what removed it. So
        False always means the key did not exist when this call ran; True after a retry
        means "deleted, by this call or just before it".
        """
        uncertain = False

        async def delete(ep: Endpoint) -> bool:
            calls = self._connect(ep)
            floor = self._floor()
            nonlocal uncertain
            try:
                resp = await calls.delete_range(
                    pb.DeleteRangeRequest(key=key.encode()),
                    timeout=self.connect_timeout,
                    metadata=self._metadata(),
                )
            except BaseException:
                uncertain = True  # the request may have reached etcd and been applied
                raise
            self._observe(resp.header, floor)
            return int(resp.deleted) > 0 or uncertain

        return await self._call(f"delete {key!r}", delete)

    async def compact(self, revision: int) -> None:
        """Drop the history up to ``revision``: watches cannot resume before it any more."""

        async def compact(ep: Endpoint) -> None:
            calls = self._connect(ep)
            await calls.compact(
                pb.CompactionRequest(revision=revision, physical=True),
                timeout=self.connect_timeout,
                metadata=self._metadata(),
            )

        await self._call(f"compact at {revision}", compact)


async def open_etcd_store(**options: Any) -> EtcdStore:
    """An ``EtcdStore`` that answered a read within its connect timeout, or ``ConfigError``
    naming the endpoints (start-up: the caller exits with one line, not a traceback)."""
    store = EtcdStore(**options)
    try:
        await store.check()
    except EtcdUnavailable as exc:
        await store.close()
        reason = str(exc).split(": unreachable at ", 1)[-1].split(": ", 1)[-1]
        raise ConfigError(f"cannot reach etcd at {store.endpoints}: {reason}") from None
    except DiscoveryError as exc:
        await store.close()
        reason = str(exc).removeprefix("etcd check: ")
        if reason.startswith("etcd at "):
            raise ConfigError(reason) from None
        if "PERMISSION_DENIED" in reason:
            who = f"user {store.user!r}" if store.user is not None else "a client without a user"
            raise ConfigError(
                f"etcd at {store.endpoints} refused {who} a read under {STORE_ROOT!r} "
                f"({reason}): grant its role readwrite on the prefix {STORE_ROOT!r}"
            ) from None
        raise ConfigError(f"etcd at {store.endpoints} refused the check: {reason}") from None
    except BaseException:
        await store.close()
        raise
    return store
