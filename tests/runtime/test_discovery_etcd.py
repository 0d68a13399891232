"""The etcd discovery store against what only a real, disruptible etcd shows: start-up checks,
fail-over, outages, restarts, network cuts past compaction, pauses and auth.

The contract itself (leases, watches, resume, compaction) runs on etcd in test_discovery.py.
Tests that disrupt etcd start their own (about 0.1 s); the others share the module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from tests.runtime.conftest import start_etcd
from tests.servers.etcd import EtcdServer, etcd_binary, make_tls_files
from tests.servers.process import require

from turnout.errors import ConfigError, DiscoveryError
from turnout.runtime.discovery import (
    EtcdStore,
    KeyValue,
    WatchEvent,
    WatchEventKind,
    open_store,
)
from turnout.runtime.discovery import etcd_watch as etcd_module
from turnout.runtime.lease import Lease

PUT, DELETE = WatchEventKind.PUT, WatchEventKind.DELETE


async def take(watch: AsyncIterator[WatchEvent], n: int, timeout: float = 10.0) -> list[WatchEvent]:
    async with asyncio.timeout(timeout):
        return [await anext(watch) for _ in range(n)]


def brief(events: list[WatchEvent]) -> list[tuple[WatchEventKind, str, bytes]]:
    return [(e.kind, e.kv.key, e.kv.value) for e in events]


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd for one test, free to kill, pause or lock down."""
    server = start_etcd(tmp_path / "etcd")
    try:
        yield server
    finally:
        server.kill()


