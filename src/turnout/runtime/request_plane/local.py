"""The ``local`` request plane: client and server in one process, no sockets.

It keeps the tcp plane's semantics so code tested on it behaves the same over the network:
the handler runs in its own task, at most ``WINDOW`` items ahead of the consumer; a handler
error is a ``RemoteError``; closing the client's iterator cancels the handler task and its
context; stopping the server drains, then cancels (``StreamBroken`` for the client); an
address nobody serves is ``PeerUnavailable``. Items pass by reference, never copied.

Servers find each other through a module-level registry keyed by a unique address.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import weakref
from collections.abc import Callable

from turnout.errors import PeerUnavailable, RemoteError, StreamBroken
from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.log_context import bind_request
from turnout.runtime.request_plane.base import (
    Handler,
    RequestPlaneClient,
    RequestPlaneServer,
    as_bytes,
    drain_tasks,
)
from turnout.runtime.request_plane.credited_stream import CreditedStream, Inbox
from turnout.runtime.request_plane.framing import WINDOW

logger = logging.getLogger("turnout.runtime")

#: Live local servers by address (one process).
_SERVERS: dict[str, LocalServer] = {}

#: Terminal marker of a stream that ended normally.
_END = StopAsyncIteration


class _Pipe(Inbox):
    """One stream's buffer between the handler task (producer) and the client (consumer).

    Invariant: ``len(items) <= WINDOW``; the producer waits on ``space`` when it is full and
    the consumer on ``waiter`` when it is empty. ``terminal`` is set once, by the producer side
    or by a cancel.
    """

    __slots__ = ("ctx", "path", "space", "task")

    def __init__(self, address: str, path: str, ctx: RequestContext) -> None:
        super().__init__(f"local peer {address}")
        self.path = path
        self.ctx = ctx
        self.space: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    def make_room(self) -> None:
        """The consumer took an item: wake a producer waiting for space."""
        space = self.space
        if space is not None and not space.done():
            space.set_result(None)

    def cancel(self) -> None:
        """The consumer is gone: cancel the handler and its context."""
        if self.terminal is None:
            self.terminal = _END
        self.ctx.cancel()
        if self.task is not None:
            self.task.cancel()


class LocalServer(RequestPlaneServer):
    kind = "local"

    def __init__(self) -> None:
        super().__init__()
        self._inflight: set[_Pipe] = set()
        self._address: str | None = None

    async def start(self) -> TransportAddress:
        if self._address is None:
            self._address = uuid.uuid4().hex
            _SERVERS[self._address] = self
            self._accepting = True
        return TransportAddress(kind=self.kind, address=self._address)

    async def stop(self, drain_timeout: float = 5.0) -> None:
        self._accepting = False
        if self._address is not None:
            _SERVERS.pop(self._address, None)
        await drain_tasks([p.task for p in self._inflight if p.task], drain_timeout)

    def _open(self, address: str, path: str, payload: bytes, ctx: RequestContext) -> _Pipe:
        if not self._takes(path):
            raise PeerUnavailable(f"local peer {address} no longer takes requests for {path!r}")
        handler = self._handlers.get(path)
        if handler is None:
            raise RemoteError(f"unknown endpoint {path!r} at local peer {address}")
        pipe = _Pipe(address, path, RequestContext(ctx.request_id, ctx.traceparent))
        self._inflight.add(pipe)
        pipe.task = asyncio.get_running_loop().create_task(self._run(pipe, handler, payload))
        pipe.task.add_done_callback(lambda _: self._on_done(pipe))
        return pipe

    def _on_done(self, pipe: _Pipe) -> None:
        """Bookkeeping when a handler task ends, however it ends: even a task cancelled
        before its first step, whose ``finally`` never runs."""
        self._inflight.discard(pipe)
        if pipe.task is not None and pipe.task.cancelled():
            # Client gone (terminal already set: nothing changes) or server stop past its
            # drain: the client sees a broken stream, as if the process had died.
            pipe.ctx.cancel()
            pipe.finish(StreamBroken(f"local peer stopped while streaming {pipe.path!r}"))

    async def _run(self, pipe: _Pipe, handler: Handler, payload: bytes) -> None:
        items = pipe.items
        bind_request(pipe.ctx)
        stream = handler(payload, pipe.ctx)
        try:
            async for item in stream:
                if item.__class__ is not bytes:
                    item = as_bytes(item)
                while len(items) >= WINDOW:
                    pipe.space = asyncio.get_running_loop().create_future()
                    await pipe.space
                items.append(item)
                pipe.wake()
            pipe.finish(_END)
        except Exception as exc:
            logger.warning("handler for %s raised: %r", pipe.path, exc)
            pipe.finish(RemoteError(f"{type(exc).__name__}: {exc}"))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


class _LocalStream(CreditedStream[_Pipe]):
    """The client's iterator over one local stream (see ``credited_stream``): credit is the
    consumer taking an item, which makes room for the producer at once."""

    __slots__ = ("_address", "_client", "_ctx", "_path", "_payload")

    credit_batch = 1

    def __init__(
        self, client: LocalClient, address: str, path: str, payload: bytes, ctx: RequestContext
    ) -> None:
        super().__init__()
        self._client = client
        self._address = address
        self._path = path
        self._payload = payload
        self._ctx = ctx

    async def _open(self) -> _Pipe:
        if self._client._closed:
            raise PeerUnavailable("local request plane client is closed")
        server = _SERVERS.get(self._address)
        if server is None:
            raise PeerUnavailable(f"no local peer at address {self._address}")
        pipe = server._open(self._address, self._path, self._payload, self._ctx)
        self._client._pipes.add(pipe)
        return pipe

    def _return_credit(self, delta: int, total: int) -> None:
        assert self._inbox is not None
        self._inbox.make_room()

    def _canceller(self) -> Callable[[], None]:
        assert self._inbox is not None
        return self._inbox.cancel


class LocalClient(RequestPlaneClient):
    kind = "local"

    def __init__(self) -> None:
        super().__init__()
        #: The pipes of streams still referenced (by their iterator or their running handler).
        self._pipes: weakref.WeakSet[_Pipe] = weakref.WeakSet()
        self._closed = False

    def stream(
        self,
        address: TransportAddress,
        endpoint_path: str,
        payload: bytes,
        ctx: RequestContext,
    ) -> _LocalStream:
        if address.kind != self.kind:
            raise PeerUnavailable(f"local client cannot reach a {address.kind!r} address")
        return _LocalStream(self, address.address, endpoint_path, payload, ctx)

    async def close(self) -> None:
        self._closed = True
        pipes = list(self._pipes)
        self._pipes.clear()
        tasks = [p.task for p in pipes if p.task is not None and not p.task.done()]
        for pipe in pipes:
            pipe.cancel()
        if tasks:
            await asyncio.wait(tasks)
