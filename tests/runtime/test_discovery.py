"""Discovery stores against the DiscoveryStore contract: the ``store`` fixture runs each
contract test on ``memory``, ``file`` and ``etcd`` (a real etcd; see conftest.py). Tests of one
kind only say so in their names; etcd's own (restarts, outages, auth) are in
test_discovery_etcd.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from turnout.errors import ConfigError, DiscoveryError
from turnout.runtime.discovery import (
    DiscoveryStore,
    EtcdStore,
    FileStore,
    MemoryStore,
    WatchEvent,
    WatchEventKind,
    default_file_store_path,
    make_store,
    open_store,
)
from turnout.runtime.discovery import file as file_store
from turnout.runtime.lease import Lease

PUT, DELETE = WatchEventKind.PUT, WatchEventKind.DELETE


async def take(watch: AsyncIterator[WatchEvent], n: int, timeout: float = 3.0) -> list[WatchEvent]:
    async with asyncio.timeout(timeout):
        return [await anext(watch) for _ in range(n)]


def brief(events: list[WatchEvent]) -> list[tuple[WatchEventKind, str, bytes]]:
    return [(e.kind, e.kv.key, e.kv.value) for e in events]


def unordered(events: list[WatchEvent]) -> set[tuple[WatchEventKind, str, bytes]]:
    return set(brief(events))


async def test_put_get_prefix_delete(store: DiscoveryStore) -> None:
    r1 = await store.put("a/1", b"one")
    r2 = await store.put("a/2", b"two")
    r3 = await store.put("b/1", b"other")
    assert (r2, r3) == (r1 + 1, r1 + 2)
    kv = await store.get("a/1")
    assert kv is not None and (kv.value, kv.revision, kv.lease_id) == (b"one", r1, None)
    assert [kv.key for kv in await store.get_prefix("a/")] == ["a/1", "a/2"]
    assert await store.put("a/1", b"uno") == r3 + 1
    assert (await store.get("a/1")).value == b"uno"  # type: ignore[union-attr]
    assert await store.delete("a/1") is True
    assert await store.delete("a/1") is False
    assert await store.get("a/1") is None
    assert [kv.key for kv in await store.get_prefix("")] == ["a/2", "b/1"]


async def test_watch_snapshot_then_changes(store: DiscoveryStore) -> None:
    await store.put("p/a", b"1")
    await store.put("p/b", b"2")
    watch = store.watch_prefix("p/")
    try:
        assert brief(await take(watch, 2)) == [(PUT, "p/a", b"1"), (PUT, "p/b", b"2")]
        await store.put("q/x", b"not watched")
        await store.put("p/c", b"3")
        await store.delete("p/a")
        events = await take(watch, 2)
        assert brief(events) == [(PUT, "p/c", b"3"), (DELETE, "p/a", b"")]
        assert events[1].kv.revision == events[0].kv.revision + 1
    finally:
        await watch.aclose()


async def test_watch_resumes_after_revision(store: DiscoveryStore) -> None:
    await store.put("p/a", b"1")
    rev = await store.put("p/b", b"2")
    await store.put("p/c", b"3")
    await store.delete("p/b")
    watch = store.watch_prefix("p/", start_revision=rev)
    try:
        assert brief(await take(watch, 2)) == [(PUT, "p/c", b"3"), (DELETE, "p/b", b"")]
        await store.put("p/d", b"4")
        assert brief(await take(watch, 1)) == [(PUT, "p/d", b"4")]
    finally:
        await watch.aclose()


async def test_lease_expiry_deletes_keys_for_watchers(store: DiscoveryStore) -> None:
    lease_id = await store.grant_lease(0.3)
    await store.put("p/leased", b"x", lease_id=lease_id)
    await store.put("p/kept", b"y")
    watch = store.watch_prefix("p/")
    try:
        assert {e.kv.key for e in await take(watch, 2)} == {"p/leased", "p/kept"}
        # etcd rounds the TTL up to 1 s and checks expiry twice a second.
        (event,) = await take(watch, 1, timeout=5.0)
        assert (event.kind, event.kv.key) == (DELETE, "p/leased")
        assert await store.get("p/leased") is None
        assert await store.get("p/kept") is not None
        assert await store.keep_alive(lease_id) is False
    finally:
        await watch.aclose()


async def test_keep_alive_keeps_keys_and_revoke_ends_them(store: DiscoveryStore) -> None:
    lease = await Lease.grant(store, 0.3)
    await store.put("p/k", b"v", lease_id=lease.id)
    await asyncio.sleep(1.0)  # > 3 TTLs: only the keep-alive task keeps the key
    kv = await store.get("p/k")
    assert kv is not None and kv.lease_id == lease.id
    assert not lease.lost.is_set()
    watch = store.watch_prefix("p/")
    try:
        await take(watch, 1)
        await lease.revoke()
        await lease.revoke()  # idempotent
        (event,) = await take(watch, 1)
        assert (event.kind, event.kv.key) == (DELETE, "p/k")
        assert await store.keep_alive(lease.id) is False
    finally:
        await watch.aclose()


async def test_lease_lost_when_ended_elsewhere(store: DiscoveryStore) -> None:
    lease = await Lease.grant(store, 0.3)
    await store.revoke_lease(lease.id)
    async with asyncio.timeout(2.0):
        await lease.lost.wait()
    await lease.revoke()


async def test_watch_delivers_every_change_in_revision_order(store: DiscoveryStore) -> None:
    await store.put("p/start", b"")
    watch = store.watch_prefix("p/")
    try:
        await take(watch, 1)  # the snapshot: the watch is open
        expected = []
        for i in range(30):
            key = f"p/{i % 4}"
            if i % 7 == 6:
                if await store.delete(key):
                    expected.append((DELETE, key, b""))
            else:
                await store.put(key, str(i).encode())
                expected.append((PUT, key, str(i).encode()))
        events = await take(watch, len(expected))
        assert brief(events) == expected
        revisions = [e.kv.revision for e in events]
        assert revisions == sorted(set(revisions))
    finally:
        await watch.aclose()


async def test_many_watchers_on_one_prefix_see_lease_keys_vanish(store: DiscoveryStore) -> None:
    lease_id = await store.grant_lease(30)
    await store.put("p/a", b"1", lease_id=lease_id)
    await store.put("p/b", b"2", lease_id=lease_id)
    await store.put("p/c", b"3")
    watches = [store.watch_prefix("p/") for _ in range(8)]
    try:
        for watch in watches:
            assert unordered(await take(watch, 3)) == {
                (PUT, "p/a", b"1"),
                (PUT, "p/b", b"2"),
                (PUT, "p/c", b"3"),
            }
        await store.revoke_lease(lease_id)
        for watch in watches:
            assert sorted(brief(await take(watch, 2))) == [
                (DELETE, "p/a", b""),
                (DELETE, "p/b", b""),
            ]
        assert [kv.key for kv in await store.get_prefix("p/")] == ["p/c"]
        await store.put("p/d", b"4")
        for watch in watches:  # nothing else came in between
            assert brief(await take(watch, 1)) == [(PUT, "p/d", b"4")]
    finally:
        for watch in watches:
            await watch.aclose()


async def test_resume_past_compaction_reports_what_vanished(store: DiscoveryStore) -> None:
    """A watcher away while its revision was compacted comes back to the right keys: the
    changed and added ones as PUTs, the vanished ones as DELETEs, no ghost."""
    await store.put("p/gone", b"1")
    await store.put("p/kept", b"2")
    await store.put("p/changed", b"3")
    lease_id = await store.grant_lease(30)
    await store.put("p/leased", b"4", lease_id=lease_id)
    watch = store.watch_prefix("p/")
    try:
        seen = await take(watch, 4)
    finally:
        await watch.aclose()
    resume_at = max(e.kv.revision for e in seen)
    # While the watcher is away: changes, deletions, a lease ending, then compaction.
    await store.delete("p/gone")
    await store.put("p/changed", b"33")
    await store.put("p/new", b"5")
    await store.revoke_lease(lease_id)
    last = await store.put("q/other", b"")
    await store.compact(last)

    watch = store.watch_prefix("p/", start_revision=resume_at)
    try:
        events = await take(watch, 4)
        revisions = [e.kv.revision for e in events]
        assert revisions == sorted(revisions) and min(revisions) > resume_at
        assert unordered(events) == {
            (PUT, "p/changed", b"33"),
            (PUT, "p/new", b"5"),
            (DELETE, "p/gone", b""),
            (DELETE, "p/leased", b""),
        }
        # Then the stream goes on, from after the resync.
        await store.put("p/after", b"6")
        assert brief(await take(watch, 1)) == [(PUT, "p/after", b"6")]
    finally:
        await watch.aclose()


async def test_resume_from_get_prefix_past_compaction_reports_what_vanished(
    store: DiscoveryStore,
) -> None:
    """A caller that learned the keys by ``get_prefix`` (no watch ever reported them) and
    resumes a watch from the newest revision it read, past a compaction, is told of the keys
    that vanished meanwhile."""
    await store.put("p/gone", b"1")
    lease_id = await store.grant_lease(30)
    await store.put("p/leased", b"2", lease_id=lease_id)
    await store.put("p/kept", b"3")
    kvs = await store.get_prefix("p/")
    resume_at = max(kv.revision for kv in kvs)
    await store.delete("p/gone")
    await store.revoke_lease(lease_id)
    await store.put("p/new", b"4")
    await store.compact(await store.put("q/other", b""))

    watch = store.watch_prefix("p/", start_revision=resume_at)
    try:
        events = await take(watch, 3)
        assert unordered(events) == {
            (DELETE, "p/gone", b""),
            (DELETE, "p/leased", b""),
            (PUT, "p/new", b"4"),
        }
        await store.put("p/after", b"5")
        assert brief(await take(watch, 1)) == [(PUT, "p/after", b"5")]
    finally:
        await watch.aclose()


async def test_put_under_unknown_lease_fails(store: DiscoveryStore) -> None:
    with pytest.raises(DiscoveryError, match="lease"):
        await store.put("k", b"v", lease_id=12345)


async def test_watch_ends_when_store_closes(store: DiscoveryStore) -> None:
    watch = store.watch_prefix("p/")
    waiter = asyncio.ensure_future(anext(watch, None))
    await asyncio.sleep(0.05)
    await store.close()
    async with asyncio.timeout(2.0):
        assert await waiter is None


async def test_two_file_stores_on_one_path_see_each_other(tmp_path: Path) -> None:
    a = FileStore(tmp_path / "d.sqlite", poll_interval=0.02)
    b = FileStore(tmp_path / "d.sqlite", poll_interval=0.02)
    watch = b.watch_prefix("p/")
    try:
        lease_id = await a.grant_lease(0.3)
        await a.put("p/x", b"1", lease_id=lease_id)
        assert brief(await take(watch, 1)) == [(PUT, "p/x", b"1")]
        assert await b.keep_alive(lease_id) is True  # leases are shared too
        # Nobody keeps it alive now: b's polling sweeps it.
        assert brief(await take(watch, 1)) == [(DELETE, "p/x", b"")]
    finally:
        await watch.aclose()
        await a.close()
        await b.close()


async def test_file_store_resume_before_trimmed_log_gets_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(file_store, "HISTORY_LIMIT", 10)
    monkeypatch.setattr(file_store, "_TRIM_EVERY", 5)
    store = FileStore(tmp_path / "d.sqlite", poll_interval=0.02)
    try:
        first = await store.put("p/0", b"0")
        for i in range(1, 30):
            await store.put(f"p/{i % 3}", str(i).encode())
        watch = store.watch_prefix("p/", start_revision=first)
        try:
            events = await take(watch, 3)
            assert brief(events) == [(PUT, "p/0", b"27"), (PUT, "p/1", b"28"), (PUT, "p/2", b"29")]
        finally:
            await watch.aclose()
    finally:
        await store.close()


async def test_file_store_resume_before_trimmed_log_reports_deletions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deletions fall out of the trimmed log; their tombstones still tell a late watcher,
    even one in another process that never saw the keys."""
    monkeypatch.setattr(file_store, "HISTORY_LIMIT", 10)
    monkeypatch.setattr(file_store, "_TRIM_EVERY", 5)
    store = FileStore(tmp_path / "d.sqlite", poll_interval=0.02)
    try:
        first = await store.put("p/x", b"x")
        await store.put("p/y", b"y")
        await store.delete("p/x")
        for i in range(30):
            await store.put("q/filler", str(i).encode())
        watch = store.watch_prefix("p/", start_revision=first)
        try:
            assert brief(await take(watch, 2)) == [(PUT, "p/y", b"y"), (DELETE, "p/x", b"")]
        finally:
            await watch.aclose()
    finally:
        await store.close()


