"""The file store under faults of its machine: clock steps, reboots, a file deleted or replaced
under running processes, and polls that have nothing to read. Clocks are injected; nothing
here depends on how fast the machine is."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from turnout.errors import DiscoveryError
from turnout.runtime.discovery import FileStore, WatchEventKind
from turnout.runtime.discovery import file as file_store


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def path(tmp_path: Path) -> AsyncIterator[str]:
    yield str(tmp_path / "d.sqlite")


def test_monotonic_clock_is_clock_monotonic() -> None:
    a = file_store.monotonic_clock()
    assert abs(a - time.clock_gettime(time.CLOCK_MONOTONIC)) < 1.0
    assert file_store.monotonic_clock() >= a


@pytest.mark.skipif(not os.path.exists(file_store._BOOT_ID_PATH), reason="no boot id here")
def test_boot_id_is_read() -> None:
    assert len(file_store.boot_id()) == 36


async def test_wall_clock_steps_change_no_deadline(
    path: str, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileStore(path, clock=clock, boot="b")
    try:
        lease = await store.grant_lease(10)
        await store.put("k", b"v", lease_id=lease)
        # The wall clock jumps a day forward, then a day back: nothing expires, nothing lives on.
        for step in (86_400.0, -86_400.0):
            monkeypatch.setattr(time, "time", lambda step=step: 1.7e9 + step)
            clock.now += 5
            assert await store.keep_alive(lease)
            assert await store.get("k") is not None
        clock.now += 10.5  # the store's clock passes the deadline
        assert await store.get("k") is None
        assert not await store.keep_alive(lease)
    finally:
        await store.close()


async def test_leases_of_another_boot_end_when_the_file_is_opened(
    path: str, clock: FakeClock
) -> None:
    before = FileStore(path, clock=clock, boot="boot-1")
    lease = await before.grant_lease(30)
    await before.put("w/k", b"v", lease_id=lease)
    rev = await before.put("w/plain", b"kept")
    await before.close()

    same = FileStore(path, clock=clock, boot="boot-1")
    assert await same.get("w/k") is not None  # same boot: nothing ends
    await same.close()

    # A reboot: the monotonic clock starts again, so old deadlines mean nothing.
    after = FileStore(path, clock=FakeClock(), boot="boot-2")
    try:
        assert await after.get("w/k") is None
        assert await after.get("w/plain") is not None
        assert not await after.keep_alive(lease)
        watch = after.watch_prefix("w/", start_revision=rev)
        async with asyncio.timeout(5):
            event = await anext(watch)
        assert (event.kind, event.kv.key) == (WatchEventKind.DELETE, "w/k")
        await watch.aclose()
    finally:
        await after.close()


async def test_a_file_from_before_monotonic_deadlines_is_adopted(path: str) -> None:
    """Wall-clock deadlines (no boot id in the file) are ended on open."""
    db = sqlite3.connect(path)
    db.executescript(file_store._SCHEMA.replace("CREATE TABLE IF NOT EXISTS clock", "--"))
    db.execute("DROP TABLE IF EXISTS clock")
    db.execute("INSERT INTO leases VALUES (7, 10, ?)", (time.time() + 10,))
    db.execute("INSERT INTO kv VALUES ('k', x'00', 7, 1)")
    db.execute("UPDATE meta SET value=1 WHERE name='revision'")
    db.commit()
    db.close()
    store = FileStore(path)
    try:
        assert await store.get("k") is None
    finally:
        await store.close()


async def test_a_deadline_no_process_could_write_is_ended(path: str, clock: FakeClock) -> None:
    """Further ahead than its TTL: written on another clock (an older turnout, say)."""
    store = FileStore(path, clock=clock, boot="b")
    try:
        good = await store.grant_lease(10)
        await store.put("good", b"", lease_id=good)
        bad = await store.grant_lease(10)
        await store.put("bad", b"", lease_id=bad)
        db = sqlite3.connect(path)
        db.execute("UPDATE leases SET expires_at=? WHERE id=?", (clock.now + 1e9, bad))
        db.commit()
        db.close()
        clock.now += 1
        assert await store.get("bad") is None
        assert await store.get("good") is not None
    finally:
        await store.close()


@pytest.mark.parametrize("how", ["deleted", "replaced"])
async def test_a_deleted_or_replaced_file_fails_every_call_loudly(
    path: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="turnout.runtime")
    store = FileStore(path, poll_interval=0.0)
    try:
        lease = await store.grant_lease(10)
        await store.put("w/k", b"v", lease_id=lease)
        watch = store.watch_prefix("w/")
        assert (await anext(watch)).kv.key == "w/k"
        os.unlink(path)
        if how == "replaced":
            newcomer = FileStore(path)
            await newcomer.put("x", b"")
            await newcomer.close()
        with pytest.raises(DiscoveryError, match=f"file store {path} was deleted or replaced"):
            await store.keep_alive(lease)
        with pytest.raises(DiscoveryError, match=path):
            await store.get("w/k")
        with pytest.raises(DiscoveryError, match=path):
            async with asyncio.timeout(5):
                await anext(watch)
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1  # logged once, however many calls fail
        assert path in errors[0] and "Restart" in errors[0]
    finally:
        await store.close()


async def test_polls_skip_the_log_when_nobody_committed(path: str) -> None:
    store = FileStore(path)
    other = FileStore(path)
    try:
        await store.put("p/a", b"1")
        (_, after) = await store._call(store._snapshot, "p/")
        events, after = await store._call(store._changes, "p/", after)
        reads = store.log_reads
        for _ in range(5):
            events, after = await store._call(store._changes, "p/", after)
            assert events == []
        assert store.log_reads == reads  # five polls, no read of the log

        await other.put("p/b", b"2")  # another connection commits
        events, after = await store._call(store._changes, "p/", after)
        assert [e.kv.key for e in events] == ["p/b"]
        assert store.log_reads == reads + 1
        await store.put("p/c", b"3")  # this connection commits: data_version does not move
        events, after = await store._call(store._changes, "p/", after)
        assert [e.kv.key for e in events] == ["p/c"]
        # A watcher further behind still reads what it missed.
        events, _ = await store._call(store._changes, "p/", 0)
        assert [e.kv.key for e in events] == ["p/a", "p/b", "p/c"]
    finally:
        await store.close()
        await other.close()


def test_default_path_per_deployment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from turnout.errors import ConfigError
    from turnout.runtime.discovery import default_file_store_path

    monkeypatch.delenv("TURNOUT_STORE_PATH", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)  # else preferred to /tmp
    uid = os.getuid()
    assert default_file_store_path() == f"/tmp/turnout-{uid}/discovery.sqlite"
    assert (
        default_file_store_path("serve-8000") == f"/tmp/turnout-{uid}/serve-8000/discovery.sqlite"
    )
    for bad in ("", "a/b", ".."):
        with pytest.raises(ConfigError, match="one path component"):
            default_file_store_path(bad)
    monkeypatch.setenv("TURNOUT_STORE_PATH", str(tmp_path / "env.sqlite"))
    assert default_file_store_path("serve-8000") == str(tmp_path / "env.sqlite")


def test_serve_default_store_is_per_port(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two ``turnout serve`` trees on one machine do not share a store; ``--store-path`` and
    ``TURNOUT_STORE_PATH`` still choose one."""
    from turnout.cli.main import build_parser
    from turnout.cli.serve import ServeTree

    monkeypatch.delenv("TURNOUT_STORE_PATH", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)  # else preferred to /tmp

    def store_path(*argv: str) -> str:
        args = build_parser().parse_args(["serve", "--engine", "echo", *argv])
        return ServeTree(args).store_path

    uid = os.getuid()
    assert store_path("--port", "8001") == f"/tmp/turnout-{uid}/serve-8001/discovery.sqlite"
    assert store_path("--port", "8002") == f"/tmp/turnout-{uid}/serve-8002/discovery.sqlite"
    given = str(tmp_path / "mine.sqlite")
    assert store_path("--port", "8001", "--store-path", given) == given
    monkeypatch.setenv("TURNOUT_STORE_PATH", given)
    assert store_path("--port", "8001") == given


async def test_a_sweep_refused_the_lock_gives_no_lease_time_back(
    path: str, clock: FakeClock
) -> None:
    """A sweep waits only briefly for the write lock and then gives up by design: that is
    no stall, and the process's next ordinary write must not push deadlines out (a deadline
    beyond a full TTL from now reads as foreign, and the sweep would end a healthy lease)."""
    a = FileStore(path, poll_interval=0.0, clock=clock, boot="b")
    b = FileStore(path, poll_interval=0.0, clock=clock, boot="b")
    try:
        await a.get("warm-up")
        await b.grant_lease(1.0)  # a worker that dies: its lease expires, a sweep is due
        healthy = await b.grant_lease(10.0)
        await b.put("v1/instances/healthy", b"x", lease_id=healthy)
        clock.now += 2.0
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # someone holds the lock for a moment
        await a.get("nothing")  # its sweep is refused the lock
        other.execute("COMMIT")
        other.close()
        clock.now += 1.5
        assert await b.keep_alive(healthy)
        clock.now += 0.5
        await a.grant_lease(10.0)  # an ordinary, uncontended write
        clock.now += 0.01
        assert await a.get("v1/instances/healthy") is not None
        assert await b.keep_alive(healthy)
    finally:
        await a.close()
        await b.close()
