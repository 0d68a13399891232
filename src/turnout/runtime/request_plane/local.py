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
import collections
import contextlib
import logging
import uuid

from turnout.errors import PeerUnavailable, RemoteError, StreamBroken
from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext
from turnout.runtime.request_plane.base import (
    Handler,
    RequestPlaneClient,
    RequestPlaneServer,
    as_bytes,
    drain_tasks,
)
from turnout.runtime.request_plane.framing import WINDOW

logger = logging.getLogger("turnout.runtime")

#: Live local servers by address (one process).
_SERVERS: dict[str, LocalServer] = {}

#: Terminal marker of a stream that ended normally.
_END = StopAsyncIteration


class _Pipe:
    """One stream's buffer between the handler task (producer) and the client (consumer).

    Invariant: ``len(items) <= WINDOW``; the producer waits on ``space`` when it is full and
    the consumer on ``ready`` when it is empty. ``terminal`` (set once, by the producer side)
    is what the consumer raises after the last item: ``_END``, or an error.
    """

    __slots__ = ("ctx", "items", "path", "ready", "space", "task", "terminal")

    def __init__(self, path: str, ctx: RequestContext) -> None:
        self.path = path
        self.ctx = ctx
        self.items: collections.deque[bytes] = collections.deque()
        self.terminal: type[StopAsyncIteration] | BaseException | None = None
        self.ready: asyncio.Future[None] | None = None
        self.space: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    def finish(self, terminal: type[StopAsyncIteration] | BaseException) -> None:
        if self.terminal is None:
            self.terminal = terminal
            self._wake_consumer()

    def _wake_consumer(self) -> None:
        ready = self.ready
        if ready is not None and not ready.done():
            ready.set_result(None)

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
        pipe = _Pipe(path, RequestContext(ctx.request_id))
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
        stream = handler(payload, pipe.ctx)
        try:
            async for item in stream:
                if item.__class__ is not bytes:
                    item = as_bytes(item)
                while len(items) >= WINDOW:
                    pipe.space = asyncio.get_running_loop().create_future()
                    await pipe.space
                items.append(item)
                pipe._wake_consumer()
            pipe.finish(_END)
        except Exception as exc:
            logger.warning("handler for %s raised: %r", pipe.path, exc)
            pipe.finish(RemoteError(f"{type(exc).__name__}: {exc}"))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


class _LocalStream:
    """The client's iterator over one local stream; opens the stream on first ``__anext__``."""

    __slots__ = ("_address", "_client", "_ctx", "_path", "_payload", "_pipe")

    def __init__(
        self, client: LocalClient, address: str, path: str, payload: bytes, ctx: RequestContext
    ) -> None:
        self._client = client
        self._address = address
        self._path = path
        self._payload = payload
        self._ctx = ctx
        self._pipe: _Pipe | None = None

    def __aiter__(self) -> _LocalStream:
        return self

    async def __anext__(self) -> bytes:
        pipe = self._pipe
        if pipe is None:
            if self._client._closed:
                raise PeerUnavailable("local request plane client is closed")
            server = _SERVERS.get(self._address)
            if server is None:
                raise PeerUnavailable(f"no local peer at address {self._address}")
            pipe = self._pipe = server._open(self._address, self._path, self._payload, self._ctx)
            self._client._pipes.add(pipe)
        items = pipe.items
        while not items:
            terminal = pipe.terminal
            if terminal is not None:
                self._client._pipes.discard(pipe)
                pipe.terminal = _END  # an error is raised once; afterwards the stream is over
                raise terminal
            pipe.ready = asyncio.get_running_loop().create_future()
            try:
                await pipe.ready
            except asyncio.CancelledError:
                self._cancel()
                raise
            finally:
                pipe.ready = None
        item = items.popleft()
        space = pipe.space
        if space is not None and not space.done():
            space.set_result(None)
        return item

    def _cancel(self) -> None:
        pipe = self._pipe
        if pipe is not None:
            self._client._pipes.discard(pipe)
            pipe.cancel()

    async def aclose(self) -> None:
        self._cancel()

    def __del__(self) -> None:
        pipe = self._pipe
        if pipe is not None and pipe.task is not None and not pipe.task.done():
            # Dropped without aclose(): let the handler go. Task.cancel only schedules.
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                pipe.cancel()


class LocalClient(RequestPlaneClient):
    kind = "local"

    def __init__(self) -> None:
        self._pipes: set[_Pipe] = set()
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
