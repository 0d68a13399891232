"""The etcd discovery store against what only a real, disruptible etcd shows: start-up checks,
fail-over, outages, restarts, network cuts past compaction, pauses and auth.

The contract itself (leases, watches, resume, compaction) runs on etcd in test_discovery.py.
Tests that disrupt etcd start their own (about 0.1 s); the others share the module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from tests.runtime.conftest import start_etcd
from tests.servers.etcd import EtcdServer, make_tls_files

from turnout.errors import ConfigError, DiscoveryError
from turnout.runtime.discovery import (
    EtcdStore,
    WatchEvent,
    WatchEventKind,
    open_store,
)
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
    await etcd_server.wipe()
    store = EtcdStore(etcd_server.endpoints)
    try:
        lease_id = await store.grant_lease(0.2)
        await store.put("k", b"v", lease_id=lease_id)
        await asyncio.sleep(0.4)  # past 0.2 s: etcd's lease is a whole second
        assert await store.get("k") is not None
        assert await store.keep_alive(lease_id) is True
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
    await own_etcd.enable_auth("turnout", "s3cret")
    endpoints = own_etcd.endpoints
    with pytest.raises(ConfigError, match="rejected user 'turnout'"):
        await open_store("etcd", endpoints=endpoints, user="turnout", password="wrong")
    with pytest.raises(ConfigError, match=r"etcd at \['http"):
        await open_store("etcd", endpoints=endpoints)  # no credentials
    store = await open_store("etcd", endpoints=endpoints, user="turnout", password="s3cret")
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
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
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
