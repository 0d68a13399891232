"""An HTTP/1.1 server on asyncio (uvloop) and llhttp (``httptools``), with every bound a
public-facing server needs decided here, in one place.

Why not granian, which served the frontend before: its RSGI interface buffers a streamed
response without limit (``send_bytes`` does not wait for the socket), so a client that stops
reading makes the process hold its whole stream; a connection is never timed out while its
body does not come; and a few thousand silent connections fill its connection slots until
``/live`` itself stops answering. Each of these is a policy here:

* **Deadlines** per phase of a connection: ``header_timeout`` from a connection's first byte
  (or its opening) to the end of the request's headers, ``body_timeout`` from there to the
  end of the body (both answered 408), ``keepalive_timeout`` idle between requests (closed),
  ``write_timeout`` for a client that does not read (its request ends as a disconnect).
* **Connections** are capped at ``max_connections``; a new connection past the cap evicts the
  longest-idle connection that has no request in flight (a silent one, or one still sending
  headers), so a flood of silent connections cannot lock real clients out. Only when every
  connection has a request in flight is the newcomer closed.
* **Back-pressure**: a streamed response's ``send_bytes`` waits while the socket's write
  buffer is above its high-water mark; a request body is read only as fast as the route
  consumes it (reading pauses past ``max_buffered_body`` bytes); at most
  ``max_pipelined`` pipelined requests wait behind the one running.
* **Parsing** is llhttp's strict mode: conflicting ``Content-Length`` and
  ``Transfer-Encoding``, bad chunking and the like are a 400 and a closed connection; headers
  are capped at ``max_header_bytes`` (431).

One task runs each request (``Application(scope, exchange)``); responses on a connection go
out in request order.

Drain is not close: ``wait_idle`` returns once no connection has a request in flight (the
listener still open, so probes are answered meanwhile), and ``stop`` then closes the rest.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import replace
from typing import Any

from .connection import Connection
from .exchange import Application
from .limits import CLOSE_REASONS, HttpLimits
from .wire import DateHeader

log = logging.getLogger("turnout.http")


class HttpServer:
    """Listens on ``host:port`` and serves ``app``; see the module's docstring."""

    def __init__(
        self,
        app: Application,
        host: str,
        port: int,
        *,
        limits: HttpLimits | None = None,
        ssl: Any = None,
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.limits = limits or HttpLimits()
        self.ssl = ssl
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.date = DateHeader()
        #: Connections with no request in flight, longest idle first, with when they
        #: became idle; and those with one.
        self._idle: dict[Connection, float] = {}
        self._busy: set[Connection] = set()
        self._server: asyncio.Server | None = None
        self._stopped: asyncio.Event | None = None
        #: Set while ``wait_idle`` waits, by the change that leaves no request in flight.
        self._quiet: asyncio.Event | None = None
        #: Connections the server closed, by reason (``CLOSE_REASONS``).
        self.closed: dict[str, int] = dict.fromkeys(CLOSE_REASONS, 0)

    @property
    def num_connections(self) -> int:
        return len(self._idle) + len(self._busy)

    async def start(self) -> None:
        self.limits = fit_to_fd_limit(self.limits)
        self.loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._server = await self.loop.create_server(
            lambda: Connection(self),
            self.host,
            self.port,
            backlog=self.limits.backlog,
            reuse_address=True,
            ssl=self.ssl,
        )
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]

    async def serve(self) -> None:
        """Start, then serve until ``stop``."""
        if self._server is None:
            await self.start()
        assert self._stopped is not None
        await self._stopped.wait()

    @property
    def num_in_flight(self) -> int:
        """Connections with a request in flight."""
        return len(self._busy)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a moment with no request in flight; whether it
        came. New connections are still accepted meanwhile (what they are answered is the
        application's choice)."""
        if not self._busy:
            return True
        quiet = self._quiet = asyncio.Event()
        try:
            async with asyncio.timeout(timeout):
                await quiet.wait()
        except TimeoutError:
            return False
        finally:
            self._quiet = None
        return True

    def _check_quiet(self) -> None:
        if not self._busy and self._quiet is not None:
            self._quiet.set()

    def stop(self) -> None:
        """Stop accepting; close idle connections, the others after their response."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._idle) + list(self._busy):
            conn.shut()
        if self._stopped is not None:
            self._stopped.set()

    # ---------------------------------------------------------------- connection book-keeping

    def admit(self, conn: Connection) -> bool:
        """Take ``conn`` in. At the cap, the longest-idle connection makes room if it has
        been idle for ``evict_after`` (a silent one, or one between requests); otherwise, in
        a burst of real clients, the newcomer is answered ``reject_status`` with
        ``Retry-After`` and closed rather than a client cut off before its request."""
        limits = self.limits
        now = self.loop.time()
        if self.num_connections >= limits.max_connections:
            victim = next(iter(self._idle), None)
            if victim is not None and now - self._idle[victim] >= limits.evict_after:
                del self._idle[victim]
                victim.evict()
            else:
                self.count_close("over_capacity")
                conn.reject(limits.reject_status, "the server is at its connection limit")
                return False
        self._idle[conn] = now
        return True

    def busy(self, conn: Connection) -> None:
        self._idle.pop(conn, None)
        self._busy.add(conn)

    def idle(self, conn: Connection) -> None:
        self._busy.discard(conn)
        self._idle.pop(conn, None)
        self._idle[conn] = self.loop.time()  # to the end: the longest idle stay first
        self._check_quiet()

    def forget(self, conn: Connection) -> None:
        self._busy.discard(conn)
        self._idle.pop(conn, None)
        self._check_quiet()

    def count_close(self, reason: str) -> None:
        self.closed[reason] += 1


#: File descriptors kept free of client connections (stores, planes, workers, artifacts).
_RESERVED_FDS = 256


def fit_to_fd_limit(limits: HttpLimits) -> HttpLimits:
    """Raise this process's open-file limit towards ``max_connections`` (the soft limit is
    often 1,024 while the hard one allows far more); if even the hard limit is too low, lower
    ``max_connections`` to fit, with one warning, so the cap, not ``accept`` failing with
    EMFILE, is what a flood of connections meets."""
    want = limits.max_connections + _RESERVED_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        fit = max(1, soft - _RESERVED_FDS)
        log.warning(
            "open-file limit %d leaves room for %d client connections, not the %d asked "
            "(raise `ulimit -n`)",
            soft,
            fit,
            limits.max_connections,
        )
        return replace(limits, max_connections=fit)
    return limits
