"""One process's connection to NATS, shared by the ``nats`` request plane and event plane.

``connect_nats(NatsOptions(servers=["nats://host:4222"]))`` connects once and fails fast when
no server can be reached (``ConfigError`` naming the servers: a wrong URL or a server that is
down is a start-up mistake, reported in one line). Once connected, the connection rides out
outages: it reconnects forever with a back-off, logging one line when it loses the server and
one when it is back, never one per attempt. Subscriptions are restored by the client library
on reconnect; what was published while disconnected is buffered (bounded) or lost, as the
request and event planes' contracts allow.

``subscribe_confirmed`` is how both planes subscribe: it returns once the NATS server has
registered the subscription, or within a bounded time raises ``NatsUnavailable`` having removed
it again, so a failed attempt leaves nothing behind and the next one starts afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from turnout.errors import ConfigError, TurnoutError
from turnout.runtime.redact import redact_url

logger = logging.getLogger("turnout.runtime.nats")

#: Seconds between reconnect attempts to one server while disconnected.
RECONNECT_WAIT = 0.5
#: Seconds between looks at the connection while waiting for a reconnect to finish.
_RECONNECT_POLL = 0.05


class NatsUnavailable(TurnoutError):
    """The NATS server did not confirm an operation in time: it is unreachable, frozen, or the
    connection is closed. Raised by ``round_trip`` and ``subscribe_confirmed``."""


@dataclass
class NatsOptions:
    """Where and how to connect. ``servers`` are URLs such as ``nats://host:4222`` (a
    ``user:password@`` in the URL works too); ``ca_cert``/``cert``/``key`` are PEM paths for
    TLS (``ca_cert`` alone: verify the server; with ``cert`` and ``key``: mutual TLS)."""

    servers: list[str] = field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    user: str | None = None
    password: str | None = field(default=None, repr=False)  # a secret: never in a repr
    token: str | None = field(default=None, repr=False)  # a secret: never in a repr
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    #: Seconds to reach a server at start (per attempt, and the whole start-up budget).
    connect_timeout: float = 5.0
    #: Shown in the server's monitoring (``connz``).
    name: str | None = None
    #: Seconds between client pings; two unanswered pings mark the connection dead and start
    #: a reconnect on a fresh socket. Short, because a connection that silently stopped
    #: moving (a network cut) would otherwise hold this process's subscriptions hostage for
    #: minutes of TCP retransmission back-off after the network is back.
    ping_interval: float = 2.0

    def __repr__(self) -> str:
        """The fields a dataclass repr shows, with each server URL's password or token
        replaced by ``***`` (``password`` and ``token`` are left out altogether)."""
        shown = ", ".join(
            f"{f.name}={[redact_url(url) for url in self.servers]!r}"
            if f.name == "servers"
            else f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.repr
        )
        return f"{type(self).__name__}({shown})"


class NatsConnection:
    """A connected NATS client plus this process's bookkeeping of its state.

    It also owns the echo subscription behind ``round_trip``: one inbox of its own, made at
    connect, to which a round trip publishes a numbered message and waits for it to come
    back.
    """

    def __init__(self, client: Client, options: NatsOptions) -> None:
        self.client = client
        self.options = options
        self._closed = False
        #: The inbox subscription that echoes round trips (made by ``connect_nats``).
        self._echo: Subscription | None = None
        self._echo_subject = ""
        #: Round trips waiting for their echo, by message number. Only ``round_trip`` adds
        #: and removes entries; the echo callback only resolves them.
        self._echo_waiters: dict[bytes, asyncio.Future[None]] = {}
        self._echo_count = 0

    @property
    def servers(self) -> list[str]:
        return list(self.options.servers)

    @property
    def is_connected(self) -> bool:
        return self.client.is_connected

    @property
    def max_payload(self) -> int:
        """The largest message the server accepts (1 MiB by default)."""
        return int(self.client.max_payload)

    async def _on_echo(self, msg: Msg) -> None:
        """An echo came back: wake its round trip, if it still waits (a late echo of an
        abandoned one is dropped)."""
        waiter = self._echo_waiters.get(msg.data)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _open_echo(self) -> None:
        """Subscribe to the echo inbox (at connect: the subscription lives as long as the
        connection, and the library restores it after each reconnect)."""
        self._echo_subject = self.client.new_inbox()
        self._echo = await self.client.subscribe(self._echo_subject, cb=self._on_echo)

    async def _send_echo(self) -> tuple[bytes, asyncio.Future[None]]:
        """Publish the next echo: its number and the future its return resolves. The caller
        removes it from ``_echo_waiters``."""
        if self._echo is None:
            await self._open_echo()
        self._echo_count += 1
        number = str(self._echo_count).encode()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._echo_waiters[number] = waiter
        try:
            await self.client.publish(self._echo_subject, number)
        except BaseException:
            del self._echo_waiters[number]
            raise
        return number, waiter

    async def close(self) -> None:
        """Close the connection, dropping what is unsent; idempotent."""
        if self._closed:
            return
        self._closed = True
        for waiter in self._echo_waiters.values():
            waiter.cancel()
        self._echo_waiters.clear()
        if not self.client.is_closed:
            await self.client.close()


def _tls_context(options: NatsOptions) -> ssl.SSLContext | None:
    if not (options.ca_cert or options.cert or options.key):
        return None
    if bool(options.cert) != bool(options.key):
        raise ConfigError("NATS TLS needs both a client certificate and its key, or neither")
    try:
        ctx = ssl.create_default_context(cafile=options.ca_cert)
        if options.cert and options.key:
            ctx.load_cert_chain(options.cert, options.key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load NATS TLS files: {exc}") from exc
    return ctx


def _reason(exc: BaseException | None) -> str:
    if exc is None:
        return "no answer"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _abandon(client: Client) -> None:
    """Close a client whose first connect was given up. Cut off mid-attempt, the library may
    still hold that attempt's socket, which ``close`` alone does not always reach."""
    await client.close()
    transport = getattr(client, "_transport", None)
    if transport is not None:
        transport.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await transport.wait_closed()


