"""The component layer: serve an endpoint as instances, and find and call an endpoint's instances.

A ``DistributedRuntime`` ties one discovery store to one request-plane server (started lazily,
shared by every instance the process serves) and a request-plane client per transport kind.

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
import collections
import contextlib
import itertools
import logging
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from turnout.errors import ConfigError, PeerUnavailable, StreamBroken
from turnout.protocols.model import INSTANCES_ROOT, EndpointId, Instance, TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery.base import DiscoveryStore, WatchEvent, WatchEventKind
from turnout.runtime.event_plane import EventPlane, make_event_plane
from turnout.runtime.lease import Lease
from turnout.runtime.request_plane import make_client, make_server
from turnout.runtime.request_plane.base import Handler, RequestPlaneClient, RequestPlaneServer
from turnout.runtime.request_plane.framing import DEFAULT_MAX_FRAME_BYTES

if TYPE_CHECKING:
    from turnout.runtime.nats import NatsConnection

logger = logging.getLogger("turnout.runtime")

#: How long an instance reported down stays set aside unless discovery re-announces it; each
#: further failure with no answer from it in between doubles that, up to the maximum (an
#: address announced in the store that never answers costs a request a try every minute,
#: not every five seconds).
DOWN_RETRY_SECONDS = 5.0
DOWN_RETRY_MAX_SECONDS = 60.0
#: Pause before re-opening a discovery watch that failed.
WATCH_RETRY_SECONDS = 1.0
#: Streams of an instance that left discovery may run this long (a draining worker's own
#: drain timeout, plus a margin) before they are failed as broken.
LEFT_STREAM_GRACE_SECONDS = 6.0
#: Earlier registrations of an instance whose handlers stay reachable (see ``_former_paths``).
MAX_FORMER_REGISTRATIONS = 4
#: Backoff between attempts to register again after a lost lease.
REREGISTER_MIN_DELAY = 0.5
REREGISTER_MAX_DELAY = 5.0

RecordsFn = Callable[[int], list[tuple[str, bytes]]]

_instance_decoder = msgspec.json.Decoder(Instance)
_instance_encoder = msgspec.json.Encoder()


def handler_path(endpoint: EndpointId, instance_id: int) -> str:
    """The request-plane path of one instance's handler (unique per process and store)."""
    return f"{endpoint.path()}/{instance_id:x}"


def instances_prefix(endpoint: EndpointId) -> str:
    return f"{INSTANCES_ROOT}/{endpoint.path()}/"


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
    ) -> DistributedRuntime:
        """A runtime over ``store`` (owned by the caller unless handed over with
        ``own_store``).

        Servers bind ``host`` and publish ``advertise_host`` (default: ``host``).
        ``event_plane`` defaults to ``local`` on the memory store (one process) and ``zmq``
        on any other (several processes). The ``nats`` planes need ``nats``, a connection
        this runtime then owns. Unknown plane names raise ``ConfigError``.
        """
        # Fail fast (ConfigError) on an unknown plane or a nats plane without a connection.
        make_server(request_plane, host, **_server_options(advertise_host, nats))
        kind = event_plane or ("local" if store.kind == "memory" else "zmq")
        options: dict[str, Any] = {}
        if kind == "zmq":
            options = {"lease_ttl": lease_ttl, "advertise_host": advertise_host}
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
                options = _server_options(self.advertise_host, self.nats)
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
            options = {"nats": self.nats} if self.nats is not None else {}
            client = self._clients[kind] = make_client(
                kind, max_frame_bytes=self.max_frame_bytes, **options
            )
        return client

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


