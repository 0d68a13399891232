"""Tombstones (what a store keeps of deleted keys, for watchers resuming past its history) do
not grow with every key ever deleted: the memory and file stores drop those older than the
grace that every open watch is past, all of them when no watch is open. A watch that is
behind keeps the ones it still needs, and a resume from its position, past a compacted
history, still reports those deletions. Clocks are injected: nothing waits for the grace."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.polling import eventually

from turnout.runtime.discovery import FileStore, MemoryStore, WatchEvent, WatchEventKind
from turnout.runtime.discovery import file as file_store

GRACE = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def take(watch: AsyncIterator[WatchEvent], n: int) -> list[WatchEvent]:
    async with asyncio.timeout(5):
        return [await anext(watch) for _ in range(n)]


def deletes(events: list[WatchEvent]) -> set[str]:
    return {e.kv.key for e in events if e.kind is WatchEventKind.DELETE}


async def churn(store: MemoryStore | FileStore, prefix: str, n: int) -> int:
    """Put and delete ``n`` keys under ``prefix``; the revision of the last deletion."""
    for i in range(n):
        await store.put(f"{prefix}{i}", b"v")
        await store.delete(f"{prefix}{i}")
    kv = await store.put(f"{prefix}last", b"v")
    await store.delete(f"{prefix}last")
    return kv + 1


# -- memory -----------------------------------------------------------------------------------


async def test_memory_tombstones_go_once_past_the_grace_with_no_watch() -> None:
    clock = Clock()
    store = MemoryStore(clock=clock, delete_grace=GRACE)
    await churn(store, "w/", 50)
    assert len(store._tombstones) == 51  # within the grace: all kept
    clock.now += GRACE + 1
    await churn(store, "x/", 0)  # one more deletion prunes the old ones
    assert set(store._tombstones) == {"x/last"}


async def test_memory_watch_behind_keeps_the_tombstones_it_needs() -> None:
    clock = Clock()
    store = MemoryStore(clock=clock, delete_grace=GRACE)
    start = await store.put("p/keep", b"v")
    behind = store.watch_prefix("p/", start_revision=start)
    first = asyncio.ensure_future(anext(behind))  # open; its consumer reads nothing yet
    await eventually(lambda: len(store._watchers) == 1, what="the watch open")
    await churn(store, "p/", 5)
    clock.now += GRACE + 1
    await churn(store, "q/", 5)  # prunes: the q/ deletions are young, p/ ones are needed
    assert {f"p/{i}" for i in range(5)} <= set(store._tombstones)

    # Resuming from where the lagging watch stands, past a compacted history, still reports
    # every deletion it has not seen.
    await store.compact(await store.put("r/", b"v"))
    resumed = store.watch_prefix("p/", start_revision=start)
    assert deletes(await take(resumed, 6)) == {*(f"p/{i}" for i in range(5)), "p/last"}
    await resumed.aclose()

    # Once the lagging watch has read everything, nothing holds them: the next prune drops.
    await first
    await take(behind, 11)  # 6 puts and 6 deletes in all, the first already read
    clock.now += GRACE + 1
    before = len(store._tombstones)
    await churn(store, "z/", 0)
    assert len(store._tombstones) < before
    assert set(store._tombstones) == {"z/last"}
    await behind.aclose()
    await store.close()


# -- file -------------------------------------------------------------------------------------


@pytest.fixture
def small_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trim (and prune) every 4 revisions, keep 8 in the log."""
    monkeypatch.setattr(file_store, "HISTORY_LIMIT", 8)
    monkeypatch.setattr(file_store, "_TRIM_EVERY", 4)


def count(path: Path, table: str) -> int:
    db = sqlite3.connect(path)
    try:
        (n,) = db.execute(f"SELECT count(*) FROM {table}").fetchone()
        return int(n)
    finally:
        db.close()


