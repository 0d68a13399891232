"""The watches of the etcd store: one gRPC stream per watch, re-opened by the store itself.

* A watch is one gRPC stream that the store re-opens itself when it breaks (etcd restarted,
  network lost), at the revision after the last one it delivered, with backoff and without
  the consumer noticing beyond a delay. When that revision was compacted meanwhile, the watch
  re-lists the prefix and emits what changed as events: PUTs for keys added or changed since,
  DELETEs for keys that vanished (``SeenKeys`` remembers every key its watches reported and
  every key ``get``/``get_prefix`` returned, so a key that is gone now is reported gone,
  never left as a ghost), then streams from the listing's revision. The same applies when a
  caller resumes with a compacted ``start_revision``, e.g. after the revision of a
  ``get_prefix``. Progress notifications of a quiet watch advance the revision it resumes
  from, so a reconnect seldom lands before a compaction at all.
* A store restored from a snapshot or rebuilt empty has revisions below those a watch holds:
  resuming there would wait for a revision the store may take long to reach, missing every
  change on the way. So when an answer shows the store's revision went back (see
  ``EtcdConnection.generation``), or etcd creates a watch at a head below where it was asked
  to start, the watch re-lists its prefix as if resuming from the start of history: PUTs of
  every key present, DELETEs of every key it knew that is gone. A store that was restored
  while a process could not reach it may have got back past that revision by other changes
  meanwhile; so a watch whose stream broke lists its prefix once before it resumes, and
  re-lists as above unless every key there from before its revision is one it knows, at
  that version (``SeenKeys.matches``).
* A watch stream broken by the transport (gRPC UNAVAILABLE, DEADLINE_EXCEEDED, and the
  resets proxies and restarts produce: INTERNAL "RST_STREAM", UNKNOWN "Stream removed",
  CANCELLED) is re-opened; a watch creation that gets no answer reconnects (a new channel,
  a fresh token); only etcd's refusals (permission, a bad request) end the watch with
  ``DiscoveryError``. An invalid token is dropped and the stream re-opened with a fresh one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncGenerator, Callable

import grpc

from turnout.errors import DiscoveryError
from turnout.runtime.discovery import etcd_v3_pb2 as pb
from turnout.runtime.discovery.base import (
    DELETE_GRACE_SECONDS,
    KeyValue,
    WatchEvent,
    WatchEventKind,
)
from turnout.runtime.discovery.etcd_client import WATCH
from turnout.runtime.discovery.etcd_connection import (
    Endpoint,
    EtcdAuthRejected,
    EtcdConnection,
    EtcdUnavailable,
    Unreachable,
    discard_outcome,
    one_line,
    status_code,
)

#: Backoff of a watch re-opening its stream: first delay, cap.
WATCH_RETRY_MIN_SECONDS = 0.05
WATCH_RETRY_MAX_SECONDS = 2.0

#: How long the store remembers a key it reported deleted, at least (see ``SeenKeys.prune``):
#: a caller that got a revision before that deletion and resumes a watch from it within this
#: time, past a compaction, still gets the DELETE.
SEEN_KEY_GRACE_SECONDS = DELETE_GRACE_SECONDS

#: gRPC codes that end a watch: etcd refused it (credentials, permission, the request). Any
#: other code breaking an open stream is the transport's doing (a reset stream, a closed
#: connection, a proxy's RST_STREAM) and the watch re-opens it.
FATAL_WATCH_CODES = frozenset(
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


class _Compacted(Exception):
    """The revision a watch asked for was compacted away (internal)."""


class _Restored(Exception):
    """The store's history is not the one the watch's revision belongs to (internal)."""


class SeenKeys:
    """What the store's callers may know of, so that a resync never leaves a ghost key.

    ``keys``: every key a caller may know of (a watch reported it, or ``get``/``get_prefix``
    returned it) → (revision, present): the revision of its latest version known while
    present, else the revision it was known deleted at. A watcher resynced after a
    compaction gets a DELETE for each such key that is gone now, unless it is past that
    deletion (revision ≤ where it resumes). A DELETE of a key a watcher never saw is
    harmless; a ghost key is not. Entries of deleted keys are pruned by ``prune``; entries
    of present keys are as many as the keys.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.keys: dict[str, tuple[int, bool]] = {}
        #: (when, revision, key) of each deletion recorded in ``keys``, oldest first: what
        #: ``prune`` walks.
        self._gone_log: collections.deque[tuple[float, int, str]] = collections.deque()
        #: Each open watch (by a token of its own) → the revision its consumer is current
        #: at; only deletions after the lowest of these can still be needed by a resync.
        self.positions: dict[object, int] = {}

    def restored(self) -> None:
        """The store was restored or rebuilt: its revisions start over. Keys known present
        stay known, from before any revision (a resync reports them gone if they are); the
        deletions, dated in the earlier history, are dropped (their keys are reported gone
        to nobody: a DELETE of a key known gone is not needed)."""
        self.keys = {key: (0, True) for key, (_, present) in self.keys.items() if present}
        self._gone_log.clear()
        for token in self.positions:
            self.positions[token] = 0

    def resync(
        self, prefix: str, kvs: list[KeyValue], after: int | None, revision: int
    ) -> list[WatchEvent]:
        """Events that bring a watcher current at ``after`` to the listing ``kvs`` at
        ``revision``: PUTs of keys changed since, DELETEs of seen keys that are gone (at the
        listing's revision: when they went is lost to the compaction). ``after`` None: the
        watcher's revision belongs to an earlier history of the store (restored, rebuilt):
        PUTs of every key, DELETEs of the keys known present that are gone."""
        since = 0 if after is None else after
        events = [WatchEvent(WatchEventKind.PUT, kv) for kv in kvs if kv.revision > since]
        events.sort(key=lambda e: e.kv.revision)
        present = {kv.key for kv in kvs}
        gone = sorted(
            key
            for key, (seen, known_present) in self.keys.items()
            if key.startswith(prefix)
            and key not in present
            and (known_present or (after is not None and seen > after))
        )
        for key in gone:
            events.append(
                WatchEvent(WatchEventKind.DELETE, KeyValue(key=key, value=b"", revision=revision))
            )
        return events

    def matches(self, prefix: str, kvs: list[KeyValue], after: int) -> bool:
        """Whether the current listing ``kvs`` of ``prefix`` can follow the history the
        store's watches reported up to ``after``: every key listed at a version from then
        or before is known at that very version. (A key known only from later says nothing
        of it; a key gone since may have been deleted after ``after``.) False means the
        store's history is another one: it was restored or rebuilt, and reached ``after``
        again by other changes."""
        for kv in kvs:
            if kv.revision > after:
                continue
            known = self.keys.get(kv.key)
            if known is None or (known[0] <= after and known != (kv.revision, True)):
                return False
        return True

    def note(self, event: WatchEvent) -> WatchEvent:
        """Remember what ``event`` (about to be delivered) says of its key, for resyncs."""
        if event.kind is WatchEventKind.PUT:
            self.keys[event.kv.key] = (event.kv.revision, True)
        elif event.kv.key in self.keys:
            self._gone(event.kv.key, event.kv.revision)
        return event

    def _gone(self, key: str, revision: int) -> None:
        """Record that ``key`` (known to callers) was deleted at ``revision`` (or by then)."""
        self.keys[key] = (revision, False)
        self._gone_log.append((self._clock(), revision, key))
        self.prune()

    def learn(self, prefix: str, kvs: list[KeyValue], revision: int, exact: bool = False) -> None:
        """A read returned ``kvs``, the keys under ``prefix`` (or the key ``prefix`` itself,
        with ``exact``) at ``revision``: its caller knows of them now. Keys known present
        that the read found absent are recorded gone by ``revision`` (when exactly is not
        known; later is the safe side: a resync reports them to more resumers, not fewer)."""
        for kv in kvs:
            known = self.keys.get(kv.key)
            # What a watch reported after this read's version of the key stands.
            if known is None or known[0] < kv.revision:
                self.keys[kv.key] = (kv.revision, True)
        present = {kv.key for kv in kvs}
        vanished = [
            key
            for key, (seen, known_present) in self.keys.items()
            if known_present
            and seen <= revision  # else a watch reported it after this read: it stands
            and key not in present
            and (key == prefix if exact else key.startswith(prefix))
        ]
        for key in vanished:
            self._gone(key, revision)

    def prune(self) -> None:
        """Forget deleted keys no resync can need any more, so ``keys`` does not grow
        with every key ever seen.

        A recorded deletion at revision D matters only to a watcher resuming from before D.
        Open watches are accounted for: one is pruned only when every open watch is past D
        (``positions``). A caller between watches (it read with ``get_prefix``, or
        its watch failed and it re-opens after a backoff) holds a revision the store cannot
        see; deletions are kept ``SEEN_KEY_GRACE_SECONDS`` for those. So the map holds the
        present keys callers know of, plus the deletions of the last few minutes and those
        an open watch is still behind: bounded by the churn, not by history.
        """
        if not self._gone_log:
            return
        horizon = self._clock() - SEEN_KEY_GRACE_SECONDS
        lowest = min(self.positions.values(), default=None)
        while self._gone_log:
            when, revision, key = self._gone_log[0]
            if when > horizon or (lowest is not None and revision > lowest):
                return
            self._gone_log.popleft()
            if self.keys.get(key) == (revision, False):  # not put again since
                del self.keys[key]