def test_make_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_store("memory"), MemoryStore)
    file = make_store("file", str(tmp_path / "x.sqlite"))
    assert isinstance(file, FileStore) and file.path == str(tmp_path / "x.sqlite")
    file._executor.shutdown()
    monkeypatch.setenv("TURNOUT_STORE_PATH", str(tmp_path / "env.sqlite"))
    assert default_file_store_path() == str(tmp_path / "env.sqlite")
    monkeypatch.delenv("TURNOUT_STORE_PATH")
    assert default_file_store_path().endswith("/discovery.sqlite")
    with pytest.raises(ConfigError, match="etcd, file, memory"):
        make_store("zookeeper")
    etcd = make_store("etcd", endpoints=["http://h1:2379", "http://h2:12379"], connect_timeout=1)
    assert isinstance(etcd, EtcdStore) and etcd.endpoints == ["http://h1:2379", "http://h2:12379"]
    assert make_store("etcd", endpoints="http://a:1,http://b:2").endpoints == [  # type: ignore[attr-defined]
        "http://a:1",
        "http://b:2",
    ]
    # Unset CLI flags arrive as None: not an option given.
    assert isinstance(make_store("memory", user=None), MemoryStore)
    with pytest.raises(ConfigError, match="file discovery store does not take endpoints"):
        make_store("file", str(tmp_path / "y.sqlite"), endpoints=["http://h:2379"])
    with pytest.raises(ConfigError, match="etcd discovery store does not take colour"):
        make_store("etcd", colour="blue")
    with pytest.raises(ConfigError, match="both cert and key"):
        make_store("etcd", endpoints=["https://h:2379"], cert="c.pem")
    with pytest.raises(ConfigError, match="mix http and https"):
        make_store("etcd", endpoints=["https://h:2379", "http://g:2379"])
    with pytest.raises(ConfigError, match=r"ca_cert '/nonexistent\.pem'"):
        make_store("etcd", endpoints=["https://h:2379"], ca_cert="/nonexistent.pem")
    with pytest.raises(ConfigError, match="scheme"):
        make_store("etcd", endpoints=["nats://h:4222"])
    with pytest.raises(ConfigError, match="user/password"):
        make_store("etcd", endpoints=["http://root:pw@h:2379"])


@pytest.mark.parametrize("kind", ["memory", "file"])
async def test_open_store_embedded(kind: str, tmp_path: Path) -> None:
    store = await open_store(kind, str(tmp_path / "o.sqlite"))
    try:
        assert store.kind == kind
        await store.put("k", b"v")
    finally:
        await store.close()
