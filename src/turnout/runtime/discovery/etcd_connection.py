"""``EtcdConnection``: the connection half of the etcd store: endpoints, channels, auth, calls.

* Endpoints are tried in turn: each has its own gRPC channel (created lazily, on the running
  loop); a call that cannot reach the current endpoint moves on to the next, and gives up with
  ``EtcdUnavailable`` when none answers. Every call has a deadline (``connect_timeout``), so
  nothing awaits the network forever.
* ``user``/``password`` authenticate with etcd's auth API. The token is dropped and a fresh
  one taken whenever etcd says it is invalid (it expires, and a restarted, restored or rebuilt
  etcd forgets it): on unary calls, on the lease keep-alive stream and on watch streams.
* Unary calls run on an asyncio gRPC channel; the streams (a watch, a lease keep-alive on
  etcd's LeaseKeepAlive stream) run on a blocking channel of the same endpoint, each read by a
  thread of its own, so that ending one is awaitable (see ``etcd_client``). A watch whose
  creation gets no answer has that blocking channel replaced (``reconnect_streams``).
* Every answer's header says the revision of the member that gave it. A member's revision
  never goes back, except when its store was restored from a snapshot or rebuilt empty: then
  ``generation`` goes up, one line is logged, and ``_store_restored`` lets the watches re-list
  and the leases be granted again (their keys may be gone, or be an old copy).
* Failures surface as ``DiscoveryError`` with one readable line, never as raw gRPC errors;
  the loss and return of etcd are logged once per change of state.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc
import grpc.aio
from google.protobuf.message import Message

from turnout.errors import ConfigError, DiscoveryError
from turnout.runtime.discovery import etcd_v3_pb2 as pb
from turnout.runtime.discovery.base import KeyValue
from turnout.runtime.discovery.etcd_client import EtcdCalls, ThreadStream, prefix_range_end
from turnout.runtime.redact import redact_url

logger = logging.getLogger("turnout.runtime.discovery.etcd")

_T = TypeVar("_T")
_M = TypeVar("_M", bound=Message)

#: (generation, member id → highest revision answered): see ``EtcdConnection._floor``.
Floor = tuple[int, dict[int, int]]

#: gRPC channel settings: keep-alive pings find a dead peer on a silent connection while a
#: call is open (etcd refuses pings more often than every 5 s, and any ping on a connection
#: without a stream: it answers them with GOAWAY ``too_many_pings``; a unary call has its own
#: deadline), and a short reconnect backoff finds a restarted etcd soon (gRPC's default grows
#: to two minutes).
_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # The channel owns its connections: closing the store closes its sockets (with gRPC's
    # global pool they would outlive it, shared with nobody).
    ("grpc.use_local_subchannel_pool", 1),
]

TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

#: Unary calls in a row without an answer after which an endpoint's asyncio channel is
#: replaced: a channel can stay stuck on a connection to an etcd that is no more.
RECONNECT_AFTER_TIMEOUTS = 2

#: Members whose latest revision is remembered (a cluster has a handful; past this many the
#: memory starts over, which only delays noticing a restore until the next answer).
MAX_MEMBERS_TRACKED = 64


class EtcdUnavailable(DiscoveryError):
    """No endpoint of the etcd store answered in time."""


class EtcdAuthRejected(DiscoveryError):
    """etcd refused the user's credentials (a wrong password, an unknown user, auth not
    enabled: a rebuilt etcd whose users are being re-created)."""


class Unreachable(Exception):
    """One endpoint did not answer in time (internal: the caller tries the next one)."""


def _parse_endpoint(endpoint: str) -> tuple[str, bool | None]:
    """``http://h:2379`` → (``h:2379``, False); ``https://…`` → True; bare ``h:2379`` → None."""
    text = endpoint.strip()
    shown = redact_url(text)  # errors quote it; a password in it must not reach the logs
    if "://" not in text:
        target, tls = text, None
    else:
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https"):
            raise ConfigError(f"etcd endpoint {shown!r}: scheme must be http or https")
        if parts.path not in ("", "/"):
            raise ConfigError(f"etcd endpoint {shown!r}: no path expected")
        if "@" in parts.netloc:
            raise ConfigError(f"etcd endpoint {shown!r}: give credentials as user/password")
        target, tls = parts.netloc, parts.scheme == "https"
    if not target:
        raise ConfigError(f"etcd endpoint {shown!r}: no host")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit() or host.endswith(":"):
        target += ":2379"  # etcd's client port when none is named
    return target, tls


