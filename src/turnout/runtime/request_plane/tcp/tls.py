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
(``refusal_log.RefusalLog``: one warning line per peer host per minute, a bounded table, and
counters, so a flood of bad connections cannot flood the logs). (``start_tls`` on a plain server's
transport is no way either: uvloop starts reading after ``connection_made``, so the first
TLS bytes could reach the plain protocol.)

Handshakes are bounded in time (``TLS_HANDSHAKE_TIMEOUT``), in number at once from one peer
host (``MAX_PENDING_HANDSHAKES_PER_HOST``; past it the host's next connection is aborted as it
is accepted, and counted) and in number at once in all (``MAX_PENDING_HANDSHAKES``; past it the
oldest pending handshake is aborted, and counted, to make room). Silent connections from a few
hosts therefore cannot hold every slot: a proper client's handshake, which completes in a round
trip or two, always gets one, and the flood's own connections are the ones evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from turnout.runtime.refusal_log import RefusalLog

logger = logging.getLogger("turnout.runtime")

#: Seconds a peer may take to complete the TLS handshake, either end.
TLS_HANDSHAKE_TIMEOUT = 5.0
#: TLS handshakes one server runs at once; past it the oldest pending one is aborted.
MAX_PENDING_HANDSHAKES = 256
#: TLS handshakes one server runs at once for one peer host; its connection past it is aborted.
MAX_PENDING_HANDSHAKES_PER_HOST = 8
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


def tls_refusal_log() -> RefusalLog:
    """The refusal log of a ``tcp`` request plane end, server or client (its lines on the
    ``turnout.runtime`` logger, with the plane's other lines)."""
    return RefusalLog("tcp request plane", logger)


@dataclass(slots=True)
class _Pending:
    """A handshake under way: its task, socket and peer (host, and ``host:port`` for logs)."""

    task: asyncio.Task[None]
    conn: socket.socket
    host: str
    name: str
    #: The task has run, so the loop owns the socket (else cancelling it leaves the socket open).
    started: bool = False


class TlsAcceptor:
    """Listens on ``host:port`` and connects each accepted socket to a protocol from
    ``factory`` once its TLS handshake under ``context`` succeeds (see the module docstring).

    At most ``max_pending`` handshakes run at once (past it the oldest is aborted), at most
    ``max_pending_per_host`` from one peer host (past it the newcomer is aborted), each for at
    most ``handshake_timeout`` seconds; a refused peer is counted and logged by ``refusals``."""

    def __init__(
        self,
        factory: Callable[[], asyncio.Protocol],
        context: ssl.SSLContext,
        refusals: RefusalLog,
        *,
        handshake_timeout: float = TLS_HANDSHAKE_TIMEOUT,
        max_pending: int = MAX_PENDING_HANDSHAKES,
        max_pending_per_host: int = MAX_PENDING_HANDSHAKES_PER_HOST,
    ) -> None:
        self.factory = factory
        self.context = context
        self.refusals = refusals
        self.handshake_timeout = handshake_timeout
        self.max_pending = max_pending
        self.max_pending_per_host = max_pending_per_host
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        #: Handshakes under way by task, oldest first.
        self._handshakes: dict[asyncio.Task[None], _Pending] = {}
        #: Handshakes under way by peer host (hosts with none are not kept).
        self._per_host: Counter[str] = Counter()

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
            if self._per_host[host] >= self.max_pending_per_host:
                conn.close()
                self.refusals.refused(
                    host, f"TLS handshake from {name}", "too many TLS handshakes from one host"
                )
                continue
            if len(self._handshakes) >= self.max_pending:
                self._evict_oldest()
            conn.setblocking(False)
            task = loop.create_task(self._handshake(conn, host, name))
            self._handshakes[task] = _Pending(task, conn, host, name)
            self._per_host[host] += 1
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        """Drop a handshake from the tables (it ended, or was evicted); idempotent."""
        pending = self._handshakes.pop(task, None)
        if pending is None:
            return
        self._per_host[pending.host] -= 1
        if self._per_host[pending.host] <= 0:
            del self._per_host[pending.host]

    def _evict_oldest(self) -> None:
        """Abort the oldest handshake under way to make room for one more, and count it.

        Its socket is shut down as well as its task cancelled, so the peer sees the connection
        end at once (the transport then closes the descriptor) rather than after a TLS
        shutdown timeout; a task that never ran never handed its socket to the loop, so the
        socket is closed here."""
        pending = next(iter(self._handshakes.values()))
        self._forget(pending.task)
        pending.task.cancel()
        if pending.started:
            with contextlib.suppress(OSError):  # the peer or the loop already ended it
                pending.conn.shutdown(socket.SHUT_RDWR)
        else:
            pending.conn.close()
        self.refusals.refused(
            pending.host,
            f"TLS handshake from {pending.name}",
            "evicted: too many TLS handshakes at once",
        )

    async def _handshake(self, conn: socket.socket, host: str, name: str) -> None:
        task = asyncio.current_task()
        if task in self._handshakes:
            self._handshakes[task].started = True
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                self.factory,
                conn,
                ssl=self.context,
                ssl_handshake_timeout=self.handshake_timeout,
            )
        except Exception as exc:  # the loop closed the socket
            self.refusals.refused(host, f"TLS handshake from {name}", describe_tls_failure(exc))

    async def close(self) -> None:
        """Stop accepting; handshakes under way are abandoned (their sockets closed)."""
        tasks = [t for t in (self._accepting, *list(self._handshakes)) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
