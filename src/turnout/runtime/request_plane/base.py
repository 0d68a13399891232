"""The request plane: send one request to one instance, stream its responses back, cancel.

A worker registers handlers by endpoint path on a ``RequestPlaneServer``; the frontend sends
through a ``RequestPlaneClient`` to the ``TransportAddress`` the instance published.

Contract:

* A handler is ``async def handler(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]``.
  Each yielded item reaches the client as one item, in order.
* Cancellation travels both ways: the client closing its iterator (``aclose()`` or the task
  being cancelled) cancels ``ctx`` on the server and the handler's iteration; a handler
  that raises ends the client's stream with ``RemoteError`` carrying the message.
* Errors on the client side: ``PeerUnavailable`` when the request could not be delivered
  (nothing ran; safe to retry elsewhere), ``StreamBroken`` when the peer vanished after the
  request was delivered, ``RemoteError`` when the handler failed.
* Back-pressure: a slow client consumer slows the handler (bounded buffering per stream);
  it never grows memory without bound.
* Peer liveness: a client that judges its peers' silence (``tcp``, ``nats``) tells its peer
  listeners (``add_peer_listener``) when a peer went silent past its heartbeat deadline, when
  it answers again, and when nothing more can be heard of it (its connection or its last
  stream is gone), so that callers stop choosing a frozen instance at once rather than after
  a stream to it times out.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext

Handler = Callable[[bytes, RequestContext], AsyncIterator[bytes]]

logger = logging.getLogger("turnout.runtime")


class PeerState(enum.Enum):
    """What a client learned of a peer's liveness (see ``RequestPlaneClient.add_peer_listener``)."""

    #: Heard nothing past the heartbeat deadline while streams were open: frozen or cut off.
    SILENT = "silent"
    #: A silent peer was heard again.
    ANSWERING = "answering"
    #: The connection to a silent peer was dropped (``nats``: its last stream ended); nothing
    #: more is known of it.
    GONE = "gone"


#: Called with the peer's address and what was learned; must not raise or block.
PeerListener = Callable[[TransportAddress, PeerState], None]


class InflightStream(Protocol):
    """What a server keeps of each stream it runs: its path and its handler task."""

    path: str
    task: asyncio.Task[None] | None


class RequestPlaneServer(abc.ABC):
    """The handler table and drain logic every transport shares; a transport adds I/O.

    Transports keep ``_accepting`` (false before ``start`` and after ``stop``) and add every
    stream they run to ``_inflight`` (removing it when its task ends).
    """

    kind: str

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        #: Paths unregistered while the server runs: refused as PeerUnavailable, not unknown.
        self._retired: set[str] = set()
        self._inflight: set[Any] = set()
        self._accepting = False

    def register(self, endpoint_path: str, handler: Handler) -> None:
        self._handlers[endpoint_path] = handler
        self._retired.discard(endpoint_path)

    def unregister(self, endpoint_path: str) -> None:
        """Stop taking requests for ``endpoint_path``: new ones are refused as ``PeerUnavailable``
        (the instance is leaving; retry elsewhere). Streams in flight go on; see ``drain``."""
        if self._handlers.pop(endpoint_path, None) is not None:
            self._retired.add(endpoint_path)

    def _takes(self, endpoint_path: str) -> bool:
        """Whether a new request for ``endpoint_path`` may start (else: refuse it)."""
        return self._accepting and endpoint_path not in self._retired

    async def drain(self, endpoint_path: str, drain_timeout: float = 5.0) -> None:
        """Wait up to ``drain_timeout`` seconds for the in-flight streams of ``endpoint_path``
        to finish, then cancel the rest (their clients see ``StreamBroken``)."""
        streams: set[InflightStream] = self._inflight
        tasks = [s.task for s in streams if s.path == endpoint_path and s.task]
        await drain_tasks(tasks, drain_timeout)

    @abc.abstractmethod
    async def start(self) -> TransportAddress:
        """Start serving; returns the address to publish in the instance record."""

    @abc.abstractmethod
    async def stop(self, drain_timeout: float = 5.0) -> None:
        """Stop intake, let in-flight streams finish within ``drain_timeout``, then close."""


