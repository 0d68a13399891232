"""The serving side of the component layer: one instance of an endpoint, published in discovery.

``Endpoint.serve`` (``component``) makes a ``ServingInstance``: a lease from the store (its id
is the instance id), the handler registered on the process's request-plane server at
``handler_path(endpoint, instance_id)``, the ``Instance`` record and any extra records under
that lease. A lost lease is followed by a new registration (see ``ServingInstance``);
``stop`` withdraws the records first, so watchers stop choosing the instance, then drains.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from turnout.protocols.model import EndpointId, Instance, TransportAddress
from turnout.runtime.identity import identity_fields
from turnout.runtime.lease import Lease
from turnout.runtime.request_plane.base import Handler, RequestPlaneServer

if TYPE_CHECKING:
    from turnout.runtime.component import DistributedRuntime

logger = logging.getLogger("turnout.runtime")

#: Earlier registrations of an instance whose handlers stay reachable (see ``_former_paths``).
MAX_FORMER_REGISTRATIONS = 4
#: Backoff between attempts to register again after a lost lease.
REREGISTER_MIN_DELAY = 0.5
REREGISTER_MAX_DELAY = 5.0

RecordsFn = Callable[[int], list[tuple[str, bytes]]]

_instance_encoder = msgspec.json.Encoder()


def handler_path(endpoint: EndpointId, instance_id: int) -> str:
    """The request-plane path of one instance's handler (unique per process and store)."""
    return f"{endpoint.path()}/{instance_id:x}"


class ServingInstance:
    """One served instance: its record in discovery, its lease, its handler.

    When the store says its lease ended (it expired during an outage longer than the TTL, or
    was revoked elsewhere), every watcher has already seen the instance leave. The process
    itself is fine, so it registers again under a new lease, which is a new instance id,
    retrying with backoff until the store answers: ``records`` is called again with the new
    id, side handlers move to the new path, streams in flight on the old id go on, and the
    old id keeps answering for frontends that have not seen the new one yet.
    """

    def __init__(
        self,
        runtime: DistributedRuntime,
        server: RequestPlaneServer,
        endpoint: EndpointId,
        address: TransportAddress,
        handler: Handler,
        records: RecordsFn | None,
    ) -> None:
        self.endpoint = endpoint
        self.instance: Instance | None = None
        self.instance_id = 0
        self.lease: Lease | None = None
        #: Set after each re-registration (tests and operators wait on it).
        self.reregistered = asyncio.Event()
        self._runtime = runtime
        self._server = server
        self._address = address
        self._handler = handler
        self._records = records
        self._path = ""
        self._side_handlers: dict[str, Handler] = {}
        #: Handler paths of earlier registrations, still served: a frontend that has not yet
        #: seen the new id keeps reaching this process under the old one (same engine).
        self._former_paths: collections.deque[list[str]] = collections.deque()
        #: Whether the current registration reached the store (else its paths are dropped).
        self._published = False
        self._guard: asyncio.Task[None] | None = None
        self._stopped = False

    async def _register(self) -> None:
        """Take a new lease and publish the instance, its handlers and its records under it."""
        runtime = self._runtime
        lease = await Lease.grant(runtime.store, runtime.lease_ttl)
        old_paths = self._paths()
        if not self._published:  # a failed attempt: nobody was told of those paths
            for path in old_paths:
                self._server.unregister(path)
            old_paths = []
        self._published = False
        instance = Instance(
            endpoint=self.endpoint,
            instance_id=lease.id,
            transport=self._address,
            **identity_fields(runtime),
        )
        self.lease, self.instance, self.instance_id = lease, instance, lease.id
        self._path = handler_path(self.endpoint, lease.id)
        self._server.register(self._path, self._handler)
        for name, handler in self._side_handlers.items():
            self._server.register(f"{self._path}#{name}", handler)
        if old_paths:
            self._former_paths.append(old_paths)
            while len(self._former_paths) > MAX_FORMER_REGISTRATIONS:
                for path in self._former_paths.popleft():
                    self._server.unregister(path)
        store = runtime.store
        await store.put(instance.key(), _instance_encoder.encode(instance), lease_id=lease.id)
        for key, value in self._records(lease.id) if self._records else []:
            await store.put(key, value, lease_id=lease.id)
        self._published = True
        logger.info(
            "serving %s instance %x at %s", self.endpoint.path(), lease.id, self._address.address
        )

    def _paths(self) -> list[str]:
        if not self._path:
            return []
        return [self._path, *(f"{self._path}#{name}" for name in self._side_handlers)]

    def _start_guard(self) -> None:
        self._guard = asyncio.get_running_loop().create_task(
            self._keep_registered(), name=f"registration-{self.endpoint.path()}"
        )

    async def _keep_registered(self) -> None:
        delay = REREGISTER_MIN_DELAY
        while True:
            assert self.lease is not None
            await self.lease.lost.wait()
            old = self.instance_id
            logger.warning(
                "instance %x of %s lost its lease; registering again", old, self.endpoint.path()
            )
            failures = 0
            while True:
                try:
                    await self.lease.revoke()  # stops the old keep-alive; its keys are gone
                    await self._register()
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    # The first failure says why; the retries until it works say nothing new.
                    failures += 1
                    logger.log(
                        logging.WARNING if failures == 1 else logging.DEBUG,
                        "re-registering %s failed (retrying every %.1fs at most): %s",
                        self.endpoint.path(),
                        REREGISTER_MAX_DELAY,
                        exc,
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, REREGISTER_MAX_DELAY)
            delay = REREGISTER_MIN_DELAY
            logger.info(
                "instance %x of %s is back as %x", old, self.endpoint.path(), self.instance_id
            )
            self.reregistered.set()

    def add_handler(self, name: str, handler: Handler) -> None:
        """Serve a side handler of this instance (e.g. ``kv_snapshot``), reachable with
        ``EndpointClient.call(instance_id, name, ...)``; it goes away with the instance."""
        self._side_handlers[name] = handler
        self._server.register(f"{self._path}#{name}", handler)

    async def stop(self, drain_timeout: float = 5.0) -> None:
        """Leave: revoke the lease (records vanish, clients stop choosing us), refuse new
        requests, then let in-flight streams finish within ``drain_timeout``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._runtime._instances.discard(self)
        if self._guard is not None:
            self._guard.cancel()
            await asyncio.wait([self._guard])
        if self.lease is not None:
            await self.lease.revoke()
        paths = self._paths()
        for path in [*paths, *itertools.chain.from_iterable(self._former_paths)]:
            self._server.unregister(path)
        for path in [paths[0], *(former[0] for former in self._former_paths)] if paths else []:
            await self._server.drain(path, drain_timeout)
        logger.info("stopped %s instance %x", self.endpoint.path(), self.instance_id)
