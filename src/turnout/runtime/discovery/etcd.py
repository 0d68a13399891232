"""``EtcdStore``: the discovery store of a deployment across hosts, in an etcd v3 cluster.

Mental model: etcd already *is* this contract (keys, leases, revisioned watches); the store is
a thin, defensive translation over etcd's v3 gRPC API (``etcd_client``):

* Revisions are etcd's: a key's ``mod_revision``, a change's header revision. etcd bumps the
  revision once per transaction and every call here is one transaction, so "one change, one
  revision" holds; the one exception is a lease ending, which deletes all its keys in one
  transaction: their DELETEs share a revision (and arrive together, in one watch response).
* Leases are etcd leases. etcd TTLs are whole seconds, so a fractional TTL is rounded **up**
  (at least 1 s), and the cluster may raise it further to its own minimum (1.5 election
  timeouts, 2 s with etcd's default timings). A lease therefore never ends *earlier* than
  asked, only later.
* Endpoints are tried in turn: each has its own gRPC channel (created lazily, on the running
  loop); a call that cannot reach the current endpoint moves on to the next, and gives up with
  ``DiscoveryError`` when none answers. Every call has a deadline (``connect_timeout``), so
  nothing awaits the network forever.
* A watch is one gRPC stream that the store re-opens itself when it breaks (etcd restarted,
  network lost), at the revision after the last one it delivered, with backoff and without
  the consumer noticing beyond a delay. When that revision was compacted meanwhile, the watch
  re-lists the prefix and emits what changed as events: PUTs for keys added or changed since,
  DELETEs for keys that vanished (the store remembers every key its watches reported and
  every key ``get``/``get_prefix`` returned, so a key that is gone now is reported gone,
  never left as a ghost), then streams from the listing's revision. The same applies when a
  caller resumes with a compacted ``start_revision``, e.g. after the revision of a
  ``get_prefix``. Progress notifications of a quiet watch advance the revision it resumes
  from, so a reconnect seldom lands before a compaction at all.
* A watch stream broken by the transport (gRPC UNAVAILABLE, DEADLINE_EXCEEDED, and the
  resets proxies and restarts produce: INTERNAL "RST_STREAM", UNKNOWN "Stream removed",
  CANCELLED) is re-opened; only etcd's refusals (permission, credentials, a bad request) end
  the watch with ``DiscoveryError``.
* Failures surface as ``DiscoveryError`` with one readable line, never as raw gRPC errors;
  the loss and return of etcd are logged once per change of state.
* ``user``/``password`` authenticate with etcd's auth API; the token is renewed whenever etcd
  says it is invalid (it expires, and an etcd restart forgets it).
* Unary calls run on an asyncio gRPC channel; the two streams (a watch, a lease keep-alive
  on etcd's LeaseKeepAlive stream) run on a blocking channel of the same endpoint, each read
  by a thread of its own, so that ending one is awaitable (see ``etcd_client``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc
import grpc.aio
from google.protobuf.message import Message

from turnout.errors import ConfigError, DiscoveryError
from turnout.runtime.discovery import etcd_v3_pb2 as pb
from turnout.runtime.discovery.base import (
    DELETE_GRACE_SECONDS,
    DiscoveryStore,
    KeyValue,
    WatchEvent,
    WatchEventKind,
)
from turnout.runtime.discovery.etcd_client import (
    LEASE_KEEP_ALIVE,
    WATCH,
    EtcdCalls,
    ThreadStream,
    prefix_range_end,
)
from turnout.runtime.redact import redact_url

logger = logging.getLogger("turnout.runtime.discovery.etcd")

_T = TypeVar("_T")
_M = TypeVar("_M", bound=Message)

#: Backoff of a watch re-opening its stream: first delay, cap.
WATCH_RETRY_MIN_SECONDS = 0.05
WATCH_RETRY_MAX_SECONDS = 2.0

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

#: How long the store remembers a key it reported deleted, at least (see ``_prune_seen``):
#: a caller that got a revision before that deletion and resumes a watch from it within this
#: time, past a compaction, still gets the DELETE.
SEEN_KEY_GRACE_SECONDS = DELETE_GRACE_SECONDS

_TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

#: gRPC codes that end a watch: etcd refused it (credentials, permission, the request). Any
#: other code breaking an open stream is the transport's doing (a reset stream, a closed
#: connection, a proxy's RST_STREAM) and the watch re-opens it.
_FATAL_WATCH_CODES = frozenset(
    {
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


class EtcdUnavailable(DiscoveryError):
    """No endpoint of the etcd store answered in time."""


class _Unreachable(Exception):
    """One endpoint did not answer in time (internal: the caller tries the next one)."""


class _Compacted(Exception):
    """The revision a watch asked for was compacted away (internal)."""


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


def _code(exc: grpc.RpcError) -> grpc.StatusCode:
    """The status code of a failed call: an asyncio call's ``AioRpcError`` and a blocking
    stream's error both carry it (a bare ``RpcError`` without one counts as UNKNOWN)."""
    code = getattr(exc, "code", None)
    result = code() if callable(code) else None
    return result if isinstance(result, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def _one_line(exc: BaseException) -> str:
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
        text = f"{_code(exc).name}: {details}" if details else _code(exc).name
    elif isinstance(exc, TimeoutError):
        text = "timed out"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def _discard(future: asyncio.Future[Any]) -> None:
    """Forget the outcome of a finished watch ``future`` (a cancelled stream read): its
    exception's traceback holds the frames of the read, hence the call, and a live call
    keeps its connection open after the channel closed, until a garbage collection."""
    if not future.done():
        return
    try:
        future.result()
    except BaseException as exc:
        _one_line(exc)


@dataclass(slots=True)
class _Endpoint:
    """One etcd endpoint and, once used, its channels: an asyncio one for the unary calls,
    a blocking one for the streams (see ``etcd_client``)."""

    url: str
    target: str
    channel: grpc.aio.Channel | None = None
    calls: EtcdCalls | None = None
    stream_channel: grpc.Channel | None = None


class EtcdStore(DiscoveryStore):
    """Discovery store in etcd v3; see the module docstring for the design.

    Options: ``endpoints`` (``http://host:port`` or ``https://host:port``, tried in turn;
    a comma-separated string is accepted too), ``ca_cert`` (PEM file of the CA that signed
    etcd's certificate; https endpoints without it trust the system's CAs), ``cert`` and
    ``key`` (PEM files of a client certificate, for etcd's ``--client-cert-auth``), ``user``
    and ``password`` (etcd's auth), ``connect_timeout`` (seconds each call may wait for an
    endpoint, default 5).
    """

    kind = "etcd"

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
            _Endpoint(url, target) for url, (target, _) in zip(self.endpoints, parsed, strict=True)
        ]
        self._current = 0
        self._token: str | None = None
        self._closed = False
        self._closed_event: asyncio.Event | None = None
        self._reachable = True
        #: Every key a caller may know of (a watch reported it, or ``get``/``get_prefix``
        #: returned it) → (revision, present): the revision of its latest version known
        #: while present, else the revision it was known deleted at. A watcher resynced
        #: after a compaction gets a DELETE for each such key that is gone now, unless it is
        #: past that deletion (revision ≤ where it resumes). A DELETE of a key a watcher
        #: never saw is harmless; a ghost key is not. Entries of deleted keys are pruned by
        #: ``_prune_seen``; entries of present keys are as many as the keys.
        self._seen_keys: dict[str, tuple[int, bool]] = {}
        #: (when, revision, key) of each deletion recorded in ``_seen_keys``, oldest first:
        #: what ``_prune_seen`` walks.
        self._gone_log: collections.deque[tuple[float, int, str]] = collections.deque()
        #: Each open watch (by a token of its own) → the revision its consumer is current
        #: at; only deletions after the lowest of these can still be needed by a resync.
        self._watch_positions: dict[object, int] = {}

    def __repr__(self) -> str:
        return f"EtcdStore({self.endpoints})"

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

    def _connect(self, ep: _Endpoint) -> EtcdCalls:
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

    def _stream_channel(self, ep: _Endpoint) -> grpc.Channel:
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
        ep: _Endpoint,
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

    async def _authenticate(self, ep: _Endpoint) -> None:
        """Get a fresh token from ``ep`` (only with ``user``)."""
        assert self.user is not None
        calls = self._connect(ep)
        request = pb.AuthenticateRequest(name=self.user, password=self._password)
        try:
            resp = await calls.authenticate(request, timeout=self.connect_timeout)
        except TimeoutError as exc:
            raise _Unreachable(_one_line(exc)) from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _TRANSIENT_CODES:
                raise _Unreachable(_one_line(exc)) from None
            # etcd answers a wrong password with INVALID_ARGUMENT.
            raise DiscoveryError(
                f"etcd at {ep.url} rejected user {self.user!r}: {_one_line(exc)}"
            ) from None
        self._token = resp.token

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
        self, what: str, fn: Callable[[_Endpoint], Awaitable[_T]], *, retry: bool = True
    ) -> _T:
        """Run ``fn`` on the current endpoint, failing over to the others.

        With ``retry``, rounds over the endpoints repeat with a short backoff until
        ``connect_timeout`` has passed (a restarting etcd or a reconnecting channel answers
        within it); without, one round (start-up checks: a refused connection fails at
        once). Errors become ``DiscoveryError`` naming ``what``.
        """
        self._check_open()
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
                except _Unreachable as exc:
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
        self, what: str, fn: Callable[[_Endpoint], Awaitable[_T]], index: int, deadline: float
    ) -> _T:
        """``fn`` on endpoint ``index``: its result, ``_Unreachable`` when the endpoint did not
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
                    return await fn(ep)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closed and task is not None and task.cancelling() == 0:
                    # gRPC cancels the calls of a closing channel: not our caller's doing.
                    raise DiscoveryError(f"etcd store {self.endpoints} is closed") from None
                raise
            except TimeoutError as exc:
                raise _Unreachable(_one_line(exc)) from None
            except grpc.RpcError as exc:
                code = _code(exc)
                if code in _TRANSIENT_CODES:
                    raise _Unreachable(_one_line(exc)) from None
                if code == grpc.StatusCode.UNAUTHENTICATED and self._retry_auth(reauthenticated):
                    reauthenticated = True
                    continue
                raise DiscoveryError(f"etcd {what}: {_one_line(exc)}") from None

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

    # -- reachability ---------------------------------------------------------------------

    async def check(self) -> None:
        """Raise ``DiscoveryError`` unless some endpoint answers a read (and, with a user,
        accepts the credentials) within ``connect_timeout``."""

        async def ping(ep: _Endpoint) -> None:
            calls = self._connect(ep)
            await calls.range(
                pb.RangeRequest(key=b"\0", count_only=True),
                timeout=self.connect_timeout,
                metadata=self._metadata(),
            )

        await self._call("check", ping, retry=False)

    # -- leases ---------------------------------------------------------------------------

    async def grant_lease(self, ttl: float) -> int:
        """A new etcd lease; ``ttl`` is rounded up to whole seconds (at least 1)."""
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")
        seconds = max(1, math.ceil(ttl))

        async def grant(ep: _Endpoint) -> int:
            calls = self._connect(ep)
            resp = await calls.lease_grant(
                pb.LeaseGrantRequest(TTL=seconds),
                timeout=self.connect_timeout,
                metadata=self._metadata(),
            )
            return int(resp.ID)

        return await self._call("grant lease", grant)

    async def keep_alive(self, lease_id: int) -> bool:
        async def keep(ep: _Endpoint) -> bool:
            # One request on etcd's LeaseKeepAlive stream, then the half-close: etcd answers
            # with the lease's remaining TTL (0: the lease is gone) and ends the call.
            stream = self._open_stream(
                ep,
                LEASE_KEEP_ALIVE,
                pb.LeaseKeepAliveResponse,
                [pb.LeaseKeepAliveRequest(ID=lease_id)],
                keep_open=False,
                timeout=self.connect_timeout,
            )
            try:
                resp = await stream.read()
            finally:
                await stream.close()
            if resp is None:
                raise _Unreachable("keep-alive stream ended without an answer")
            return int(resp.TTL) > 0

        return await self._call(f"keep-alive of lease {lease_id:x}", keep)

    async def revoke_lease(self, lease_id: int) -> None:
        async def revoke(ep: _Endpoint) -> None:
            calls = self._connect(ep)
            try:
                await calls.lease_revoke(
                    pb.LeaseRevokeRequest(ID=lease_id),
                    timeout=self.connect_timeout,
                    metadata=self._metadata(),
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                _one_line(exc)  # already ended: nothing to do (and no cycle kept)

        await self._call(f"revoke of lease {lease_id:x}", revoke)

    # -- keys -----------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, *, lease_id: int | None = None) -> int:
        async def put(ep: _Endpoint) -> int:
            calls = self._connect(ep)
            try:
                resp = await calls.put(
                    pb.PutRequest(key=key.encode(), value=bytes(value), lease=lease_id or 0),
                    timeout=self.connect_timeout,
                    metadata=self._metadata(),
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND and lease_id is not None:
                    _one_line(exc)
                    raise DiscoveryError(
                        f"cannot put {key!r}: lease {lease_id:x} does not exist"
                    ) from None
                raise
            return int(resp.header.revision)

        return await self._call(f"put {key!r}", put)

    async def get(self, key: str) -> KeyValue | None:
        async def get(ep: _Endpoint) -> tuple[KeyValue | None, int]:
            calls = self._connect(ep)
            resp = await calls.range(
                pb.RangeRequest(key=key.encode()),
                timeout=self.connect_timeout,
                metadata=self._metadata(),
            )
            return (self._kv(resp.kvs[0]) if resp.kvs else None), int(resp.header.revision)

        kv, revision = await self._call(f"get {key!r}", get)
        # The caller knows of the key now: a watch it resumes must not leave it a ghost.
        self._learn(key, [] if kv is None else [kv], revision, exact=True)
        return kv

    async def _list(self, prefix: str) -> tuple[list[KeyValue], int]:
        """The keys under ``prefix`` (sorted) and the revision of that listing."""

        async def list_(ep: _Endpoint) -> tuple[list[KeyValue], int]:
            calls = self._connect(ep)
            key, end = self._range(prefix)
            resp = await calls.range(
                pb.RangeRequest(key=key, range_end=end),
                timeout=self.connect_timeout,
                metadata=self._metadata(),
            )
            return [self._kv(kv) for kv in resp.kvs], int(resp.header.revision)

        return await self._call(f"list {prefix!r}", list_)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        kvs, revision = await self._list(prefix)
        # The caller knows of these keys now (it may resume a watch from their revisions, as
        # EndpointClient does): a resync past a compaction must report them if they vanish.
        self._learn(prefix, kvs, revision)
        return kvs

    async def delete(self, key: str) -> bool:
        """Delete ``key``: True when this call deleted it.

        A failed attempt (a timeout, a dropped connection) may have deleted the key without
        the answer arriving; the call then retries, and the retry finds nothing to delete.
        It says True then: the key is gone, and this call may well be what removed it. So
        False always means the key did not exist when this call ran; True after a retry
        means "deleted, by this call or just before it".
        """
        uncertain = False

        async def delete(ep: _Endpoint) -> bool:
            calls = self._connect(ep)
            nonlocal uncertain
            try:
                resp = await calls.delete_range(
                    pb.DeleteRangeRequest(key=key.encode()),
                    timeout=self.connect_timeout,
                    metadata=self._metadata(),
                )
            except BaseException:
                uncertain = True  # the request may have reached etcd and been applied
                raise
            return int(resp.deleted) > 0 or uncertain

        return await self._call(f"delete {key!r}", delete)

    async def compact(self, revision: int) -> None:
        """Drop the history up to ``revision``: watches cannot resume before it any more."""

        async def compact(ep: _Endpoint) -> None:
            calls = self._connect(ep)
            await calls.compact(
                pb.CompactionRequest(revision=revision, physical=True),
                timeout=self.connect_timeout,
                metadata=self._metadata(),
            )

        await self._call(f"compact at {revision}", compact)

    # -- watches --------------------------------------------------------------------------

    def _resync(
        self, prefix: str, kvs: list[KeyValue], after: int, revision: int
    ) -> list[WatchEvent]:
        """Events that bring a watcher current at ``after`` to the listing ``kvs`` at
        ``revision``: PUTs of keys changed since, DELETEs of seen keys that are gone (at the
        listing's revision: when they went is lost to the compaction)."""
        events = [WatchEvent(WatchEventKind.PUT, kv) for kv in kvs if kv.revision > after]
        events.sort(key=lambda e: e.kv.revision)
        present = {kv.key for kv in kvs}
        gone = sorted(
            key
            for key, (seen, known_present) in self._seen_keys.items()
            if key.startswith(prefix) and key not in present and (known_present or seen > after)
        )
        for key in gone:
            events.append(
                WatchEvent(WatchEventKind.DELETE, KeyValue(key=key, value=b"", revision=revision))
            )
        return events

    def _note(self, event: WatchEvent) -> WatchEvent:
        """Remember what ``event`` (about to be delivered) says of its key, for resyncs."""
        if event.kind is WatchEventKind.PUT:
            self._seen_keys[event.kv.key] = (event.kv.revision, True)
        elif event.kv.key in self._seen_keys:
            self._gone(event.kv.key, event.kv.revision)
        return event

    def _gone(self, key: str, revision: int) -> None:
        """Record that ``key`` (known to callers) was deleted at ``revision`` (or by then)."""
        self._seen_keys[key] = (revision, False)
        self._gone_log.append((asyncio.get_running_loop().time(), revision, key))
        self._prune_seen()

    def _learn(self, prefix: str, kvs: list[KeyValue], revision: int, exact: bool = False) -> None:
        """A read returned ``kvs``, the keys under ``prefix`` (or the key ``prefix`` itself,
        with ``exact``) at ``revision``: its caller knows of them now. Keys known present
        that the read found absent are recorded gone by ``revision`` (when exactly is not
        known; later is the safe side: a resync reports them to more resumers, not fewer)."""
        for kv in kvs:
            known = self._seen_keys.get(kv.key)
            # What a watch reported after this read's version of the key stands.
            if known is None or known[0] < kv.revision:
                self._seen_keys[kv.key] = (kv.revision, True)
        present = {kv.key for kv in kvs}
        vanished = [
            key
            for key, (seen, known_present) in self._seen_keys.items()
            if known_present
            and seen <= revision  # else a watch reported it after this read: it stands
            and key not in present
            and (key == prefix if exact else key.startswith(prefix))
        ]
        for key in vanished:
            self._gone(key, revision)

    def _prune_seen(self) -> None:
        """Forget deleted keys no resync can need any more, so ``_seen_keys`` does not grow
        with every key ever seen.

        A recorded deletion at revision D matters only to a watcher resuming from before D.
        Open watches are accounted for: one is pruned only when every open watch is past D
        (``_watch_positions``). A caller between watches (it read with ``get_prefix``, or
        its watch failed and it re-opens after a backoff) holds a revision the store cannot
        see; deletions are kept ``SEEN_KEY_GRACE_SECONDS`` for those. So the map holds the
        present keys callers know of, plus the deletions of the last few minutes and those
        an open watch is still behind: bounded by the churn, not by history.
        """
        if not self._gone_log:
            return
        horizon = asyncio.get_running_loop().time() - SEEN_KEY_GRACE_SECONDS
        lowest = min(self._watch_positions.values(), default=None)
        while self._gone_log:
            when, revision, key = self._gone_log[0]
            if when > horizon or (lowest is not None and revision > lowest):
                return
            self._gone_log.popleft()
            if self._seen_keys.get(key) == (revision, False):  # not put again since
                del self._seen_keys[key]

    async def watch_prefix(
        self, prefix: str, *, start_revision: int | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        if self._closed:
            return
        closed = self._closed_waiter()
        #: The revision the consumer is current at (None: it needs a snapshot first).
        after = start_revision
        #: ``after`` was compacted away: re-list and report the differences.
        resync = False
        delay = WATCH_RETRY_MIN_SECONDS
        token = object()  # this watch's entry in _watch_positions
        if after is not None:
            self._watch_positions[token] = after
        try:
            while not self._closed:
                index = self._current
                try:
                    if after is None or resync:
                        kvs, revision = await self._list(prefix)
                        if after is None:
                            events = [WatchEvent(WatchEventKind.PUT, kv) for kv in kvs]
                            self._learn(prefix, kvs, revision)  # what vanished before
                        else:
                            events = self._resync(prefix, kvs, after, revision)
                        for event in events:
                            yield self._note(event)
                        after, resync = revision, False
                        self._watch_positions[token] = after
                        index = self._current
                    ep = self._endpoints[index]
                    async with contextlib.aclosing(
                        self._stream(ep, prefix, after + 1, closed)
                    ) as stream:
                        async for item in stream:
                            delay = WATCH_RETRY_MIN_SECONDS
                            if isinstance(item, int):
                                # A progress notification: every change up to that revision
                                # has been sent, so a reconnect may resume after it (and a
                                # quiet prefix does not fall behind a compaction).
                                after = max(after, item)
                                self._watch_positions[token] = after
                                continue
                            after = max(after, item.kv.revision)
                            self._watch_positions[token] = after
                            yield self._note(item)
                    return  # the store was closed
                except _Compacted:
                    resync = True
                    continue
                except _Unreachable as exc:
                    self._mark(False, f"{self._endpoints[index].url}: {exc}")
                    self._advance(index)
                except EtcdUnavailable:
                    pass  # _call logged it and moved to the next endpoint
                except DiscoveryError:
                    if self._closed:
                        return
                    raise
                if self._closed:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(closed.wait(), delay)
                delay = min(2 * delay, WATCH_RETRY_MAX_SECONDS)
        finally:
            self._watch_positions.pop(token, None)

    async def _stream(
        self, ep: _Endpoint, prefix: str, start: int, closed: asyncio.Event
    ) -> AsyncGenerator[WatchEvent | int, None]:
        """One watch stream from revision ``start``: its events, and the revision of each
        progress notification (an int: every change up to it was sent). Ends when the store
        closes, raises ``_Unreachable`` when the stream breaks (the transport's doing, see
        ``_FATAL_WATCH_CODES``) and ``_Compacted`` when ``start`` is gone."""
        fresh_token = self.user is not None and self._token is None
        if fresh_token:
            await self._authenticate(ep)
        key, end = self._range(prefix)
        create = pb.WatchRequest(
            create_request=pb.WatchCreateRequest(
                key=key, range_end=end, start_revision=start, progress_notify=True
            )
        )
        stream = self._open_stream(ep, WATCH, pb.WatchResponse, [create], keep_open=True)
        closer = asyncio.ensure_future(closed.wait())
        reader: asyncio.Future[pb.WatchResponse | None] | None = None
        created = False
        try:
            while True:
                # Wait for either a response or the store closing; the creation gets a
                # deadline, an open stream does not (etcd may stay silent for a long time;
                # gRPC keep-alive pings notice a dead peer).
                reader = asyncio.ensure_future(stream.read())
                timeout = None if created else self.connect_timeout
                done, _ = await asyncio.wait(
                    {reader, closer}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if reader not in done:
                    if closer in done:
                        return
                    raise _Unreachable("watch creation timed out")
                try:
                    resp = reader.result()
                except grpc.RpcError as exc:
                    code = _code(exc)
                    if code not in _FATAL_WATCH_CODES:
                        # Transport trouble (a reset stream, a lost connection, a restart):
                        # the caller re-opens the stream with backoff.
                        raise _Unreachable(_one_line(exc)) from None
                    if code == grpc.StatusCode.UNAUTHENTICATED and self.user is not None:
                        self._token = None
                        raise _Unreachable(_one_line(exc)) from None
                    raise DiscoveryError(f"etcd watch of {prefix!r}: {_one_line(exc)}") from None
                if resp is None:
                    if self._closed:
                        return
                    raise _Unreachable("watch stream ended")
                if resp.compact_revision > 0:
                    raise _Compacted()
                if resp.canceled:
                    reason = resp.cancel_reason or "cancelled by etcd"
                    if self.user is not None and not fresh_token:
                        # Likely a token etcd forgot (it restarted) or let expire: retry
                        # once with a fresh one before calling it a refusal.
                        self._token = None
                        raise _Unreachable(reason)
                    raise DiscoveryError(f"etcd watch of {prefix!r}: {reason}")
                if resp.created and not created:
                    created = True
                    self._mark(True)
                elif not resp.events and not resp.created and resp.header.revision > 0:
                    # etcd's progress notification (sent to a watcher that is caught up).
                    yield int(resp.header.revision)
                    continue
                for ev in resp.events:
                    kv = ev.kv
                    if ev.type == pb.Event.DELETE:
                        yield WatchEvent(
                            WatchEventKind.DELETE,
                            KeyValue(
                                key=kv.key.decode(),
                                value=b"",
                                revision=int(kv.mod_revision),
                                lease_id=int(kv.lease) or None,
                            ),
                        )
                    else:
                        yield WatchEvent(WatchEventKind.PUT, self._kv(kv))
        finally:
            closer.cancel()
            await stream.close()
            pending = [f for f in (closer, reader) if f is not None]
            for f in pending:
                f.cancel()
            await asyncio.wait(pending)
            for f in pending:
                _discard(f)
            # This frame may live on in a traceback: let it hold nothing of the call.
            del stream, reader, pending

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._closed_event is not None:
            self._closed_event.set()
        # Let watches see the event and cancel their streams before the channels go.
        await asyncio.sleep(0)
        for ep in self._endpoints:
            if ep.channel is not None:
                channel, ep.channel = ep.channel, None
                await channel.close()
            if ep.stream_channel is not None:
                stream_channel, ep.stream_channel = ep.stream_channel, None
                stream_channel.close()
            ep.calls = None


async def open_etcd_store(**options: Any) -> EtcdStore:
    """An ``EtcdStore`` that answered a read within its connect timeout, or ``ConfigError``
    naming the endpoints (start-up: the caller exits with one line, not a traceback)."""
    store = EtcdStore(**options)
    try:
        await store.check()
    except EtcdUnavailable as exc:
        await store.close()
        reason = str(exc).split(": unreachable at ", 1)[-1].split(": ", 1)[-1]
        raise ConfigError(f"cannot reach etcd at {store.endpoints}: {reason}") from None
    except DiscoveryError as exc:
        await store.close()
        reason = str(exc).removeprefix("etcd check: ")
        if reason.startswith("etcd at "):
            raise ConfigError(reason) from None
        raise ConfigError(f"etcd at {store.endpoints} refused the check: {reason}") from None
    except BaseException:
        await store.close()
        raise
    return store
