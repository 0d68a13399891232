"""The calling side of the component layer: find an endpoint's instances and call them.

An ``EndpointClient`` (made by ``Endpoint.client`` in ``component``) keeps the instances
discovery announces under ``v1/instances/<endpoint path>/`` and sets aside those that could not
be reached; ``stream`` sends a request to one instance over the request plane its record names.

A set-aside instance comes back only once it proves alive: after the retry delay the client
probes it (a call on the request plane that any live server answers, if only to say it has
no such handler), and an instance that still cannot be reached stays aside, probed again
after twice the delay, until it answers or discovery drops it. A ``kill -9``'d worker is so
neither routed to nor listed in ``/health`` while its lease runs out.

A worker that is frozen (SIGSTOP, a hung host) keeps its TCP connection and its discovery
lease for a while, so neither discovery nor a refused connection says it is gone. Its
request-plane connection going silent past the heartbeat deadline does: the request-plane
client reports the peer ``SILENT`` (``peer_state``), and every instance served there is set
aside at once, for new requests and for migrations alike, for as long as the connection stays
silent; it comes back as soon as the connection answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from turnout.errors import (
    ConfigError,
    PeerUnavailable,
    RemoteError,
    RequestPlaneError,
    StreamBroken,
)
from turnout.protocols.model import INSTANCES_ROOT, EndpointId, Instance, TransportAddress
from turnout.runtime import tracing
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery.base import WatchEvent, WatchEventKind
from turnout.runtime.request_plane.base import PeerState, ResponseStream
from turnout.runtime.serving import handler_path

if TYPE_CHECKING:
    from turnout.runtime.component import DistributedRuntime

logger = logging.getLogger("turnout.runtime")


#: How long an instance reported down stays set aside before it is probed (unless discovery
#: re-announces it); each further failure, or failed probe, with no answer from it in between
#: doubles that, up to the maximum (an address announced in the store that never answers
#: costs a probe a minute, and no request).
DOWN_RETRY_SECONDS = 5.0
DOWN_RETRY_MAX_SECONDS = 60.0
#: How long a probe of a set-aside instance waits for any answer before it counts as failed.
PROBE_TIMEOUT_SECONDS = 5.0
#: The side handler a probe calls: no server serves it, so a live one answers "unknown
#: endpoint" (``RemoteError``) at once, while a dead one cannot be reached at all.
PROBE_HANDLER = "turnout.probe"
#: Pause before re-opening a discovery watch that failed.
WATCH_RETRY_SECONDS = 1.0
#: Streams of an instance that left discovery may run this long (a draining worker's own
#: drain timeout, plus a margin) before they are failed as broken.
LEFT_STREAM_GRACE_SECONDS = 6.0

_instance_decoder = msgspec.json.Decoder(Instance)


def instances_prefix(endpoint: EndpointId) -> str:
    return f"{INSTANCES_ROOT}/{endpoint.path()}/"


class Cancellable(Protocol):
    """A pending set-aside step: a timer (``asyncio.TimerHandle``) or a probe task."""

    def cancel(self) -> object: ...


#: ``call_later(delay, callback)``: the clock set-asides are timed by.
CallLater = Callable[[float, Callable[[], None]], Cancellable]


def _loop_call_later(delay: float, callback: Callable[[], None]) -> Cancellable:
    # In a context of its own: a set-aside's retries and probes belong to no request, though
    # a request's failure may have started them (its log binding would name it on their lines).
    return asyncio.get_running_loop().call_later(delay, callback, context=contextvars.Context())


class EndpointClient:
    """The live instances of one endpoint, kept current by a discovery watch."""

    def __init__(self, runtime: DistributedRuntime, endpoint: EndpointId) -> None:
        self.runtime = runtime
        self.endpoint = endpoint
        self._prefix = instances_prefix(endpoint)
        #: Changed only by ``_apply`` (discovery) — the instances announced in the store.
        self._instances: dict[int, Instance] = {}
        #: Changed by ``report_instance_down``, ``_retry``/``_probed`` and ``_apply``: set
        #: aside ids and their pending step (the timer to the next probe, or the probe).
        self._down: dict[int, Cancellable] = {}
        #: Changed by ``report_instance_down`` and a failed probe (+1), a stream's first answer
        #: and a changed record (cleared): set-asides of each instance since it last answered.
        self._strikes: dict[int, int] = {}
        #: The clock set-asides are timed by (tests give a manual one).
        self.call_later: CallLater = _loop_call_later
        #: ``instance_ids()``, computed once per change of ``_instances`` or ``_down``: routers
        #: read it on every request, and it changes only when membership does.
        self._live: tuple[int, ...] | None = None
        self._listeners: list[Callable[[], None]] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Streams started to each instance and not yet finished (weak: a stream dropped
        #: unfinished goes too): when an instance leaves discovery, they fail at once.
        self._open: dict[int, weakref.WeakSet[_InstanceStream]] = {}
        #: Where each instance in ``_open`` was reached (kept after it leaves discovery).
        self._open_transport: dict[int, TransportAddress] = {}
        #: Addresses whose request-plane connection was reported silent and not heard since
        #: (at most one per connection the process holds): instances there stay set aside.
        self._silent: set[TransportAddress] = set()

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
        if changed:
            self._live = None
            if notify:
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
        self._live = None
        self._changed.set()
        self._changed = asyncio.Event()
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:
                logger.exception("instance listener of %s raised", self.endpoint.path())

    # -- queries --------------------------------------------------------------------------

    def instance_ids(self) -> tuple[int, ...]:
        """Live instances not set aside, sorted. The same tuple object is returned until the
        set changes, so a caller may cache what it derives from it under its identity."""
        live = self._live
        if live is None:
            live = self._live = tuple(
                sorted(iid for iid in self._instances if iid not in self._down)
            )
        return live

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
        again or it answers a probe. The first probe comes ``DOWN_RETRY_SECONDS`` after, twice
        as long for each time it was set aside, or failed a probe, since a stream last got an
        answer from it (at most ``DOWN_RETRY_MAX_SECONDS``)."""
        if instance_id not in self._instances or instance_id in self._down:
            return
        delay = self._strike(instance_id)
        self._down[instance_id] = self.call_later(delay, lambda: self._retry(instance_id))
        logger.warning(
            "instance %x of %s set aside; probing it in %gs",
            instance_id,
            self.endpoint.path(),
            delay,
        )
        self._notify()

    def _strike(self, instance_id: int) -> float:
        """Count one more failure of ``instance_id``; the delay before its next probe."""
        strikes = self._strikes.get(instance_id, 0) + 1
        self._strikes[instance_id] = strikes
        return min(DOWN_RETRY_SECONDS * 2 ** min(strikes - 1, 16), DOWN_RETRY_MAX_SECONDS)

    def _retry(self, instance_id: int) -> None:
        """The retry delay of a set-aside instance ended: probe it (a silent connection is
        waited on instead: it answers or is dropped)."""
        instance = self._instances.get(instance_id)
        if instance is None or instance_id not in self._down:
            self._down.pop(instance_id, None)
            return
        if instance.transport in self._silent:
            self._down[instance_id] = self.call_later(
                DOWN_RETRY_SECONDS, lambda: self._retry(instance_id)
            )
            return
        self._down[instance_id] = asyncio.get_running_loop().create_task(
            self._probe(instance_id), name=f"probe-{instance_id:x}"
        )

    async def _probe(self, instance_id: int) -> None:
        """Call ``PROBE_HANDLER`` on the instance: any answer brings it back, nothing within
        ``PROBE_TIMEOUT_SECONDS`` keeps it aside for a longer delay."""
        alive = False
        reason = ""
        try:
            async with (
                asyncio.timeout(PROBE_TIMEOUT_SECONDS),
                contextlib.aclosing(
                    self.call(instance_id, PROBE_HANDLER, b"", RequestContext())
                ) as answers,
            ):
                async for _ in answers:
                    break
            alive = True
        except RemoteError:
            alive = True  # it answered, if only that it has no such handler
        except (RequestPlaneError, ConfigError, TimeoutError) as exc:
            reason = str(exc) or "no answer"
        except Exception as exc:  # never leave the instance aside with no probe to come
            logger.exception("probe of instance %x failed", instance_id)
            reason = repr(exc)
        self._probed(instance_id, alive, reason)

    def _probed(self, instance_id: int, alive: bool, reason: str) -> None:
        if instance_id not in self._down or instance_id not in self._instances:
            return  # dropped or re-announced while the probe ran
        if alive:
            del self._down[instance_id]
            self._strikes.pop(instance_id, None)
            logger.info("instance %x of %s answers again", instance_id, self.endpoint.path())
            self._notify()
            return
        delay = self._strike(instance_id)
        self._down[instance_id] = self.call_later(delay, lambda: self._retry(instance_id))
        logger.info(
            "instance %x of %s still unreachable (%s); probing it again in %gs",
            instance_id,
            self.endpoint.path(),
            reason,
            delay,
        )

    def peer_state(self, address: TransportAddress, state: PeerState) -> None:
        """What the request plane learned of the peer at ``address`` (see the module
        docstring): ``SILENT`` sets its instances aside at once, ``ANSWERING`` brings them
        back at once, ``GONE`` (its connection dropped) leaves them to the usual retry."""
        here = [iid for iid, inst in self._instances.items() if inst.transport == address]
        if state is PeerState.SILENT:
            if here:  # only this endpoint's peers: the plane reports every peer it talks to
                self._silent.add(address)
            for instance_id in here:
                logger.warning(
                    "instance %x of %s is silent on the request plane (frozen or cut off)",
                    instance_id,
                    self.endpoint.path(),
                )
                self.report_instance_down(instance_id)
            return
        if address not in self._silent:
            return
        self._silent.discard(address)
        if state is not PeerState.ANSWERING:
            return
        back = False
        for instance_id in here:
            self._strikes.pop(instance_id, None)
            timer = self._down.pop(instance_id, None)
            if timer is not None:
                timer.cancel()
                back = True
        if back:
            logger.info("%s instances at %s answer again", self.endpoint.path(), address.address)
            self._notify()

    # -- calls ----------------------------------------------------------------------------

    def stream(self, instance_id: int, payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        """Send ``payload`` to instance ``instance_id``'s handler and iterate its responses.

        ``PeerUnavailable`` (unknown instance, or nothing reached it) sets the instance aside.
        """
        return _InstanceStream(self, instance_id, payload, ctx)

    async def call(
        self, instance_id: int, name: str, payload: bytes, ctx: RequestContext
    ) -> AsyncGenerator[bytes, None]:
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
            await stream.aclose()

    async def close(self) -> None:
        self.runtime._endpoint_clients.discard(self)
        for step in self._down.values():
            step.cancel()
        probes = [step for step in self._down.values() if isinstance(step, asyncio.Task)]
        self._down.clear()
        if probes:
            await asyncio.wait(probes)
        self._live = None
        self._strikes.clear()
        self._silent.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
            self._task = None


class _InstanceStream:
    """Iterator over one call; reports the instance down when it cannot be reached, and is
    failed as broken when the instance leaves discovery (see ``EndpointClient._abandon``).
    A traced request gets an ``attempt`` span per call (``runtime.tracing``)."""

    __slots__ = (
        "__weakref__",
        "_client",
        "_ctx",
        "_inner",
        "_instance_id",
        "_payload",
        "_span",
        "_untold",
    )

    def __init__(
        self, client: EndpointClient, instance_id: int, payload: bytes, ctx: RequestContext
    ) -> None:
        self._client = client
        self._instance_id = instance_id
        self._payload = payload
        self._ctx = ctx
        self._inner: ResponseStream | None = None
        self._span: Any = None
        #: A traced call whose first response is not yet recorded.
        self._untold = False

    def __aiter__(self) -> _InstanceStream:
        return self

    async def __anext__(self) -> bytes:
        inner = self._inner
        if inner is None:
            return await self._open()
        try:
            item = await inner.__anext__()
        except BaseException as exc:
            self._forget()
            self._end(exc)
            raise
        if self._untold:
            self._first_item()
        return item

    async def _open(self) -> bytes:
        client = self._client
        ctx = self._ctx
        if ctx.trace is not None:
            self._span = tracing.start_attempt(ctx, self._instance_id, client.endpoint.path())
            self._untold = True
        instance = client.get_instance(self._instance_id)
        if instance is None:
            exc = PeerUnavailable(f"no instance {self._instance_id:x} of {client.endpoint.path()}")
            self._end(exc)
            raise exc
        try:
            rp_client = client.runtime.request_plane_client(instance.transport.kind)
        except ConfigError as err:
            exc = PeerUnavailable(f"instance {self._instance_id:x}: {err}")
            self._end(exc)
            raise exc from err
        path = handler_path(client.endpoint, self._instance_id)
        inner = self._inner = rp_client.stream(instance.transport, path, self._payload, ctx)
        self._payload = b""
        client._open.setdefault(self._instance_id, weakref.WeakSet()).add(self)
        client._open_transport[self._instance_id] = instance.transport
        try:
            first = await inner.__anext__()
        except PeerUnavailable as exc:
            self._forget()
            self._end(exc)
            client.report_instance_down(self._instance_id)
            raise
        except BaseException as exc:
            self._forget()
            self._end(exc)
            raise
        if client._strikes:
            client._strikes.pop(self._instance_id, None)  # it answered
        if self._untold:
            self._first_item()
        return first

    def _first_item(self) -> None:
        self._untold = False
        self._span.add_event("first_token")
        tracing.add_event(self._ctx, "first_token", {"turnout.instance": f"{self._instance_id:x}"})

    def _end(self, exc: BaseException | None) -> None:
        """End the call's span: a normal end of the stream, or what broke it."""
        span, self._span = self._span, None
        if span is None:
            return
        if isinstance(exc, StopAsyncIteration):
            span.add_event("stream_end")
            exc = None
        elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
            span.set_attribute("turnout.cancelled", True)
            exc = None
        tracing.end_span(span, exc)

    def _forget(self) -> None:
        streams = self._client._open.get(self._instance_id)
        if streams is not None:
            streams.discard(self)
            if not streams:
                del self._client._open[self._instance_id]
                self._client._open_transport.pop(self._instance_id, None)

    def abort(self, exc: BaseException) -> None:
        """Fail the stream with ``exc`` (not opened yet: nothing to fail)."""
        if self._inner is not None:
            self._inner.abort(exc)

    async def aclose(self) -> None:
        self._forget()
        if self._span is not None:  # closed by its reader: done with it, or gone
            if self._ctx.is_cancelled:
                self._span.set_attribute("turnout.cancelled", True)
            else:
                self._span.add_event("stream_end")
            self._end(None)
        if self._inner is not None:
            await self._inner.aclose()
