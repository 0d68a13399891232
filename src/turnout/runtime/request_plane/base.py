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
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable

from turnout.protocols.model import TransportAddress
from turnout.runtime.context import RequestContext

Handler = Callable[[bytes, RequestContext], AsyncIterator[bytes]]


class RequestPlaneServer(abc.ABC):
    kind: str

    @abc.abstractmethod
    def register(self, endpoint_path: str, handler: Handler) -> None: ...

    @abc.abstractmethod
    async def start(self) -> TransportAddress:
        """Start serving; returns the address to publish in the instance record."""

    @abc.abstractmethod
    async def stop(self, drain_timeout: float = 5.0) -> None:
        """Stop intake, let in-flight streams finish within ``drain_timeout``, then close."""


class RequestPlaneClient(abc.ABC):
    kind: str

    @abc.abstractmethod
    def stream(
        self,
        address: TransportAddress,
        endpoint_path: str,
        payload: bytes,
        ctx: RequestContext,
    ) -> AsyncIterator[bytes]:
        """Send ``payload`` to the handler at ``endpoint_path`` and iterate its responses."""

    @abc.abstractmethod
    async def close(self) -> None: ...
