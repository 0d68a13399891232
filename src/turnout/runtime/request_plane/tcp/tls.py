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

Handshakes are bounded in time (``TLS_HANDSHAKE_TIMEOUT``) and in number at once
(``MAX_PENDING_HANDSHAKES``; past it a connection is aborted as it is accepted, and counted).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable

from turnout.runtime.refusal_log import RefusalLog

logger = logging.getLogger("turnout.runtime")

#: Seconds a peer may take to complete the TLS handshake, either end.
TLS_HANDSHAKE_TIMEOUT = 5.0
#: TLS handshakes one server runs at once; a connection accepted past it is aborted at once.
MAX_PENDING_HANDSHAKES = 256
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
                self.refusals.refused(
                    host, f"TLS handshake from {name}", "too many TLS handshakes at once"
                )
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
            self.refusals.refused(host, f"TLS handshake from {name}", describe_tls_failure(exc))

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
