"""The frame I/O both ends of a ``tcp`` request-plane connection share.

``_Connection`` is the ``asyncio.Protocol`` under ``server._ServerConnection`` and
``client._ClientConnection``: batched writes (one ``write`` per event-loop iteration),
incremental reads, and the close/loss bookkeeping. Kept apart so each end's module holds only
its own side of the exchange.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from turnout.runtime.request_plane.framing import Frame, FrameError, FrameReader, FrameWriter, Kind

logger = logging.getLogger("turnout.runtime")

_DATA = int(Kind.DATA)
_CREDIT = int(Kind.CREDIT)


class _Connection(asyncio.Protocol):
    """Frame I/O over one transport: batched writes, incremental reads."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._writer = FrameWriter()
        self._reader = FrameReader()
        self._flush_scheduled = False
        #: True from close() or connection loss on: frames sent after it are dropped.
        self._closing = False
        self._loop = asyncio.get_running_loop()

    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self._closing

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport: no isinstance check.
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, frame: Frame) -> None:
        if self._closing:
            return
        self._writer.append(frame)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if len(self._writer) and self.transport is not None and not self.closed.done():
            self.transport.write(self._writer.take())

    def close(self) -> None:
        """Flush what is queued, then close (``connection_lost`` follows)."""
        if self.transport is not None and not self.closed.done():
            self._flush()
            self._closing = True
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except FrameError as exc:
            logger.error("dropping tcp connection %s: %s", self._peer(), exc)
            assert self.transport is not None
            self.transport.abort()
            return
        on_frame = self.on_frame
        for frame in frames:
            on_frame(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if not self.closed.done():
            self.closed.set_result(None)
        self.on_lost(exc)

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "?"

    def on_frame(self, frame: Frame) -> None:
        raise NotImplementedError

    def on_lost(self, exc: Exception | None) -> None:
        raise NotImplementedError