class Proxy:
    """A TCP relay on a fixed local port to a target: ``cut()`` drops every connection and
    refuses new ones (a network outage between one client and etcd), ``restore()`` heals it."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def restore(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        self._writers.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            up_reader, upstream = await asyncio.open_connection(*self.target)
            self._writers.add(upstream)
            await asyncio.gather(self._pump(reader, upstream), self._pump(up_reader, writer))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for w in (writer, upstream):
                if w is not None:
                    w.transport.abort()
                    self._writers.discard(w)
            self._tasks.discard(task)  # type: ignore[arg-type]

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.transport.abort()


# -- start-up ---------------------------------------------------------------------------------


async def test_open_store_checks_etcd_answers(etcd_server: EtcdServer) -> None:
    await etcd_server.wipe()
    store = await open_store("etcd", endpoints=etcd_server.endpoints, connect_timeout=5)
    try:
        assert isinstance(store, EtcdStore) and store.kind == "etcd"
        await store.put("k", b"v")
        assert (await store.get("k")).value == b"v"  # type: ignore[union-attr]
    finally:
        await store.close()


async def test_open_store_refused_endpoint_is_one_config_error_at_once() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        await open_store("etcd", endpoints=[url], connect_timeout=5)
    assert time.monotonic() - started < 3.0  # refused: no need to wait out the timeout
    message = str(info.value)
    assert message.startswith(f"cannot reach etcd at ['{url}']: ")
    assert "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


async def test_open_store_silent_endpoint_times_out() -> None:
    """An address that accepts connections but never speaks (a hung host, a wrong service
    behind a firewall): the check gives up after connect_timeout."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(ConfigError, match=r"cannot reach etcd at \['http://127\.0\.0\.1:"):
            await open_store("etcd", endpoints=[url], connect_timeout=0.5)
        assert time.monotonic() - started < 3.0


async def test_fails_over_to_an_endpoint_that_answers(etcd_server: EtcdServer) -> None:
    await etcd_server.wipe()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    store = await open_store("etcd", endpoints=[dead, etcd_server.url], connect_timeout=2)
    try:
        rev = await store.put("k", b"v")
        watch = store.watch_prefix("k")
        try:
            assert brief(await take(watch, 1)) == [(PUT, "k", b"v")]
            assert rev == (await store.get("k")).revision  # type: ignore[union-attr]
        finally:
            await watch.aclose()
    finally:
        await store.close()


async def test_etcd_on_another_loopback_address(tmp_path: Path) -> None:
    server = start_etcd(tmp_path / "etcd", host="127.0.0.4")
    try:
        assert server.url.startswith("http://127.0.0.4:")
        store = await open_store("etcd", endpoints=server.endpoints)
        try:
            await store.put("k", b"v")
        finally:
            await store.close()
    finally:
        server.kill()


async def test_fractional_ttl_is_rounded_up(etcd_server: EtcdServer) -> None:
    """What the store asks etcd for, not what etcd grants: the test etcd's minimum is 1 s,
    so 1.2 s rounded down (or to nearest) would be granted 1 s, rounded up 2 s."""
    await etcd_server.wipe()
    store = EtcdStore(etcd_server.endpoints)
    try:
        assert await etcd_server.lease_granted_ttl(await store.grant_lease(1.2)) == 2
        assert await etcd_server.lease_granted_ttl(await store.grant_lease(2.0)) == 2
        assert await etcd_server.lease_granted_ttl(await store.grant_lease(0.2)) == 1
        assert await etcd_server.lease_granted_ttl(await store.grant_lease(2.01)) == 3
    finally:
        await store.close()


async def test_keep_alive_does_not_wait_for_watches_opened_beside_it(
    etcd_server: EtcdServer,
) -> None:
    """A keep-alive settles its own gRPC stream only, not one of a watch opened meanwhile
    (whose stream lives on): it takes milliseconds, not the 1 s settling timeout."""
    await etcd_server.wipe()
    store = EtcdStore(etcd_server.endpoints)
    lease_id = await store.grant_lease(10)
    watches: list[AsyncIterator[WatchEvent]] = []
    waiters: list[asyncio.Future[WatchEvent | None]] = []
    try:
        worst = 0.0
        for i in range(5):
            keep = asyncio.ensure_future(store.keep_alive(lease_id))
            watch = store.watch_prefix(f"w{i}/")
            watches.append(watch)
            waiters.append(asyncio.ensure_future(anext(watch, None)))  # opens the stream
            started = time.monotonic()
            assert await keep is True
            worst = max(worst, time.monotonic() - started)
        assert worst < 0.5
    finally:
        await store.close()
        for waiter in waiters:
            assert await waiter is None
        for watch in watches:
            with contextlib.suppress(StopAsyncIteration):
                await watch.aclose()


async def test_delete_retried_after_a_lost_answer_says_deleted(etcd_server: EtcdServer) -> None:
    """The first attempt deletes the key but its answer is lost (a timeout): the retry finds
    nothing, and the call still says True (it may well have deleted it); a key that never
    existed is still False."""
    await etcd_server.wipe()
    store = EtcdStore(etcd_server.endpoints)
    try:
        await store.put("k", b"v")
        calls = store._endpoints[0].calls
        assert calls is not None
        real_delete = calls.delete_range
        attempts = 0

        async def lossy_delete(*args: Any, **kwargs: Any) -> Any:
            nonlocal attempts
            attempts += 1
            resp = await real_delete(*args, **kwargs)
            if attempts == 1:
                raise TimeoutError  # applied by etcd, answer lost
            return resp

        calls.delete_range = lossy_delete
        assert await store.delete("k") is True
        assert attempts == 2 and await store.get("k") is None
        attempts = 10  # no more losses
        assert await store.delete("never") is False
    finally:
        await store.close()


# -- outages ----------------------------------------------------------------------------------


async def test_calls_fail_with_discovery_error_while_etcd_is_down(own_etcd: EtcdServer) -> None:
    store = EtcdStore(own_etcd.endpoints, connect_timeout=0.5)
    try:
        lease_id = await store.grant_lease(5)
        own_etcd.kill()
        started = time.monotonic()
        for call in (
            store.put("k", b"v"),
            store.get("k"),
            store.get_prefix(""),
            store.delete("k"),
            store.keep_alive(lease_id),
            store.grant_lease(1),
        ):
            with pytest.raises(DiscoveryError, match=r"unreachable at \['http://127\.0\.0\.1:"):
                await call
        assert time.monotonic() - started < 6 * 2.0
        own_etcd.start()
        # The store recovers by itself once its channel has reconnected (gRPC's backoff may
        # outlast one 0.5 s call on a loaded machine).
        async with asyncio.timeout(10):
            while True:
                try:
                    await store.put("k", b"back")
                    break
                except DiscoveryError:
                    await asyncio.sleep(0.1)
        assert await store.keep_alive(lease_id) is True
    finally:
        await store.close()


async def test_paused_etcd_times_out_calls(own_etcd: EtcdServer) -> None:
    store = EtcdStore(own_etcd.endpoints, connect_timeout=0.5)
    try:
        await store.put("k", b"v")
        own_etcd.pause()
        started = time.monotonic()
        with pytest.raises(DiscoveryError, match="unreachable"):
            await store.get("k")
        assert time.monotonic() - started < 3.0
        own_etcd.resume()
        assert (await store.get("k")).value == b"v"  # type: ignore[union-attr]
    finally:
        await store.close()


async def test_watch_survives_etcd_restart_without_missing_or_repeating(
    own_etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="turnout.runtime.discovery.etcd")
    store = EtcdStore(own_etcd.endpoints, connect_timeout=5)
    writer = EtcdStore(own_etcd.endpoints, connect_timeout=5)
    watch = store.watch_prefix("p/")
    try:
        await writer.put("p/0", b"0")
        assert brief(await take(watch, 1)) == [(PUT, "p/0", b"0")]
        await writer.put("p/1", b"1")
        assert brief(await take(watch, 1)) == [(PUT, "p/1", b"1")]
        own_etcd.kill()
        own_etcd.start()  # same data, same ports
        # Written before the watch is back: it resumes from its revision and gets them.
        await writer.put("p/2", b"2")
        await writer.delete("p/0")
        events = await take(watch, 2)
        assert brief(events) == [(PUT, "p/2", b"2"), (DELETE, "p/0", b"")]
        await writer.put("p/3", b"3")
        (event,) = await take(watch, 1)
        assert brief([event]) == [(PUT, "p/3", b"3")]
        assert event.kv.revision == events[1].kv.revision + 1
    finally:
        await watch.aclose()
        await writer.close()
        await store.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("etcd unreachable at") for m in messages)
    assert messages[-1].startswith("etcd reachable again at")


