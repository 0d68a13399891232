"""Mutual TLS on the ``tcp`` request plane: the server's handshake gate and its refusal log.

With plane credentials (``PlaneTls``), a server accepts each TCP connection itself
(``TlsAcceptor``) and hands the socket to ``loop.connect_accepted_socket`` with the server
context, which requires a client certificate the deployment CA signed. The request-plane
protocol is connected only when that handshake succeeds, and every byte it ever reads has
come through TLS from that peer: a raw TCP client, a client without a certificate, or one
whose certificate another CA signed is refused before a frame of it is parsed, so no handler
(``generate``, ``artifact``, anything) ever runs for it.

Why not ``create_server(ssl=...)``: asyncio and uvloop then drop a failed handshake silently
(a debug line in debug mode only), and a refused peer must leave a trace.
``connect_accepted_socket`` raises the failure to the acceptor instead, which logs it
(``RefusalLog``: one warning line per peer host per minute, a bounded table, and counters, so
a flood of bad connections cannot flood the logs). (``start_tls`` on a plain server's
transport is no way either: uvloop starts reading after ``connection_made``, so the first
TLS bytes could reach the plain protocol.)

Handshakes are bounded in time (``TLS_HANDSHAKE_TIMEOUT``) and in number at once
(``MAX_PENDING_HANDSHAKES``; past it a connection is aborted as it is accepted, and counted).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections import Counter
from collections.abc import Callable

logger = logging.getLogger("turnout.runtime")

#: Seconds a peer may take to complete the TLS handshake, either end.
TLS_HANDSHAKE_TIMEOUT = 5.0
#: TLS handshakes one server runs at once; a connection accepted past it is aborted at once.
MAX_PENDING_HANDSHAKES = 256
#: Seconds between two refusal lines about the same peer host.
REFUSAL_LOG_INTERVAL = 60.0
#: Peer hosts whose last refusal line is remembered (older ones are forgotten first).
REFUSAL_LOG_PEERS = 1024
#: Refusal lines written per interval, all peers together (many addresses flooding at once).
REFUSAL_LOG_LINES = 30
#: Connections waiting to be accepted (the listen backlog, as asyncio's default).
BACKLOG = 100
#: Seconds the acceptor waits when the process is out of descriptors or memory.
ACCEPT_RETRY_DELAY = 1.0
#: Seconds ``close`` waits for the acceptor's tasks to end once cancelled.
CLOSE_TIMEOUT = 1.0


def describe_tls_failure(exc: BaseException) -> str:
    """A short reason for a failed handshake: OpenSSL's verification message or reason code
    where it gives one (``certificate verify failed: unable to get local issuer
    certificate``, ``PEER_DID_NOT_RETURN_A_CERTIFICATE``, ``WRONG_VERSION_NUMBER``: plain
    bytes), else the exception."""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    if isinstance(exc, TimeoutError):
        return "no TLS handshake within the timeout"
    if isinstance(exc, ConnectionResetError) and not str(exc):
        return "the peer closed the connection in the handshake (no TLS, or it refused ours)"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class RefusalLog:
    """Logs refused peers at warning level, rate-limited, and counts every refusal.

    At most one line per peer host per ``interval`` seconds and ``max_lines`` lines per
    interval in all; a line reports the refusals of that host it did not log since its last
    line. ``peers`` bounds the table of hosts' last lines (expired entries, then the oldest,
    make room). ``clock`` is injectable for tests."""

    def __init__(
        self,
        what: str,
        *,
        interval: float = REFUSAL_LOG_INTERVAL,
        peers: int = REFUSAL_LOG_PEERS,
        max_lines: int = REFUSAL_LOG_LINES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: What was refused, for the lines ("TLS handshake from", "TLS handshake with").
        self.what = what
        self.interval = interval
        self.peers = peers
        self.max_lines = max_lines
        self.clock = clock
        #: Refusals since the process started, by reason.
        self.counts: Counter[str] = Counter()
        #: Host -> (time of its last line, refusals not logged since).
        self._last: dict[str, tuple[float, int]] = {}
        self._window_start = -float("inf")
        self._window_lines = 0

    @property
    def num_refused(self) -> int:
        return sum(self.counts.values())

    def refused(self, host: str, peer: str, reason: str) -> bool:
        """Count a refusal of ``peer`` (``host:port``) for ``reason``; True when it was logged."""
        self.counts[reason] += 1
        now = self.clock()
        last = self._last.get(host)
        if last is not None and now - last[0] < self.interval:
            self._last[host] = (last[0], last[1] + 1)
            return False
        if now - self._window_start >= self.interval:
            self._window_start = now
            self._window_lines = 0
        if self._window_lines >= self.max_lines:
            return False
        self._window_lines += 1
        unlogged = last[1] if last is not None else 0
        self._last.pop(host, None)
        if len(self._last) >= self.peers:
            self._forget(now)
        self._last[host] = (now, 0)
        more = f" ({unlogged} more from this host since its last line)" if unlogged else ""
        logger.warning("tcp request plane: refused %s %s: %s%s", self.what, peer, reason, more)
        return True

    def _forget(self, now: float) -> None:
        """Room for one host: drop the expired entries, or the oldest when none has expired."""
        expired = [h for h, (at, _) in self._last.items() if now - at >= self.interval]
        for host in expired:
            del self._last[host]
        if len(self._last) >= self.peers:
            del self._last[next(iter(self._last))]


class TlsAcceptor:
    """Listens on ``host:port`` and connects each accepted socket to a protocol from
    ``factory`` once its TLS handshake under ``context`` succeeds (see the module docstring).

    At most ``max_pending`` handshakes run at once, each for at most ``handshake_timeout``
    seconds; a refused peer is counted and logged by ``refusals``."""

    def __init__(
        self,
        factory: Callable[[], asyncio.Protocol],
        context: ssl.SSLContext,
        refusals: RefusalLog,
        *,
        handshake_timeout: float = TLS_HANDSHAKE_TIMEOUT,
        max_pending: int = MAX_PENDING_HANDSHAKES,
    ) -> None:
        self.factory = factory
        self.context = context
        self.refusals = refusals
        self.handshake_timeout = handshake_timeout
        self.max_pending = max_pending
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Task[None]] = set()

    def listen(self, host: str, port: int) -> tuple[str, int]:
        """Bind and listen (port 0: the OS picks one); the bound ``(host, port)``."""
        family, _, _, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.create_server(address, family=family, backlog=BACKLOG)
        sock.setblocking(False)
        self._sock = sock
        self._accepting = asyncio.get_running_loop().create_task(self._accept_loop(sock))
        bound: tuple[str, int] = sock.getsockname()[:2]
        return bound

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(sock)
            except ConnectionError:
                continue  # the peer gave up before it was accepted
            except OSError as exc:  # out of descriptors or memory: accept again later
                logger.error("tcp request plane: cannot accept a connection: %s", exc)
                await asyncio.sleep(ACCEPT_RETRY_DELAY)
                continue
            host, name = str(peer[0]), f"{peer[0]}:{peer[1]}"
            if len(self._handshakes) >= self.max_pending:
                conn.close()
                self.refusals.refused(host, name, "too many TLS handshakes at once")
                continue
            conn.setblocking(False)
            task = loop.create_task(self._handshake(conn, host, name))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, conn: socket.socket, host: str, name: str) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                self.factory,
                conn,
                ssl=self.context,
                ssl_handshake_timeout=self.handshake_timeout,
            )
        except Exception as exc:  # the loop closed the socket
            self.refusals.refused(host, name, describe_tls_failure(exc))

    async def close(self) -> None:
        """Stop accepting; handshakes under way are abandoned (their sockets closed)."""
        tasks = [t for t in (self._accepting, *self._handshakes) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