class ResponseStream(Protocol):
    """What ``RequestPlaneClient.stream`` returns: the response items, and the ways to end
    the stream early (every plane's ``CreditedStream``)."""

    def __aiter__(self) -> ResponseStream: ...

    async def __anext__(self) -> bytes: ...

    async def aclose(self) -> None:
        """Stop the stream: the handler is cancelled; later ``__anext__`` ends it."""

    def abort(self, exc: BaseException) -> None:
        """Fail the stream with ``exc`` at once (its peer is known to be gone)."""


class RequestPlaneClient(abc.ABC):
    kind: str

    def __init__(self) -> None:
        self._peer_listeners: list[PeerListener] = []
        #: The peers this client judged silent (planes that judge silence feed it).
        self.silent_peers = SilentPeers(self)

    def add_peer_listener(self, listener: PeerListener) -> None:
        """Call ``listener(address, state)`` whenever this client learns a peer went silent,
        answers again, or is gone (see ``PeerState``)."""
        self._peer_listeners.append(listener)

    def report_peer(self, address: TransportAddress, state: PeerState) -> None:
        """Tell the peer listeners (a failing listener is logged, the others still hear)."""
        for listener in list(self._peer_listeners):
            try:
                listener(address, state)
            except Exception:
                logger.exception("peer listener failed on %s %s", address.address, state.value)

    @abc.abstractmethod
    def stream(
        self,
        address: TransportAddress,
        endpoint_path: str,
        payload: bytes,
        ctx: RequestContext,
    ) -> ResponseStream:
        """Send ``payload`` to the handler at ``endpoint_path`` and iterate its responses."""

    @abc.abstractmethod
    async def close(self) -> None: ...


async def drain_tasks(tasks: list[asyncio.Task[None]], drain_timeout: float) -> None:
    """Let ``tasks`` finish within ``drain_timeout`` seconds, then cancel the rest and wait for them
    (the drain step shared by the servers)."""
    if not tasks:
        return
    if drain_timeout > 0:
        _, pending = await asyncio.wait(tasks, timeout=drain_timeout)
    else:
        pending = {t for t in tasks if not t.done()}
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)


def as_bytes(item: object) -> bytes:
    """A handler's item as ``bytes`` (bytearray and memoryview are copied); anything else is
    the handler's bug, raised as ``TypeError`` so the client gets a ``RemoteError`` naming it
    (never a frame the peer cannot decode, which would break every stream on the connection).
    """
    if isinstance(item, bytearray | memoryview):
        return bytes(item)
    raise TypeError(f"handlers must yield bytes, got {type(item).__name__}")


class SilentPeers:
    """The peers of one client reported ``SILENT`` and not heard since, and the reports that
    follow, shared by the planes that judge silence (``tcp`` per connection, ``nats`` per
    server): a transport says how long a peer has been silent (``observe``), that it heard
    from it (``heard``) and that nothing more can be heard of it (``gone``). At most one entry
    per peer the client has streams to."""

    __slots__ = ("_client", "_silent", "deadline")

    def __init__(self, client: RequestPlaneClient, deadline: float = 0.0) -> None:
        self._client = client
        #: Seconds of silence, with streams open, that make a peer ``SILENT`` (0: never).
        self.deadline = deadline
        self._silent: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._silent)

    def __contains__(self, peer: str) -> bool:
        return peer in self._silent

    def peers(self) -> list[str]:
        return list(self._silent)

    def observe(self, peer: str, silent_for: float) -> None:
        """``peer`` has been silent for ``silent_for`` seconds with streams open."""
        if self.deadline > 0 and silent_for >= self.deadline and peer not in self._silent:
            self._silent.add(peer)
            logger.warning("%s peer %s: silent for %gs with streams open; reporting it",
                           self._client.kind, peer, silent_for)  # fmt: skip
            self._report(peer, PeerState.SILENT)

    def heard(self, peer: str) -> None:
        """Something arrived from ``peer``."""
        if peer in self._silent:
            self._silent.discard(peer)
            logger.info("%s peer %s answers again", self._client.kind, peer)
            self._report(peer, PeerState.ANSWERING)

    def gone(self, peer: str) -> None:
        """Nothing more can be heard of ``peer`` (its connection, or its last stream, ended)."""
        if peer in self._silent:
            self._silent.discard(peer)
            self._report(peer, PeerState.GONE)

    def _report(self, peer: str, state: PeerState) -> None:
        self._client.report_peer(TransportAddress(kind=self._client.kind, address=peer), state)
