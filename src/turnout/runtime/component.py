"""The component layer: serve an endpoint as instances, and find and call an endpoint's instances.

A ``DistributedRuntime`` ties one discovery store to one request-plane server (started lazily,
shared by every instance the process serves) and a request-plane client per transport kind.
The serving side is ``serving`` (``ServingInstance``), the calling side ``endpoint_client``
(``EndpointClient``); this module holds the runtime and the ``Endpoint`` that makes both.

Serving::

    instance = await runtime.endpoint(eid).serve(handler, records=lambda iid: [(key, card)])
    # lease granted (instance_id = lease id), handler registered at "<endpoint path>/<id:x>",
    # Instance JSON at v1/instances/<endpoint path>/<id:x>, extra records, all under the lease
    await instance.stop()   # records vanish first (watchers stop sending), then drain

Calling::

    client = await runtime.endpoint(eid).client()   # watches v1/instances/<endpoint path>/
    await client.wait_for_instances(1, timeout=30)
    async for item in client.stream(client.instance_ids()[0], payload, ctx): ...
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from turnout.protocols.model import EndpointId, TransportAddress
from turnout.runtime.discovery.base import DiscoveryStore
from turnout.runtime.endpoint_client import EndpointClient
from turnout.runtime.event_plane import EventPlane, make_event_plane
from turnout.runtime.plane_tls import PlaneTls
from turnout.runtime.request_plane import make_client, make_server
from turnout.runtime.request_plane.base import (
    Handler,
    PeerState,
    RequestPlaneClient,
    RequestPlaneServer,
)
from turnout.runtime.request_plane.framing import DEFAULT_MAX_FRAME_BYTES
from turnout.runtime.serving import RecordsFn, ServingInstance

if TYPE_CHECKING:
    from turnout.runtime.nats import NatsConnection


class DistributedRuntime:
    """One process's handle on the planes; see the module docstring."""

    def __init__(
        self,
        store: DiscoveryStore,
        request_plane: str,
        host: str,
        lease_ttl: float,
        event_plane: EventPlane,
        *,
        advertise_host: str | None = None,
        nats: NatsConnection | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        plane_tls: PlaneTls | None = None,
    ) -> None:
        self.store = store
        #: KV events and load reports (``local`` or ``zmq``); closed by ``shutdown``.
        self.event_plane = event_plane
        self.request_plane = request_plane
        self.host = host
        #: The host published for this process's servers (None: the bound address).
        self.advertise_host = advertise_host
        #: The NATS connection the nats planes share (owned: closed by ``shutdown``).
        self.nats = nats
        self.lease_ttl = lease_ttl
        #: The bound on one request-plane frame, for this process's server and clients.
        self.max_frame_bytes = max_frame_bytes
        #: This process's plane credentials (None: plain planes).
        self.plane_tls = plane_tls
        #: Closed last by ``shutdown`` (a store opened for this runtime, see ``own_store``).
        self._owned_store: DiscoveryStore | None = None
        self._server: RequestPlaneServer | None = None
        self._address: TransportAddress | None = None
        self._server_lock = asyncio.Lock()
        self._clients: dict[str, RequestPlaneClient] = {}
        self._instances: set[ServingInstance] = set()
        self._endpoint_clients: set[EndpointClient] = set()
        self._shut_down = False

    @classmethod
    async def create(
        cls,
        *,
        store: DiscoveryStore,
        request_plane: str = "tcp",
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        lease_ttl: float = 10.0,
        event_plane: str | None = None,
        nats: NatsConnection | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        plane_tls: PlaneTls | None = None,
    ) -> DistributedRuntime:
        """A runtime over ``store`` (owned by the caller unless handed over with
        ``own_store``).

        Servers bind ``host`` and publish ``advertise_host`` (default: ``host``).
        ``event_plane`` defaults to ``local`` on the memory store (one process) and ``zmq``
        on any other (several processes). The ``nats`` planes need ``nats``, a connection
        this runtime then owns. ``plane_tls``: mutual TLS on the tcp request plane and
        CurveZMQ on the zmq event plane. Unknown plane names raise ``ConfigError``.
        """
        # Fail fast (ConfigError) on an unknown plane or a nats plane without a connection.
        make_server(request_plane, host, **_server_options(advertise_host, nats, plane_tls))
        kind = event_plane or ("local" if store.kind == "memory" else "zmq")
        options: dict[str, Any] = {}
        if kind == "zmq":
            options = {"lease_ttl": lease_ttl, "advertise_host": advertise_host}
            if plane_tls is not None:
                options["plane_tls"] = plane_tls
        elif kind == "nats":
            options = {"nats": nats}
        events = make_event_plane(kind, store, host, **options)
        return cls(
            store,
            request_plane,
            host,
            lease_ttl,
            events,
            advertise_host=advertise_host,
            nats=nats,
            max_frame_bytes=max_frame_bytes,
            plane_tls=plane_tls,
        )

    def own_store(self) -> None:
        """Hand the store over: ``shutdown`` closes it, after everything that uses it."""
        self._owned_store = self.store

    def endpoint(self, endpoint_id: EndpointId) -> Endpoint:
        return Endpoint(self, endpoint_id)

    async def _serving_server(self) -> tuple[RequestPlaneServer, TransportAddress]:
        """The process's one request-plane server, started on first use, and its address."""
        async with self._server_lock:
            if self._server is None:
                options = _server_options(self.advertise_host, self.nats, self.plane_tls)
                server = make_server(
                    self.request_plane, self.host, max_frame_bytes=self.max_frame_bytes, **options
                )
                self._address = await server.start()
                self._server = server
            assert self._address is not None
            return self._server, self._address

    def request_plane_client(self, kind: str) -> RequestPlaneClient:
        """The client for transport ``kind`` (one per runtime, made on first use)."""
        client = self._clients.get(kind)
        if client is None:
            options: dict[str, Any] = {"nats": self.nats} if self.nats is not None else {}
            if self.plane_tls is not None and kind == "tcp":
                options["plane_tls"] = self.plane_tls
            client = self._clients[kind] = make_client(
                kind, max_frame_bytes=self.max_frame_bytes, **options
            )
            client.add_peer_listener(self._peer_state)
        return client

    def use_request_plane_client(self, client: RequestPlaneClient) -> None:
        """Use ``client`` for its transport kind (one made with other timings, say) instead of
        one made on first use; call it before the first request of that kind."""
        if client.kind in self._clients:
            raise RuntimeError(f"a {client.kind} request-plane client is already in use")
        self._clients[client.kind] = client
        client.add_peer_listener(self._peer_state)

    def _peer_state(self, address: TransportAddress, state: PeerState) -> None:
        """A request-plane client learned something of a peer: every endpoint client hears
        it (each sets aside or restores the instances it knows at that address)."""
        for endpoint_client in list(self._endpoint_clients):
            endpoint_client.peer_state(address, state)

    async def shutdown(self) -> None:
        """Stop every served instance (leases revoked, streams drained), the server and the
        clients. Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        await asyncio.gather(*(inst.stop() for inst in list(self._instances)))
        for endpoint_client in list(self._endpoint_clients):
            await endpoint_client.close()
        if self._server is not None:
            await self._server.stop()
        for client in self._clients.values():
            await client.close()
        await self.event_plane.close()
        if self.nats is not None:
            await self.nats.close()
        if self._owned_store is not None:
            await self._owned_store.close()


def _server_options(
    advertise_host: str | None, nats: NatsConnection | None, plane_tls: PlaneTls | None
) -> dict[str, Any]:
    """The request-plane server options that are set (a plane takes only what it knows)."""
    options: dict[str, Any] = {}
    if plane_tls is not None:
        options["plane_tls"] = plane_tls
    if advertise_host is not None:
        options["advertise_host"] = advertise_host
    if nats is not None:
        options["nats"] = nats
    return options


class Endpoint:
    def __init__(self, runtime: DistributedRuntime, endpoint_id: EndpointId) -> None:
        self.runtime = runtime
        self.id = endpoint_id

    async def serve(
        self,
        handler: Handler,
        *,
        records: RecordsFn | None = None,
        handlers: dict[str, Handler] | None = None,
    ) -> ServingInstance:
        """Serve ``handler`` as a new instance of this endpoint, under a new lease.

        ``handlers`` are side handlers (see ``ServingInstance.add_handler``) registered before
        the instance and its ``records`` are published, so whoever sees them can call them.
        """
        runtime = self.runtime
        server, address = await runtime._serving_server()
        serving = ServingInstance(runtime, server, self.id, address, handler, records)
        serving._side_handlers.update(handlers or {})
        try:
            await serving._register()
        except BaseException:
            await serving.stop(drain_timeout=0)
            raise
        runtime._instances.add(serving)
        serving._start_guard()
        return serving

    async def client(self) -> EndpointClient:
        """A client that tracks this endpoint's instances; it holds the initial set on return."""
        client = EndpointClient(self.runtime, self.id)
        await client._start()
        self.runtime._endpoint_clients.add(client)
        return client