def _read_pem(option: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"etcd {option} {path!r}: {exc.strerror or exc}") from None


def status_code(exc: grpc.RpcError) -> grpc.StatusCode:
    """The status code of a failed call: an asyncio call's ``AioRpcError`` and a blocking
    stream's error both carry it (a bare ``RpcError`` without one counts as UNKNOWN)."""
    code = getattr(exc, "code", None)
    result = code() if callable(code) else None
    return result if isinstance(result, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def one_line(exc: BaseException) -> str:
    """A short, single-line reason for ``exc`` (gRPC details can span lines).

    Also drops the tracebacks of ``exc`` and its causes: they hold the frames of the failed
    gRPC call, whose reference cycles would keep its connection open after the store closes
    (until a garbage collection). Callers raise their own error ``from None``; the reason
    text carries what the user needs.
    """
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "details", None)):
        details = exc.details() or ""
        # "failed to connect to all addresses; last error: UNKNOWN: ipv4:h:p: Connection
        # refused" says the endpoint twice and the cause last: keep the cause.
        details = re.sub(
            r"^failed to connect to all addresses; last error: \w+: \S+: ", "", details
        )
        text = f"{status_code(exc).name}: {details}" if details else status_code(exc).name
    elif isinstance(exc, TimeoutError):
        text = "timed out"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def discard_outcome(future: asyncio.Future[Any]) -> None:
    """Forget the outcome of a finished watch ``future`` (a cancelled stream read): its
    exception's traceback holds the frames of the read, hence the call, and a live call
    keeps its connection open after the channel closed, until a garbage collection."""
    if not future.done():
        return
    try:
        future.result()
    except BaseException as exc:
        one_line(exc)


@dataclass(slots=True)
class Endpoint:
    """One etcd endpoint and, once used, its channels: an asyncio one for the unary calls,
    a blocking one for the streams (see ``etcd_client``)."""

    url: str
    target: str
    channel: grpc.aio.Channel | None = None
    calls: EtcdCalls | None = None
    stream_channel: grpc.Channel | None = None
    #: Unary calls in a row that got no answer in time (see ``_timed_out``).
    timeouts: int = 0