async def connect_nats(options: NatsOptions) -> NatsConnection:
    """Connect to NATS, or raise ``ConfigError`` once every server has failed once or the
    ``connect_timeout`` has passed (whichever is first)."""
    if not options.servers:
        raise ConfigError("no NATS server given")
    tls = _tls_context(options)
    servers = list(options.servers)
    state = {"connected": False, "online": True, "failures": 0}
    last_error: list[BaseException] = []
    loop = asyncio.get_running_loop()
    timeout_cm: asyncio.Timeout | None = None

    async def error_cb(exc: Exception) -> None:
        if not state["connected"]:
            last_error[:] = [exc]
            state["failures"] += 1
            if state["failures"] >= len(servers) and timeout_cm is not None:
                timeout_cm.reschedule(loop.time())  # every server refused: give up now
            return
        logger.debug("NATS connection error: %r", exc)

    async def disconnected_cb() -> None:
        if state["connected"] and state["online"] and not client.is_closed:
            state["online"] = False
            logger.warning(
                "lost the NATS server; reconnecting to %s", [redact_url(u) for u in servers]
            )

    async def reconnected_cb() -> None:
        if not state["online"]:
            state["online"] = True
            url = client.connected_url
            logger.warning("reconnected to NATS at %s", url.hostname if url else "?")

    client = Client()
    try:
        async with asyncio.timeout(options.connect_timeout) as timeout_cm:
            await client.connect(
                servers=servers,
                name=options.name,
                user=options.user,
                password=options.password,
                token=options.token,
                tls=tls,
                connect_timeout=max(1, round(options.connect_timeout)),
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=RECONNECT_WAIT,  # type: ignore[arg-type]
                ping_interval=options.ping_interval,  # type: ignore[arg-type]
                max_outstanding_pings=2,
                error_cb=error_cb,
                disconnected_cb=disconnected_cb,
                reconnected_cb=reconnected_cb,
            )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        await _abandon(client)
        cause = last_error[0] if last_error else exc
        if isinstance(exc, TimeoutError) and not last_error:
            cause = TimeoutError(f"no answer within {options.connect_timeout:g}s")
        shown = [redact_url(url) for url in servers]
        raise ConfigError(f"cannot reach NATS at {shown}: {_reason(cause)}") from cause
    state["connected"] = True
    conn = NatsConnection(client, options)
    try:
        await conn._open_echo()
    except (OSError, nats.errors.Error) as exc:
        await client.close()
        raise ConfigError(f"cannot subscribe on NATS: {_reason(exc)}") from exc
    return conn


async def round_trip(conn: NatsConnection, timeout: float) -> None:
    """Return once the NATS server has processed everything this connection sent so far, or
    raise ``NatsUnavailable`` after ``timeout`` seconds.

    The server handles a connection's operations in order, so a message this connection
    publishes to an inbox it subscribes to comes back only after every earlier operation
    (a subscription above all) was processed: the same proof as a PING answered by its
    PONG, through public calls. Not ``Client.flush(timeout)``: when that times out, nats-py
    cancels its PONG future, and the late PONG then kills the library's reader task
    (``set_result`` on a cancelled future), leaving the connection deaf until its pings
    declare it stale. A late echo is dropped by ``NatsConnection`` instead.

    While the connection is reconnecting, the wait for the reconnect counts against
    ``timeout``.
    """
    client = conn.client
    deadline = time.monotonic() + timeout
    while not client.is_connected:
        if client.is_closed:
            raise NatsUnavailable("the NATS connection is closed")
        if time.monotonic() >= deadline:
            raise NatsUnavailable(f"not connected to NATS (reconnecting for over {timeout:g}s)")
        await asyncio.sleep(_RECONNECT_POLL)
    number: bytes | None = None
    try:
        async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
            number, waiter = await conn._send_echo()
            await waiter
    except TimeoutError:
        raise NatsUnavailable(f"NATS did not answer within {timeout:g}s") from None
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if conn._closed and task is not None and task.cancelling() == 0:
            # ``close`` cancelled the wait, not our caller.
            raise NatsUnavailable("the NATS connection is closed") from None
        raise
    except (OSError, nats.errors.Error) as exc:  # the transport went away
        raise NatsUnavailable(f"NATS connection failed: {_reason(exc)}") from exc
    finally:
        if number is not None:
            conn._echo_waiters.pop(number, None)


async def subscribe_confirmed(
    conn: NatsConnection, subject: str, cb: Callable[[Msg], Awaitable[None]], timeout: float
) -> Subscription:
    """Subscribe to ``subject`` and return once the NATS server has registered it (from then
    on nothing published to it is missed).

    Raises ``NatsUnavailable`` when that is not confirmed within ``timeout`` seconds; the
    subscription is then removed again (as it is when the caller is cancelled), so a failed
    attempt leaks no subscription that the library would restore on the next reconnect.
    """
    client = conn.client
    try:
        sub = await client.subscribe(subject, cb=cb)
    except (OSError, nats.errors.Error) as exc:
        raise NatsUnavailable(f"cannot subscribe to {subject}: {_reason(exc)}") from exc
    try:
        await round_trip(conn, timeout)
    except BaseException as exc:
        with contextlib.suppress(Exception):  # closed or reconnecting: removed locally anyway
            await sub.unsubscribe()
        if isinstance(exc, NatsUnavailable):
            raise NatsUnavailable(f"subscription to {subject} not confirmed: {exc}") from exc
        raise
    return sub