async def test_watch_cut_off_past_compaction_reports_what_vanished(
    etcd_server: EtcdServer,
) -> None:
    """The watcher's network drops; meanwhile keys change and vanish and etcd compacts. When
    it comes back, the watch re-lists by itself: ghosts are reported gone."""
    await etcd_server.wipe()
    proxy = Proxy(etcd_server.host, etcd_server.client_port)
    await proxy.restore()
    watcher = EtcdStore([proxy.url], connect_timeout=1)
    writer = EtcdStore(etcd_server.endpoints)
    watch = watcher.watch_prefix("p/")
    try:
        for key in ("p/a", "p/b", "p/c"):
            await writer.put(key, b"1")
        assert len(await take(watch, 3)) == 3
        await proxy.cut()
        await writer.delete("p/a")
        await writer.put("p/b", b"2")
        await writer.put("p/d", b"1")
        await writer.compact(await writer.put("q/other", b""))
        await proxy.restore()
        events = await take(watch, 3)
        assert set(brief(events)) == {(DELETE, "p/a", b""), (PUT, "p/b", b"2"), (PUT, "p/d", b"1")}
        await writer.put("p/e", b"1")
        assert brief(await take(watch, 1)) == [(PUT, "p/e", b"1")]
        # A second cut past compaction reports only what is new: p/a's DELETE was delivered.
        await proxy.cut()
        await writer.put("p/f", b"1")
        await writer.compact(await writer.put("q/other", b""))
        await proxy.restore()
        assert brief(await take(watch, 1)) == [(PUT, "p/f", b"1")]
        await writer.put("p/g", b"1")
        assert brief(await take(watch, 1)) == [(PUT, "p/g", b"1")]
    finally:
        await watch.aclose()
        await watcher.close()
        await writer.close()
        await proxy.cut()