class EtcdConnection:
    """The endpoints, channels, credentials and calls of one etcd store (see the module
    docstring); ``EtcdStore`` adds the keys, leases and watches.

    Options: ``endpoints`` (``http://host:port`` or ``https://host:port``, tried in turn;
    a comma-separated string is accepted too), ``ca_cert`` (PEM file of the CA that signed
    etcd's certificate; https endpoints without it trust the system's CAs), ``cert`` and
    ``key`` (PEM files of a client certificate, for etcd's ``--client-cert-auth``), ``user``
    and ``password`` (etcd's auth), ``connect_timeout`` (seconds each call may wait for an
    endpoint, default 5).
    """

    def __init__(
        self,
        endpoints: Sequence[str] | str = ("http://127.0.0.1:2379",),
        *,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
        connect_timeout: float = 5.0,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [part for part in endpoints.split(",") if part.strip()]
        if not endpoints:
            raise ConfigError("etcd store needs at least one endpoint")
        if connect_timeout <= 0:
            raise ConfigError(f"etcd connect_timeout must be positive, got {connect_timeout}")
        if (cert is None) != (key is None):
            raise ConfigError("etcd client certificate needs both cert and key")
        if password is not None and user is None:
            raise ConfigError("etcd password given without a user")
        parsed = [_parse_endpoint(e) for e in endpoints]
        schemes = {tls for _, tls in parsed if tls is not None}
        if len(schemes) > 1:
            raise ConfigError(f"etcd endpoints mix http and https: {list(endpoints)}")
        self.tls = (schemes.pop() if schemes else False) or ca_cert is not None or cert is not None
        if self.tls and False in {tls for _, tls in parsed}:
            raise ConfigError("etcd TLS options given with http:// endpoints; use https://")
        self.endpoints = [e.strip() for e in endpoints]
        self.connect_timeout = float(connect_timeout)
        self.user = user
        self._password = password or ""
        self._credentials: grpc.ChannelCredentials | None = None
        if self.tls:
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_pem("ca_cert", ca_cert),
                private_key=_read_pem("key", key),
                certificate_chain=_read_pem("cert", cert),
            )
        self._endpoints = [
            Endpoint(url, target) for url, (target, _) in zip(self.endpoints, parsed, strict=True)
        ]
        self._current = 0
        self._token: str | None = None
        self._closed = False
        self._closed_event: asyncio.Event | None = None
        self._reachable = True
        #: Replaced asyncio channels (when, channel), closed once no call can be left on them
        #: (every call has a deadline of ``connect_timeout``); a handful at most.
        self._retired: list[tuple[float, grpc.aio.Channel]] = []
        #: Member id → the highest revision an answer of that member carried.
        self._heads: dict[int, int] = {}
        #: How many times the store was found restored or rebuilt (its revision went back):
        #: what was granted or read in an earlier generation may be gone or an old copy.
        self.generation = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoints})"

    # -- plumbing -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DiscoveryError(f"etcd store {self.endpoints} is closed")

    def _closed_waiter(self) -> asyncio.Event:
        if self._closed_event is None:
            self._closed_event = asyncio.Event()
            if self._closed:
                self._closed_event.set()
        return self._closed_event

    def _connect(self, ep: Endpoint) -> EtcdCalls:
        """The calls of ``ep``, its channel open (created on the running loop, on first
        use)."""
        if ep.calls is None:
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(ep.target, self._credentials, _CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.insecure_channel(ep.target, _CHANNEL_OPTIONS)
            ep.channel = channel
            ep.calls = EtcdCalls(channel)
        return ep.calls

    def _stream_channel(self, ep: Endpoint) -> grpc.Channel:
        """The blocking channel of ``ep`` for its streams (created on first use)."""
        if ep.stream_channel is None:
            if self._credentials is not None:
                ep.stream_channel = grpc.secure_channel(
                    ep.target, self._credentials, _CHANNEL_OPTIONS
                )
            else:
                ep.stream_channel = grpc.insecure_channel(ep.target, _CHANNEL_OPTIONS)
        return ep.stream_channel

    def _open_stream(
        self,
        ep: Endpoint,
        path: str,
        response: type[_M],
        requests: Sequence[Message],
        *,
        keep_open: bool,
        timeout: float | None = None,
    ) -> ThreadStream[_M]:
        """A streaming call ``path`` to ``ep`` with this store's token (see ``ThreadStream``)."""
        return ThreadStream(
            self._stream_channel(ep),
            path,
            response,
            requests,
            keep_open=keep_open,
            metadata=self._metadata(),
            timeout=timeout,
        )

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("token", self._token),) if self._token else None

    async def _authenticate(self, ep: Endpoint) -> None:
        """Get a fresh token from ``ep`` (only with ``user``)."""
        assert self.user is not None
        calls = self._connect(ep)
        request = pb.AuthenticateRequest(name=self.user, password=self._password)
        try:
            resp = await calls.authenticate(request, timeout=self.connect_timeout)
        except TimeoutError as exc:
            raise Unreachable(one_line(exc)) from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() in TRANSIENT_CODES:
                raise Unreachable(one_line(exc)) from None
            # etcd answers a wrong password with INVALID_ARGUMENT.
            raise EtcdAuthRejected(
                f"etcd at {ep.url} rejected user {self.user!r}: {one_line(exc)}"
            ) from None
        self._token = resp.token

    def _floor(self) -> Floor:
        """What a call about to be issued must find at least: each member's highest revision
        answered so far (see ``_observe``)."""
        return self.generation, dict(self._heads)

    def _observe(self, header: pb.ResponseHeader, floor: Floor) -> None:
        """Note the revision of an answer to a call issued at ``floor``. A member's revision
        never goes back, so an answer below what the same member had answered before the
        call was issued means its store was restored from a snapshot or rebuilt: everything
        of the earlier generation is suspect. (Comparing with answers that came back while
        the call was in flight would be wrong: concurrent calls finish in any order.)"""
        member, revision = int(header.member_id), int(header.revision)
        if revision <= 0:
            return
        generation, heads = floor
        last = heads.get(member)
        if generation == self.generation and last is not None and revision < last:
            self.generation += 1
            self._heads.clear()
            logger.warning(
                "etcd store was restored or rebuilt (revision went from %d to %d): "
                "re-listing watches and re-registering leased keys",
                last,
                revision,
            )
            self._store_restored()
        if member not in self._heads and len(self._heads) >= MAX_MEMBERS_TRACKED:
            self._heads.clear()
        if revision > self._heads.get(member, 0):
            self._heads[member] = revision

    def _store_restored(self) -> None:
        """Called once when ``generation`` goes up; the store's watches forget the revisions
        they hold (they belong to the store's earlier history)."""

    def reconnect_streams(self, ep: Endpoint) -> None:
        """Replace the blocking channel of ``ep`` (its next stream opens a new connection)
        and drop the token: a watch creation that got no answer may be stuck on a connection
        to an etcd that is no more, or on a token it no longer knows. The streams still on
        the old channel end (gRPC cancels them) and are re-opened by their owners."""
        self._token = None
        if ep.stream_channel is not None:
            channel, ep.stream_channel = ep.stream_channel, None
            channel.close()

    def _mark(self, reachable: bool, reason: str = "") -> None:
        """Log once per change of state, not once per failed call."""
        if reachable == self._reachable:
            return
        self._reachable = reachable
        if reachable:
            logger.warning("etcd reachable again at %s", self._endpoints[self._current].url)
        else:
            logger.warning("etcd unreachable at %s, retrying: %s", self.endpoints, reason)

    def _advance(self, index: int) -> None:
        """The endpoint ``index`` failed: the next call starts with the following one."""
        if self._current == index:
            self._current = (index + 1) % len(self._endpoints)

    async def _call(
        self, what: str, fn: Callable[[Endpoint], Awaitable[_T]], *, retry: bool = True
    ) -> _T:
        """Run ``fn`` on the current endpoint, failing over to the others.

        With ``retry``, rounds over the endpoints repeat with a short backoff until
        ``connect_timeout`` has passed (a restarting etcd or a reconnecting channel answers
        within it); without, one round (start-up checks: a refused connection fails at
        once). Errors become ``DiscoveryError`` naming ``what``.
        """
        self._check_open()
        await self._close_retired()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout
        backoff = 0.05
        reasons: list[str] = []
        while True:
            start = self._current
            for step in range(len(self._endpoints)):
                index = (start + step) % len(self._endpoints)
                try:
                    result = await self._attempt(what, fn, index, deadline)
                except Unreachable as exc:
                    reasons.append(f"{self._endpoints[index].url}: {exc}")
                    self._advance(index)
                    self._check_open()
                    continue
                self._current = index
                self._mark(True)
                return result
            if not retry or loop.time() + backoff >= deadline:
                break
            await asyncio.sleep(backoff)
            self._check_open()
            backoff = min(2 * backoff, 0.5)
        # The last failure of each endpoint says enough (and with one endpoint, the error
        # names it already).
        last = {reason.split(": ", 1)[0]: reason for reason in reasons}
        if len(self._endpoints) == 1:
            last = {url: text.split(": ", 1)[1] for url, text in last.items()}
        reason = "; ".join(last.values())
        if retry:  # a start-up check says it once, as an error, not as a retry
            self._mark(False, reason)
        raise EtcdUnavailable(f"etcd {what}: unreachable at {self.endpoints}: {reason}")

    async def _attempt(
        self, what: str, fn: Callable[[Endpoint], Awaitable[_T]], index: int, deadline: float
    ) -> _T:
        """``fn`` on endpoint ``index``: its result, ``Unreachable`` when the endpoint did not
        answer in time, or ``DiscoveryError`` when it answered no. An UNAUTHENTICATED answer
        ("invalid auth token": it expired, or a restarted etcd forgot it) is retried once
        with a fresh token."""
        ep = self._endpoints[index]
        self._connect(ep)
        loop = asyncio.get_running_loop()
        reauthenticated = False
        while True:
            try:
                if self.user is not None and self._token is None:
                    await self._authenticate(ep)
                # Leave time for the other endpoints: one that swallows packets must not use
                # the whole budget.
                share = max(self.connect_timeout / len(self._endpoints), 0.5)
                budget = min(max(deadline - loop.time(), 0.05), share)
                async with asyncio.timeout(budget):
                    result = await fn(ep)
                ep.timeouts = 0
                return result
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closed and task is not None and task.cancelling() == 0:
                    # gRPC cancels the calls of a closing channel: not our caller's doing.
                    raise DiscoveryError(f"etcd store {self.endpoints} is closed") from None
                raise
            except TimeoutError as exc:
                self._timed_out(ep)
                raise Unreachable(one_line(exc)) from None
            except grpc.RpcError as exc:
                code = status_code(exc)
                if code in TRANSIENT_CODES:
                    raise Unreachable(one_line(exc)) from None
                if code == grpc.StatusCode.UNAUTHENTICATED and self._retry_auth(reauthenticated):
                    reauthenticated = True
                    continue
                raise DiscoveryError(f"etcd {what}: {one_line(exc)}") from None

    def _timed_out(self, ep: Endpoint) -> None:
        """A unary call to ``ep`` got no answer in time; after a few in a row, the next call
        opens a new channel (and takes a fresh token). The old channel is closed later, by
        ``_close_retired``, once the calls on it have passed their deadlines."""
        ep.timeouts += 1
        if ep.timeouts < RECONNECT_AFTER_TIMEOUTS or ep.channel is None:
            return
        ep.timeouts = 0
        self._retired.append((asyncio.get_running_loop().time(), ep.channel))
        ep.channel = ep.calls = None
        self._token = None

    async def _close_retired(self, *, all_of_them: bool = False) -> None:
        """Close the replaced channels no call can be on any more (all, at close)."""
        if not self._retired:
            return
        horizon = asyncio.get_running_loop().time() - self.connect_timeout
        keep = [] if all_of_them else [(t, c) for t, c in self._retired if t > horizon]
        done = [c for t, c in self._retired if all_of_them or t <= horizon]
        self._retired = keep
        for channel in done:
            await channel.close()

    def _retry_auth(self, already: bool) -> bool:
        """An UNAUTHENTICATED answer: drop the token and retry once when we have a user
        (tokens expire, and an etcd restart forgets them)."""
        if self.user is None or already:
            return False
        self._token = None
        return True

    @staticmethod
    def _range(prefix: str) -> tuple[bytes, bytes]:
        """etcd's (key, range_end) for every key under ``prefix`` ("" = all keys)."""
        if not prefix:
            return b"\0", b"\0"
        return prefix.encode(), prefix_range_end(prefix.encode())

    @staticmethod
    def _kv(kv: pb.KeyValue) -> KeyValue:
        return KeyValue(
            key=kv.key.decode(),
            value=bytes(kv.value),
            revision=int(kv.mod_revision),
            lease_id=int(kv.lease) or None,
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._closed_event is not None:
            self._closed_event.set()
        # Let watches see the event and cancel their streams before the channels go.
        await asyncio.sleep(0)
        await self._close_retired(all_of_them=True)
        for ep in self._endpoints:
            if ep.channel is not None:
                channel, ep.channel = ep.channel, None
                await channel.close()
            if ep.stream_channel is not None:
                stream_channel, ep.stream_channel = ep.stream_channel, None
                stream_channel.close()
            ep.calls = None
