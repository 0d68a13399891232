"""The frame I/O both ends of a ``tcp`` request-plane connection share.

``_Connection`` is the ``asyncio.Protocol`` under ``server._ServerConnection`` and
``client._ClientConnection``: batched writes (one ``write`` per event-loop iteration),
incremental reads, and the close/loss bookkeeping. Kept apart so each end's module holds only
its own side of the exchange.

Liveness: every connection has TCP keepalive on, and a TCP user timeout of the same length for
data left unacknowledged (a peer host that vanished is noticed by the kernel within
``KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_COUNT`` seconds, idle or not), and each end
runs the same periodic timer (one per connection, not one per stream, ``_tick``): on a
connection with open streams, it sends a HEARTBEAT frame when the connection wrote nothing for
a heartbeat interval, and drops the connection when it heard nothing (no frame at all) for the
idle timeout. On the client that fails its streams (``StreamBroken``, or ``PeerUnavailable``
before their ACK); on the server it cancels their handlers. So a frozen peer process, whose
kernel still acknowledges TCP, is noticed by either end. The hot path pays one attribute write
per read and per write batch.

Size: each end reads with a ``FrameReader`` bounded by ``max_frame_bytes``; a peer announcing a
larger frame (a client's request, a server's reply alike) is dropped on reading the header,
with one warning naming it and the size, before a byte of that frame is buffered.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from turnout.runtime.request_plane.framing import (
    Frame,
    FrameError,
    FrameReader,
    FrameTooLarge,
    FrameWriter,
    Kind,
)

logger = logging.getLogger("turnout.runtime")

_DATA = int(Kind.DATA)
_CREDIT = int(Kind.CREDIT)
_HEARTBEAT = int(Kind.HEARTBEAT)

#: Seconds a connection with open streams may stay silent before its end sends a HEARTBEAT.
HEARTBEAT_INTERVAL = 1.0
#: Seconds a connection with open streams may hear nothing (no frame, no heartbeat) before it
#: is dropped: ten heartbeat intervals, so a peer alive but busy is never taken for dead.
IDLE_TIMEOUT = 10.0

#: TCP keepalive: seconds idle before the first probe, between probes, probes before the
#: kernel gives up on the peer.
KEEPALIVE_IDLE = 10
KEEPALIVE_INTERVAL = 5
KEEPALIVE_COUNT = 3


def set_keepalive(sock: socket.socket) -> None:
    """Turn on TCP keepalive with turnout's timings (where the platform has the knobs)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        # Keepalive probes only go out on an idle connection; one that keeps sending
        # (heartbeats to a peer host that vanished) is bounded by this instead, in ms.
        ("TCP_USER_TIMEOUT", 1000 * (KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_COUNT)),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class _Connection(asyncio.Protocol):
    """Frame I/O over one transport: batched writes, incremental reads, and the liveness timer
    both ends share (heartbeats out, silence in; see the module docstring).

    ``heartbeat_interval`` (0: no heartbeats) and ``idle_timeout`` (0: silence is never
    judged) are in seconds. A subclass says whether it has open streams (``has_streams``),
    and may watch the silence as it grows (``on_silence``)."""

    def __init__(
        self, max_frame_bytes: int, heartbeat_interval: float, idle_timeout: float
    ) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._writer = FrameWriter()
        self._reader = FrameReader(max_frame_bytes)
        self._flush_scheduled = False
        #: True from close() or connection loss on: frames sent after it are dropped.
        self._closing = False
        self._loop = asyncio.get_running_loop()
        #: Set on every read / every write batch; cleared by the ends' liveness timers.
        self._heard = False
        self._wrote = False
        self.heartbeat_interval = heartbeat_interval
        self.idle_timeout = idle_timeout
        #: The timer's period: the heartbeat interval, or less when silence must be judged
        #: sooner (half the idle timeout).
        periods = [p for p in (heartbeat_interval, idle_timeout / 2) if p > 0]
        self._period = min(periods) if periods else 0.0
        #: Seconds the connection has heard nothing while it had open streams (counted in
        #: whole periods by the timer).
        self.silent_for = 0.0
        self._timer: asyncio.TimerHandle | None = None
        #: Why the connection was dropped by this end (names the silence), for the errors.
        self._lost_reason = ""

    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self._closing

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport: no isinstance check.
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_keepalive(sock)
        if self._period > 0:
            self._timer = self._loop.call_later(self._period, self._tick)

    def _tick(self) -> None:
        """Every period: a HEARTBEAT if streams are open and nothing was written since the
        last tick; the silence counted on, and the connection dropped once it heard nothing
        for ``idle_timeout`` with streams open."""
        if self._closing:
            return
        busy = self.has_streams()
        if busy and not self._wrote and self.heartbeat_interval > 0:
            self.send(Frame(_HEARTBEAT, 0))
        self._wrote = False
        heard = self._heard
        self._heard = False
        if busy and not heard:
            self.silent_for += self._period
            if self.idle_timeout > 0 and self.silent_for >= self.idle_timeout:
                self._lose(f"heard nothing for {self.idle_timeout:g}s (peer frozen or cut off)")
                return
        else:
            self.silent_for = 0.0
        self.on_silence(self.silent_for, heard)
        if self._closing:
            return
        self._timer = self._loop.call_later(self._period, self._tick)

    def restart_silence(self) -> None:
        """Count the silence from now (the first stream of an idle connection opens)."""
        self.silent_for = 0.0
        self._heard = True

    def _lose(self, reason: str) -> None:
        """Drop the connection for ``reason`` (logged, and named in the streams' errors)."""
        self._lost_reason = reason
        logger.warning("tcp request plane: peer %s: %s; dropping the connection", self._peer(),
                       reason)  # fmt: skip
        self._drop()

    def has_streams(self) -> bool:
        raise NotImplementedError

    def on_silence(self, silent_for: float, heard: bool) -> None:
        """After each tick: the seconds heard nothing while streams were open, and whether
        anything was heard since the last tick."""

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
            self._wrote = True
            self.transport.write(self._writer.take())

    def close(self) -> None:
        """Flush what is queued, then close (``connection_lost`` follows)."""
        if self.transport is not None and not self.closed.done():
            self._flush()
            self._closing = True
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        self._heard = True
        try:
            frames = self._reader.feed(data)
        except FrameTooLarge as exc:
            logger.warning(
                "tcp request plane: peer %s announced a frame of %d bytes, over the limit of "
                "%d (--max-frame-bytes); dropping the connection",
                self._peer(), exc.size, exc.limit,
            )  # fmt: skip
            self._drop()
            return
        except FrameError as exc:
            logger.error("dropping tcp connection %s: %s", self._peer(), exc)
            self._drop()
            return
        on_frame = self.on_frame
        for frame in frames:
            on_frame(frame)

    def _drop(self) -> None:
        """Abort the connection: nothing more is read from it (buffers are freed)."""
        self._closing = True
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
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