async def test_resume_after_get_prefix_past_compaction_behind_a_cut(
    etcd_server: EtcdServer,
) -> None:
    """What EndpointClient does: get_prefix, then a watch from the newest revision read. A
    key that goes while the network is cut and etcd compacts is reported gone, although no
    watch of this store ever reported it."""
    await etcd_server.wipe()
    proxy = Proxy(etcd_server.host, etcd_server.client_port)
    await proxy.restore()
    reader = EtcdStore([proxy.url], connect_timeout=1)
    writer = EtcdStore(etcd_server.endpoints)
    watch: AsyncIterator[WatchEvent] | None = None
    try:
        await writer.put("p/a", b"1")
        await writer.put("p/b", b"1")
        kvs = await reader.get_prefix("p/")
        watch = reader.watch_prefix("p/", start_revision=max(kv.revision for kv in kvs))
        await writer.put("p/c", b"1")
        assert brief(await take(watch, 1)) == [(PUT, "p/c", b"1")]
        await proxy.cut()
        await writer.delete("p/a")
        await writer.compact(await writer.put("q/other", b""))
        await proxy.restore()
        assert brief(await take(watch, 1)) == [(DELETE, "p/a", b"")]
        await writer.put("p/d", b"1")
        assert brief(await take(watch, 1)) == [(PUT, "p/d", b"1")]
    finally:
        if watch is not None:
            await watch.aclose()
        await reader.close()
        await writer.close()
        await proxy.cut()


async def test_quiet_watch_resumes_after_progress_without_relisting(tmp_path: Path) -> None:
    """etcd's progress notifications move a quiet watch's resume point: cut off after a
    compaction of revisions it never needed, it resumes by revision, without a re-list."""
    require("etcd", etcd_binary() is not None)
    server = EtcdServer(tmp_path / "etcd", progress_notify_interval=0.1).start()
    proxy = Proxy(server.host, server.client_port)
    await proxy.restore()
    watcher = EtcdStore([proxy.url], connect_timeout=1)
    writer = EtcdStore(server.endpoints)
    watch = watcher.watch_prefix("p/")
    listings = 0
    real_list = watcher._list

    async def counting_list(prefix: str) -> tuple[list[KeyValue], int]:
        nonlocal listings
        listings += 1
        return await real_list(prefix)

    watcher._list = counting_list  # type: ignore[method-assign]
    try:
        await writer.put("p/a", b"1")
        assert brief(await take(watch, 1)) == [(PUT, "p/a", b"1")]
        assert listings == 1  # the snapshot
        # The consumer waits on the watch (as EndpointClient does) while others write: the
        # watched prefix stays quiet.
        waiter = asyncio.ensure_future(anext(watch))
        for i in range(5):
            last = await writer.put(f"q/{i}", b"")
        await asyncio.sleep(0.5)  # a few progress notifications
        await writer.compact(last)
        await proxy.cut()
        await proxy.restore()
        await writer.put("p/b", b"1")
        async with asyncio.timeout(10):
            assert brief([await waiter]) == [(PUT, "p/b", b"1")]
        # Resumed by revision: one listing checks the store still has the history the watch
        # followed (it may have been restored meanwhile), and no re-list of events follows.
        assert listings == 2
    finally:
        await watch.aclose()
        await watcher.close()
        await writer.close()
        await proxy.cut()
        server.kill()


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"),
        (grpc.StatusCode.UNKNOWN, "Stream removed"),
        (grpc.StatusCode.CANCELLED, "Cancelled"),
    ],
)
async def test_watch_reset_by_the_transport_reconnects(
    etcd_server: EtcdServer, code: grpc.StatusCode, details: str
) -> None:
    """Stream resets that gRPC reports with codes other than UNAVAILABLE re-open the watch
    instead of ending it."""
    await etcd_server.wipe()
    store = EtcdStore(etcd_server.endpoints)
    resets = _break_watch_streams(store, code, details, times=2)
    watch = store.watch_prefix("p/")
    try:
        await store.put("p/a", b"1")
        assert brief(await take(watch, 1)) == [(PUT, "p/a", b"1")]
        await store.put("p/b", b"1")
        assert brief(await take(watch, 1)) == [(PUT, "p/b", b"1")]
        assert resets() == 2
    finally:
        await watch.aclose()
        await store.close()