@pytest.mark.usefixtures("small_log")
async def test_file_tombstones_go_once_past_the_grace_with_no_watch(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "d.sqlite"
    store = FileStore(path, poll_interval=0.01, clock=clock, delete_grace=GRACE)
    try:
        await churn(store, "w/", 20)
        assert count(path, "tombstones") == 21
        clock.now += GRACE + 1
        await churn(store, "x/", 4)  # passes a trim: the w/ tombstones go
        assert count(path, "tombstones") <= 5
    finally:
        await store.close()


@pytest.mark.usefixtures("small_log")
async def test_file_watch_behind_keeps_what_it_needs_and_resyncs(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "d.sqlite"
    store = FileStore(path, poll_interval=0.01, clock=clock, delete_grace=GRACE)
    # Another process's view of the same file: its open watch is a row every process sees.
    other = FileStore(path, poll_interval=0.01, clock=clock, delete_grace=GRACE)
    try:
        start = await store.put("p/keep", b"v")
        behind = other.watch_prefix("p/", start_revision=start)
        first = asyncio.ensure_future(anext(behind))
        await eventually(lambda: count(path, "watchers") == 1, what="the watch's row")
        await churn(store, "p/", 3)
        # Its consumer takes the first change, then stalls: it reads nothing more for a while.
        await eventually(first.done, what="the first change")
        clock.now += GRACE + 1
        await churn(store, "q/", 10)  # the log is trimmed past the p/ deletions, pruned
        assert count(path, "tombstones") >= 4  # p/0..2 and p/last: it has not passed them
        await behind.aclose()
        assert count(path, "watchers") == 0

        # A resume from that position (after the log was trimmed past it) still learns
        # what vanished.
        resumed = other.watch_prefix("p/", start_revision=start)
        assert deletes(await take(resumed, 4)) == {"p/0", "p/1", "p/2", "p/last"}
        await resumed.aclose()

        clock.now += GRACE + 1
        await churn(store, "z/", 4)
        assert count(path, "tombstones") <= 5  # nobody behind: only the young ones stay
    finally:
        await other.close()
        await store.close()


@pytest.mark.usefixtures("small_log")
async def test_file_watch_rows_of_a_dead_process_are_dropped(tmp_path: Path) -> None:
    """A process killed with its watch open leaves its row; the next trim finds its pid gone,
    drops the row, and prunes past it."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await proc.wait()  # its pid names no process now
    clock = Clock()
    path = tmp_path / "d.sqlite"
    store = FileStore(path, poll_interval=0.01, clock=clock, delete_grace=GRACE)
    try:
        await store.put("a", b"v")
        db = sqlite3.connect(path)
        db.execute("INSERT INTO watchers (pid, position) VALUES (?, 0)", (proc.pid,))
        db.commit()
        db.close()
        await churn(store, "w/", 6)
        clock.now += GRACE + 1
        await churn(store, "x/", 4)
        assert count(path, "watchers") == 0
        assert count(path, "tombstones") <= 5
    finally:
        await store.close()


async def test_file_store_close_removes_its_watch_rows(tmp_path: Path) -> None:
    path = tmp_path / "d.sqlite"
    store = FileStore(path, poll_interval=0.01)
    await store.open()
    watch = store.watch_prefix("p/", start_revision=0)
    pending = asyncio.ensure_future(anext(watch))
    await eventually(lambda: count(path, "watchers") == 1, what="the watch's row")
    await store.close()
    assert count(path, "watchers") == 0
    with contextlib.suppress(StopAsyncIteration):
        await pending  # the watch ends with its store


async def test_file_watch_row_removed_under_it_is_written_again(tmp_path: Path) -> None:
    """A row dropped while its watch lives (its pid read as gone from another pid namespace)
    comes back at the watch's next position update."""
    clock = Clock()
    path = tmp_path / "d.sqlite"
    store = FileStore(path, poll_interval=0.01, clock=clock, delete_grace=GRACE)
    try:
        start = await store.put("p/a", b"v")
        watch = store.watch_prefix("p/", start_revision=start)
        pending = asyncio.ensure_future(anext(watch))
        await eventually(lambda: count(path, "watchers") == 1, what="the watch's row")
        db = sqlite3.connect(path)
        db.execute("DELETE FROM watchers")
        db.commit()
        db.close()
        clock.now += file_store._POSITION_EVERY
        await store.put("q/other", b"v")  # the watch moves past it: a position to write
        await eventually(lambda: count(path, "watchers") == 1, what="the row written again")
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await watch.aclose()
    finally:
        await store.close()
