"""The client end of one response stream, shared by every request plane.

A caller iterates a ``CreditedStream``; what the transport receives for it lands in the
stream's ``Inbox``. The bookkeeping is the same on every plane and lives here:

* **Credits.** A handler runs at most ``WINDOW`` items ahead of its consumer: the consumer
  returns credit as it takes items, every ``credit_batch`` of them (``_return_credit``). How
  credit travels is the transport's (a CREDIT frame with the count, a cumulative count, or
  waking the producer in-process).
* **Buffering bound.** Since a server may send only what it was credited, an inbox never holds
  more than ``WINDOW`` items; a peer that sends more breaks the protocol, and its stream ends
  (``Inbox.deliver`` says so) rather than letting it grow the client's memory.
* **Errors.** A stream ends once, with ``StopAsyncIteration`` or an error raised to the
  caller once: END, ERROR (``RemoteError``), REJECT (``PeerUnavailable``: nothing ran, retry
  elsewhere), ABORT (``StreamBroken``), and a lost peer: ``PeerUnavailable`` before the
  server acknowledged the request, ``StreamBroken`` after (``Inbox.lost``).
* **Cancel and close.** The caller cancelling its task, ``aclose()``, ``abort(exc)`` (the peer
  is known to be gone) or dropping the iterator unfinished tells the peer to stop (the
  transport's ``_canceller``), at the next loop iteration in the last case, never from inside
  ``__del__``.
* **Deadlines.** A wait for an item is bounded by the transport's liveness checks (heartbeats
  and idle timeouts), which end a silent stream through ``Inbox.lost``; no wait is unbounded.

A transport supplies its wire specifics: ``_open`` (send the request, return the inbox),
``_return_credit`` and ``_canceller``.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
from collections.abc import Callable
from typing import ClassVar, Generic, TypeVar

from turnout.errors import PeerUnavailable, RemoteError, StreamBroken
from turnout.runtime.request_plane.framing import CREDIT_BATCH, WINDOW, Kind

#: What a stream raises when it ends: ``StopAsyncIteration`` itself, or an error.
Terminal = type[StopAsyncIteration] | BaseException

_END = int(Kind.END)
_ERROR = int(Kind.ERROR)
_REJECT = int(Kind.REJECT)


class Inbox:
    """What reaches one client stream: items in order, then one ``terminal``.

    ``terminal`` is set once, by the transport (a closing frame, a lost peer) or by the
    consumer (cancel). ``acked`` says the server took the request (from then on a loss is
    ``StreamBroken``). ``peer`` names the peer in error messages (``"tcp peer host:port"``).
    """

    __slots__ = ("__weakref__", "acked", "items", "peer", "terminal", "waiter")

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.items: collections.deque[bytes] = collections.deque()
        self.acked = False
        self.terminal: Terminal | None = None
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def deliver(self, data: bytes | list[bytes]) -> bool:
        """Queue one item or a batch for the consumer; ``False`` when the peer sent past its
        credit window (the caller ends the stream with ``lost``)."""
        items = self.items
        if isinstance(data, bytes):
            items.append(data)
        else:
            items.extend(data)
        if len(items) > WINDOW:
            items.clear()
            return False
        self.wake()
        return True

    def finish(self, terminal: Terminal) -> None:
        if self.terminal is None:
            self.terminal = terminal
            self.wake()

    def lost(self, why: str) -> BaseException:
        """The error of a stream whose peer was lost: ``StreamBroken`` once the request was
        acknowledged (the handler ran), ``PeerUnavailable`` before (safe to send elsewhere)."""
        if self.acked:
            return StreamBroken(f"{self.peer}: {why}")
        return PeerUnavailable(f"{self.peer}: {why}")

    def end(self, kind: int, text: str) -> None:
        """End the stream as the closing frame ``kind`` (END, ERROR, REJECT or ABORT) says."""
        if kind == _END:
            self.finish(StopAsyncIteration)
        elif kind == _ERROR:
            self.finish(RemoteError(text))
        elif kind == _REJECT:
            self.finish(PeerUnavailable(f"{self.peer}: {text}"))
        else:
            self.finish(StreamBroken(f"{self.peer} aborted the stream"))


OVERRUN = "sent more items than it was credited (not a turnout request plane, or a bug)"

InboxT = TypeVar("InboxT", bound=Inbox)


class CreditedStream(abc.ABC, Generic[InboxT]):
    """The caller's iterator over one stream; the request goes out on the first ``__anext__``
    (so a stream never iterated costs nothing). See the module docstring."""

    __slots__ = ("_consumed", "_credited", "_inbox", "_loop")

    #: Items consumed between two returns of credit.
    credit_batch: ClassVar[int] = CREDIT_BATCH

    def __init__(self) -> None:
        self._inbox: InboxT | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Items taken by the consumer, and how many of them were credited back.
        self._consumed = 0
        self._credited = 0

    @abc.abstractmethod
    async def _open(self) -> InboxT:
        """Send the request; the inbox its replies land in. Raises ``PeerUnavailable`` when
        it cannot be sent (nothing ran)."""

    @abc.abstractmethod
    def _return_credit(self, delta: int, total: int) -> None:
        """Let the handler run ``delta`` items further (``total`` consumed so far)."""

    @abc.abstractmethod
    def _canceller(self) -> Callable[[], None]:
        """A callable that tells the peer to stop this stream; it must not hold the stream
        (``__del__`` schedules it)."""

    def __aiter__(self) -> CreditedStream[InboxT]:
        return self

    async def __anext__(self) -> bytes:
        inbox = self._inbox
        if inbox is None:
            self._loop = asyncio.get_running_loop()
            inbox = self._inbox = await self._open()
        items = inbox.items
        while not items:
            terminal = inbox.terminal
            if terminal is not None:
                inbox.terminal = StopAsyncIteration  # an error is raised once
                raise terminal
            loop = self._loop
            assert loop is not None  # set when the stream opened
            waiter = inbox.waiter = loop.create_future()
            try:
                await waiter  # bounded: the transport's liveness check ends a silent stream
            except asyncio.CancelledError:
                self._cancel()
                raise
            finally:
                inbox.waiter = None
        consumed = self._consumed + 1
        self._consumed = consumed
        if consumed - self._credited >= self.credit_batch and inbox.terminal is None:
            self._return_credit(consumed - self._credited, consumed)
            self._credited = consumed
        return items.popleft()

    @property
    def consumed(self) -> int:
        """Items the consumer has taken so far."""
        return self._consumed

    def _cancel(self) -> None:
        inbox = self._inbox
        if inbox is not None and inbox.terminal is None:
            inbox.terminal = StopAsyncIteration
            self._canceller()()

    async def aclose(self) -> None:
        self._cancel()

    def abort(self, exc: BaseException) -> None:
        """Fail the stream with ``exc`` at once (its peer is known to be gone, e.g. its
        instance left discovery, though no frame has said so yet) and tell the peer to stop,
        should it hear. A pending ``__anext__`` raises ``exc``."""
        inbox = self._inbox
        if inbox is not None and inbox.terminal is None:
            inbox.finish(exc)
            self._canceller()()

    def __del__(self) -> None:
        inbox = self._inbox
        loop = self._loop
        if inbox is not None and inbox.terminal is None and loop is not None:
            # Dropped without aclose(): cancel at the next loop iteration (not from inside
            # __del__, which may run in the middle of a frame being written).
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon(self._canceller())