async def test_watch_refused_by_etcd_fails(etcd_server: EtcdServer) -> None:
    """A refusal (permission denied) is not retried: the watch fails with one line."""
    await etcd_server.wipe()
    store = EtcdStore(etcd_server.endpoints)
    _break_watch_streams(store, grpc.StatusCode.PERMISSION_DENIED, "permission denied", times=1)
    watch = store.watch_prefix("p/")
    try:
        with pytest.raises(DiscoveryError, match="PERMISSION_DENIED: permission denied"):
            await take(watch, 1)
    finally:
        await watch.aclose()
        await store.close()


class _BrokenStream:
    """A watch stream that fails at once with a given gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.error = grpc.aio.AioRpcError(
            code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details
        )

    async def read(self) -> Any:
        raise self.error

    async def close(self) -> None:
        pass


def _break_watch_streams(
    store: EtcdStore, code: grpc.StatusCode, details: str, times: int
) -> Callable[[], int]:
    """Make the first ``times`` watch streams of ``store`` fail with ``code``; returns a
    function that says how many did."""
    real_open = store._open_stream
    broken = 0

    def open_stream(ep: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        nonlocal broken
        if path == etcd_module.WATCH and broken < times:
            broken += 1
            return _BrokenStream(code, details)
        return real_open(ep, path, *args, **kwargs)

    store._open_stream = open_stream  # type: ignore[method-assign]
    return lambda: broken


async def test_seen_keys_forget_deletions_no_watch_needs(
    etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys that came and went are not remembered forever: once every open watch is past
    their deletion (and the grace for callers between watches is over), they are dropped,
    while a watch still behind a deletion keeps it."""
    monkeypatch.setattr(etcd_module, "SEEN_KEY_GRACE_SECONDS", 0.0)
    await etcd_server.wipe()
    store = EtcdStore(etcd_server.endpoints)
    watch = store.watch_prefix("p/")
    try:
        await store.put("p/kept", b"1")
        assert len(await take(watch, 1)) == 1
        for i in range(50):
            await store.put(f"p/{i}", b"1")
            await store.delete(f"p/{i}")
        assert len(await take(watch, 100)) == 100
        await store.put("p/last", b"1")
        assert len(await take(watch, 1)) == 1
        # Present keys stay; of the 50 deleted ones, none is left.
        assert set(store._seen.keys) == {"p/kept", "p/last"}
        # A watch behind a deletion (resuming from before it) keeps it remembered.
        start = await store.put("p/x", b"1")
        await store.get("p/x")
        late = store.watch_prefix("p/", start_revision=start - 1)
        try:
            assert brief(await take(late, 1)) == [(PUT, "p/x", b"1")]
            await store.delete("p/x")
            assert brief(await take(watch, 2))[-1] == (DELETE, "p/x", b"")
            assert "p/x" in store._seen.keys  # the late watch has not delivered it yet
            assert brief(await take(late, 1)) == [(DELETE, "p/x", b"")]
            await store.put("p/y", b"1")
            await take(watch, 1)
            await take(late, 1)
            assert "p/x" not in store._seen.keys
        finally:
            await late.aclose()
    finally:
        await watch.aclose()
        await store.close()