class EtcdWatches(EtcdConnection):
    """The watch half of ``EtcdStore`` (see the module docstring); the store sets ``_seen``."""

    _seen: SeenKeys

    def _store_restored(self) -> None:
        self._seen.restored()

    async def watch_prefix(
        self, prefix: str, *, start_revision: int | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        if self._closed:
            return
        closed = self._closed_waiter()
        seen = self._seen
        #: The revision the consumer is current at (None: it needs a snapshot first).
        after = start_revision
        #: The store generation ``after`` belongs to.
        generation = self.generation
        #: ``after`` was compacted away: re-list and report the differences.
        resync = False
        #: ``after`` belongs to an earlier history of the store: re-list, report it all.
        restored = False
        #: The stream broke (etcd restarted, or the network): before streaming again from
        #: ``after``, check the store still has the history the watch followed.
        broken = False
        delay = WATCH_RETRY_MIN_SECONDS
        token = object()  # this watch's entry in seen.positions
        if after is not None:
            seen.positions[token] = after
        try:
            while not self._closed:
                index = self._current
                try:
                    if after is not None and generation != self.generation:
                        resync = restored = True
                    elif broken and after is not None and not resync:
                        # etcd may have been restored or rebuilt meanwhile and have reached
                        # ``after`` again by other changes: the listing tells.
                        kvs, _ = await self._list(prefix)
                        resync = restored = not seen.matches(prefix, kvs, after)
                    broken = False
                    if after is None or resync:
                        generation = self.generation
                        kvs, revision = await self._list(prefix)
                        if generation != self.generation:
                            continue  # the listing itself found the store restored
                        if after is None:
                            events = [WatchEvent(WatchEventKind.PUT, kv) for kv in kvs]
                            seen.learn(prefix, kvs, revision)  # what vanished before
                        else:
                            events = seen.resync(prefix, kvs, None if restored else after, revision)
                        for event in events:
                            yield seen.note(event)
                        after, resync, restored = revision, False, False
                        seen.positions[token] = after
                        index = self._current
                    ep = self._endpoints[index]
                    async with contextlib.aclosing(
                        self._stream(ep, prefix, after + 1, closed, generation)
                    ) as stream:
                        async for item in stream:
                            delay = WATCH_RETRY_MIN_SECONDS
                            if isinstance(item, int):
                                # A progress notification: every change up to that revision
                                # has been sent, so a reconnect may resume after it (and a
                                # quiet prefix does not fall behind a compaction).
                                after = max(after, item)
                                seen.positions[token] = after
                                continue
                            after = max(after, item.kv.revision)
                            seen.positions[token] = after
                            yield seen.note(item)
                    return  # the store was closed
                except _Compacted:
                    resync = True
                    continue
                except _Restored:
                    resync = restored = True
                    continue
                except Unreachable as exc:
                    broken = True
                    self._mark(False, f"{self._endpoints[index].url}: {exc}")
                    self._advance(index)
                except EtcdUnavailable:
                    broken = True  # _call logged it and moved to the next endpoint
                except EtcdAuthRejected as exc:
                    broken = True
                    # At start the check refused such credentials; now it is an etcd being
                    # rebuilt, its users not yet re-created: retried, logged once.
                    self._mark(False, str(exc))
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
            seen.positions.pop(token, None)

    async def _stream(
        self, ep: Endpoint, prefix: str, start: int, closed: asyncio.Event, generation: int
    ) -> AsyncGenerator[WatchEvent | int, None]:
        """One watch stream from revision ``start``: its events, and the revision of each
        progress notification (an int: every change up to it was sent). Ends when the store
        closes, raises ``Unreachable`` when the stream breaks (the transport's doing, see
        ``FATAL_WATCH_CODES``) or its creation gets no answer, ``_Compacted`` when ``start``
        is gone and ``_Restored`` when the store is not of ``generation`` any more or its
        head is below ``start - 1`` (restored or rebuilt: ``start`` belongs to a history the
        store lost)."""
        fresh_token = self.user is not None and self._token is None
        if fresh_token:
            await self._authenticate(ep)
        key, end = self._range(prefix)
        create = pb.WatchRequest(
            create_request=pb.WatchCreateRequest(
                key=key, range_end=end, start_revision=start, progress_notify=True
            )
        )
        floor = self._floor()
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
                    self.reconnect_streams(ep)
                    raise Unreachable("watch creation timed out; reconnecting")
                try:
                    resp = reader.result()
                except grpc.RpcError as exc:
                    code = status_code(exc)
                    if code not in FATAL_WATCH_CODES:
                        # Transport trouble (a reset stream, a lost connection, a restart):
                        # the caller re-opens the stream with backoff.
                        raise Unreachable(one_line(exc)) from None
                    if code == grpc.StatusCode.UNAUTHENTICATED and self.user is not None:
                        self._token = None
                        raise Unreachable(one_line(exc)) from None
                    raise DiscoveryError(f"etcd watch of {prefix!r}: {one_line(exc)}") from None
                if resp is None:
                    if self._closed:
                        return
                    raise Unreachable("watch stream ended")
                if resp.created or not resp.events:
                    # The creation and progress notifications carry the member's revision
                    # (an event batch carries its events' own: older while catching up).
                    self._observe(resp.header, floor)
                if self.generation != generation:
                    raise _Restored()
                if resp.compact_revision > 0:
                    raise _Compacted()
                if resp.canceled:
                    reason = resp.cancel_reason or "cancelled by etcd"
                    if self.user is not None and not fresh_token:
                        # Likely a token etcd forgot (it restarted) or let expire: retry
                        # once with a fresh one before calling it a refusal.
                        self._token = None
                        raise Unreachable(reason)
                    raise DiscoveryError(f"etcd watch of {prefix!r}: {reason}")
                if resp.created and not created:
                    created = True
                    self._mark(True)
                    if 0 < resp.header.revision < start - 1:
                        # Asked to start past the store's head: etcd would skip every
                        # change until it got there.
                        raise _Restored()
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
                discard_outcome(f)
            # This frame may live on in a traceback: let it hold nothing of the call.
            del stream, reader, pending

    async def _list(self, prefix: str) -> tuple[list[KeyValue], int]:
        """The keys under ``prefix`` (sorted) and the revision of that listing."""

        async def list_(ep: Endpoint) -> tuple[list[KeyValue], int]:
            calls = self._connect(ep)
            floor = self._floor()
            key, end = self._range(prefix)
            resp = await calls.range(
                pb.RangeRequest(key=key, range_end=end),
                timeout=self.connect_timeout,
                metadata=self._metadata(),
            )
            self._observe(resp.header, floor)
            return [self._kv(kv) for kv in resp.kvs], int(resp.header.revision)

        return await self._call(f"list {prefix!r}", list_)