def _server_options(advertise_host: str | None, nats: NatsConnection | None) -> dict[str, Any]:
    """The request-plane server options that are set (a plane takes only what it knows)."""
    options: dict[str, Any] = {}
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
        instance = Instance(endpoint=self.endpoint, instance_id=lease.id, transport=self._address)
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
            while True:
                try:
                    await self.lease.revoke()  # stops the old keep-alive; its keys are gone
                    await self._register()
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    logger.warning(
                        "re-registering %s failed (retrying in %.1fs): %s",
                        self.endpoint.path(),
                        delay,
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


class EndpointClient:
    """The live instances of one endpoint, kept current by a discovery watch."""

    def __init__(self, runtime: DistributedRuntime, endpoint: EndpointId) -> None:
        self.runtime = runtime
        self.endpoint = endpoint
        self._prefix = instances_prefix(endpoint)
        #: Changed only by ``_apply`` (discovery) — the instances announced in the store.
        self._instances: dict[int, Instance] = {}
        #: Changed by ``report_instance_down`` and ``_restore``/``_apply``: set aside ids and
        #: the timers that bring them back.
        self._down: dict[int, asyncio.TimerHandle] = {}
        #: Changed by ``report_instance_down`` (+1), a stream's first answer and a changed
        #: record (cleared): set-asides of each instance since it last answered.
        self._strikes: dict[int, int] = {}
        self._listeners: list[Callable[[], None]] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Streams started to each instance and not yet finished (weak: a stream dropped
        #: unfinished goes too): when an instance leaves discovery, they fail at once.
        self._open: dict[int, weakref.WeakSet[_InstanceStream]] = {}
        #: Where each instance in ``_open`` was reached (kept after it leaves discovery).
        self._open_transport: dict[int, TransportAddress] = {}

    # -- discovery ------------------------------------------------------------------------

    async def _start(self) -> None:
        store = self.runtime.store
        kvs = await store.get_prefix(self._prefix)
        for kv in kvs:
            self._apply(WatchEvent(WatchEventKind.PUT, kv), notify=False)
        # Resume after the newest key of the snapshot: replaying changes the snapshot already
        # holds is harmless (a PUT overwrites, a DELETE of an absent key is a no-op), and
        # nothing after it is missed. With no keys, a fresh watch snapshot is as good.
        start = max((kv.revision for kv in kvs), default=None)
        self._task = asyncio.get_running_loop().create_task(
            self._watch(start), name=f"endpoint-client-{self.endpoint.path()}"
        )

    async def _watch(self, revision: int | None) -> None:
        """Apply discovery changes until closed; a failed watch resumes after the last change
        it delivered (replays are harmless, see ``_start``)."""
        store = self.runtime.store
        while True:
            watch = store.watch_prefix(self._prefix, start_revision=revision)
            try:
                async for event in watch:
                    revision = max(revision or 0, event.kv.revision)
                    self._apply(event)
                return  # the store was closed
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("instance watch of %s failed; resuming", self.endpoint.path())
            finally:
                aclose = getattr(watch, "aclose", None)
                if aclose is not None:
                    await aclose()
            await asyncio.sleep(WATCH_RETRY_SECONDS)

    def _apply(self, event: WatchEvent, notify: bool = True) -> None:
        key = event.kv.key
        try:
            instance_id = int(key[len(self._prefix) :], 16)
        except ValueError:
            logger.warning("ignoring discovery key %r: not an instance id", key)
            return
        if event.kind is WatchEventKind.DELETE:
            changed = self._instances.pop(instance_id, None) is not None
            self._strikes.pop(instance_id, None)
            timer = self._down.pop(instance_id, None)
            if timer is not None:
                timer.cancel()
            transport = self._open_transport.get(instance_id)
            if transport is not None:
                loop = asyncio.get_running_loop()
                loop.call_later(LEFT_STREAM_GRACE_SECONDS, self._abandon, transport)
        else:
            try:
                instance = _instance_decoder.decode(event.kv.value)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("ignoring malformed instance record at %r: %s", key, exc)
                return
            if instance.instance_id != instance_id or instance.endpoint != self.endpoint:
                logger.warning("ignoring instance record at %r: it names another instance", key)
                return
            changed = self._instances.get(instance_id) != instance
            if changed:
                self._strikes.pop(instance_id, None)  # a new address deserves a fresh try
            self._instances[instance_id] = instance
            timer = self._down.pop(instance_id, None)
            if timer is not None:  # announced again: back in service
                timer.cancel()
                changed = True
        if changed and notify:
            self._notify()

    def _abandon(self, transport: TransportAddress) -> None:
        """Fail the streams to ``transport`` whose instances have left discovery, once
        ``LEFT_STREAM_GRACE_SECONDS`` have passed and no live instance is served there.

        A worker that leaves on purpose finishes (or cancels) its streams within its drain
        timeout. One whose lease ended with no instance left at its address is dead, hung or
        cut off, and its streams would wait forever on a peer that never answers: they end as
        ``StreamBroken``, which the caller may migrate. A process that still serves an
        instance at that address (it registered again after a lost lease, or serves several)
        keeps its streams: its liveness is the request plane's to judge (heartbeats, stall
        timeouts), not discovery's.
        """
        if any(inst.transport == transport for inst in self._instances.values()):
            return
        gone = [
            iid
            for iid, where in self._open_transport.items()
            if where == transport and iid not in self._instances
        ]
        for instance_id in gone:
            self._open_transport.pop(instance_id, None)
            streams = self._open.pop(instance_id, None)
            if not streams:
                continue
            logger.warning(
                "instance %x of %s left discovery with %d open stream(s); failing them",
                instance_id,
                self.endpoint.path(),
                len(streams),
            )
            for stream in list(streams):
                stream.abort(
                    StreamBroken(
                        f"instance {instance_id:x} of {self.endpoint.path()} left discovery"
                    )
                )

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:
                logger.exception("instance listener of %s raised", self.endpoint.path())

    # -- queries --------------------------------------------------------------------------

    def instance_ids(self) -> list[int]:
        """Live instances not set aside, sorted."""
        return sorted(iid for iid in self._instances if iid not in self._down)

    def announced_ids(self) -> set[int]:
        """Every instance discovery announces, set-aside ones included (membership, not
        reachability: state kept per instance should follow this)."""
        return set(self._instances)

    def instances(self) -> list[Instance]:
        return [self._instances[iid] for iid in self.instance_ids()]

    def get_instance(self, instance_id: int) -> Instance | None:
        return self._instances.get(instance_id)

    async def wait_for_instances(
        self,
        count: int = 1,
        timeout: float | None = None,
    ) -> None:
        """Return once at least ``count`` instances are live; ``TimeoutError`` after
        ``timeout`` seconds, naming the endpoint and how many were seen."""
        try:
            async with asyncio.timeout(timeout):
                while len(self.instance_ids()) < count:
                    await self._changed.wait()
        except TimeoutError:
            raise TimeoutError(
                f"waited {timeout}s for {count} instance(s) of {self.endpoint.path()}, "
                f"saw {len(self.instance_ids())}"
            ) from None

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every change of the instance set."""
        self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(callback)

    def report_instance_down(self, instance_id: int) -> None:
        """Set ``instance_id`` aside: out of ``instance_ids()`` until discovery announces it
        again or ``DOWN_RETRY_SECONDS`` pass, twice as long for each time it was set aside
        since a stream last got an answer from it (at most ``DOWN_RETRY_MAX_SECONDS``)."""
        if instance_id not in self._instances or instance_id in self._down:
            return
        strikes = self._strikes.get(instance_id, 0) + 1
        self._strikes[instance_id] = strikes
        delay = min(DOWN_RETRY_SECONDS * 2 ** min(strikes - 1, 16), DOWN_RETRY_MAX_SECONDS)
        loop = asyncio.get_running_loop()
        self._down[instance_id] = loop.call_later(delay, self._restore, instance_id)
        logger.warning(
            "instance %x of %s set aside for %gs", instance_id, self.endpoint.path(), delay
        )
        self._notify()

    def _restore(self, instance_id: int) -> None:
        if self._down.pop(instance_id, None) is not None and instance_id in self._instances:
            self._notify()

    # -- calls ----------------------------------------------------------------------------

    def stream(self, instance_id: int, payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        """Send ``payload`` to instance ``instance_id``'s handler and iterate its responses.

        ``PeerUnavailable`` (unknown instance, or nothing reached it) sets the instance aside.
        """
        return _InstanceStream(self, instance_id, payload, ctx)

    async def call(
        self, instance_id: int, name: str, payload: bytes, ctx: RequestContext
    ) -> AsyncIterator[bytes]:
        """Call the side handler ``name`` of an instance (see ``ServingInstance.add_handler``)."""
        instance = self.get_instance(instance_id)
        if instance is None:
            raise PeerUnavailable(f"no instance {instance_id:x} of {self.endpoint.path()}")
        client = self.runtime.request_plane_client(instance.transport.kind)
        path = f"{handler_path(self.endpoint, instance_id)}#{name}"
        stream = client.stream(instance.transport, path, payload, ctx)
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def close(self) -> None:
        self.runtime._endpoint_clients.discard(self)
        for timer in self._down.values():
            timer.cancel()
        self._down.clear()
        self._strikes.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
            self._task = None


class _InstanceStream:
    """Iterator over one call; reports the instance down when it cannot be reached, and is
    failed as broken when the instance leaves discovery (see ``EndpointClient._abandon``)."""

    __slots__ = ("__weakref__", "_client", "_ctx", "_inner", "_instance_id", "_payload")

    def __init__(
        self, client: EndpointClient, instance_id: int, payload: bytes, ctx: RequestContext
    ) -> None:
        self._client = client
        self._instance_id = instance_id
        self._payload = payload
        self._ctx = ctx
        self._inner: AsyncIterator[bytes] | None = None

    def __aiter__(self) -> _InstanceStream:
        return self

    async def __anext__(self) -> bytes:
        inner = self._inner
        if inner is None:
            client = self._client
            instance = client.get_instance(self._instance_id)
            if instance is None:
                raise PeerUnavailable(
                    f"no instance {self._instance_id:x} of {client.endpoint.path()}"
                )
            try:
                rp_client = client.runtime.request_plane_client(instance.transport.kind)
            except ConfigError as exc:
                raise PeerUnavailable(f"instance {self._instance_id:x}: {exc}") from exc
            path = handler_path(client.endpoint, self._instance_id)
            inner = self._inner = rp_client.stream(
                instance.transport, path, self._payload, self._ctx
            )
            self._payload = b""
            client._open.setdefault(self._instance_id, weakref.WeakSet()).add(self)
            client._open_transport[self._instance_id] = instance.transport
            try:
                first = await inner.__anext__()
            except PeerUnavailable:
                self._forget()
                client.report_instance_down(self._instance_id)
                raise
            except BaseException:
                self._forget()
                raise
            if client._strikes:
                client._strikes.pop(self._instance_id, None)  # it answered
            return first
        try:
            return await inner.__anext__()
        except BaseException:
            self._forget()
            raise

    def _forget(self) -> None:
        streams = self._client._open.get(self._instance_id)
        if streams is not None:
            streams.discard(self)
            if not streams:
                del self._client._open[self._instance_id]
                self._client._open_transport.pop(self._instance_id, None)

    def abort(self, exc: BaseException) -> None:
        """Fail the stream with ``exc`` (planes whose streams cannot be aborted: no-op)."""
        abort = getattr(self._inner, "abort", None)
        if abort is not None:
            abort(exc)

    async def aclose(self) -> None:
        self._forget()
        aclose = getattr(self._inner, "aclose", None)
        if aclose is not None:
            await aclose()