async def test_lease_keep_alive_outlives_a_short_outage(own_etcd: EtcdServer) -> None:
    """The Lease's keep-alive retries store errors for a TTL: an etcd restart shorter than
    that loses nothing."""
    store = EtcdStore(own_etcd.endpoints, connect_timeout=0.5)
    try:
        lease = await Lease.grant(store, 3)
        await store.put("k", b"v", lease_id=lease.id)
        own_etcd.kill()
        await asyncio.sleep(0.3)
        own_etcd.start()
        await asyncio.sleep(1.5)  # more than one keep-alive interval after the restart
        assert not lease.lost.is_set()
        assert await store.get("k") is not None
        await lease.revoke()
        assert await store.get("k") is None
    finally:
        await store.close()


# -- auth -------------------------------------------------------------------------------------


async def test_user_and_password(own_etcd: EtcdServer) -> None:
    await own_etcd.enable_auth("turnout", "sk-turnout-test-s3cret")
    endpoints = own_etcd.endpoints
    with pytest.raises(ConfigError, match="rejected user 'turnout'"):
        await open_store(
            "etcd", endpoints=endpoints, user="turnout", password="sk-turnout-test-wrong"
        )
    with pytest.raises(ConfigError, match=r"etcd at \['http"):
        await open_store("etcd", endpoints=endpoints)  # no credentials
    store = await open_store(
        "etcd", endpoints=endpoints, user="turnout", password="sk-turnout-test-s3cret"
    )
    watch = store.watch_prefix("p/")
    try:
        await store.put("p/a", b"1")
        assert brief(await take(watch, 1)) == [(PUT, "p/a", b"1")]
        # A restarted etcd forgets its tokens: calls and the watch authenticate again.
        own_etcd.kill()
        own_etcd.start()
        await store.put("p/b", b"2")
        assert brief(await take(watch, 1)) == [(PUT, "p/b", b"2")]
    finally:
        await watch.aclose()
        await store.close()


async def test_mutual_tls(tmp_path: Path) -> None:
    """https endpoints with a CA and a client certificate; etcd requires the certificate."""
    require("openssl")
    tls = make_tls_files(tmp_path / "tls")
    server = start_etcd(tmp_path / "etcd", tls=tls)
    try:
        endpoints = server.endpoints
        assert endpoints[0].startswith("https://")
        store = await open_store(
            "etcd",
            endpoints=endpoints,
            ca_cert=str(tls.ca),
            cert=str(tls.client_cert),
            key=str(tls.client_key),
        )
        watch = store.watch_prefix("p/")
        try:
            await store.put("p/a", b"1")
            assert brief(await take(watch, 1)) == [(PUT, "p/a", b"1")]
        finally:
            await watch.aclose()
            await store.close()
        with pytest.raises(ConfigError, match=r"cannot reach etcd at \['https://"):
            # No client certificate: etcd ends the handshake.
            await open_store("etcd", endpoints=endpoints, ca_cert=str(tls.ca), connect_timeout=2)
    finally:
        server.kill()


async def test_closing_ends_watches_waiting_on_a_dead_etcd(own_etcd: EtcdServer) -> None:
    store = EtcdStore(own_etcd.endpoints, connect_timeout=0.5)
    watch = store.watch_prefix("p/")
    await store.put("p/a", b"1")
    assert len(await take(watch, 1)) == 1
    own_etcd.kill()
    waiter = asyncio.ensure_future(anext(watch, None))
    await asyncio.sleep(0.3)  # the watch is retrying now
    await store.close()
    async with asyncio.timeout(3):
        assert await waiter is None
    with contextlib.suppress(StopAsyncIteration):
        await watch.aclose()
