"""The file store across OS processes: a SIGKILLed process's leased keys vanish for others."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from turnout.runtime.discovery import FileStore, WatchEventKind
from turnout.runtime.lease import Lease

CHILD = """
import asyncio, sys
from turnout.runtime.discovery import FileStore
from turnout.runtime.lease import Lease

async def main() -> None:
    store = FileStore(sys.argv[1], poll_interval=0.02)
    lease = await Lease.grant(store, float(sys.argv[2]))
    await store.put("w/child", b"alive", lease_id=lease.id)
    print("ready", flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""

TTL = 0.5


async def test_sigkilled_process_keys_vanish_for_watcher(tmp_path: Path) -> None:
    path = str(tmp_path / "d.sqlite")
    store = FileStore(path, poll_interval=0.02)
    watch = store.watch_prefix("w/")
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, path, str(TTL), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        async with asyncio.timeout(20):
            assert (await child.stdout.readline()).strip() == b"ready"
            event = await anext(watch)
        assert (event.kind, event.kv.key) == (WatchEventKind.PUT, "w/child")
        # Alive well past its TTL: the child's keep-alive works across processes.
        await asyncio.sleep(2 * TTL)
        assert await store.get("w/child") is not None

        os.kill(child.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        async with asyncio.timeout(TTL + 1.5):
            event = await anext(watch)
        assert (event.kind, event.kv.key) == (WatchEventKind.DELETE, "w/child")
        assert time.monotonic() - killed_at < TTL + 1.5
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
        await watch.aclose()
        await store.close()


WRITER = """
import asyncio, sys
from turnout.runtime.discovery import FileStore

async def main() -> None:
    store = FileStore(sys.argv[1])
    lease_id = await store.grant_lease(30)
    for i in range(20):
        await store.put(f"k/{sys.argv[2]}/{i}", b"v", lease_id=lease_id)
    await store.close()

asyncio.run(main())
"""


async def test_processes_opening_one_fresh_file_concurrently(tmp_path: Path) -> None:
    path = str(tmp_path / "fresh" / "d.sqlite")  # nobody has created it yet
    children = [
        await asyncio.create_subprocess_exec(sys.executable, "-c", WRITER, path, str(n))
        for n in range(4)
    ]
    async with asyncio.timeout(30):
        codes = [await child.wait() for child in children]
    assert codes == [0, 0, 0, 0]
    store = FileStore(path)
    try:
        kvs = await store.get_prefix("k/")
        assert len(kvs) == 80
        assert sorted(kv.revision for kv in kvs) == list(range(1, 81))  # one revision each
    finally:
        await store.close()


STOPPED_WRITER = """
import os, signal, sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
db.execute("UPDATE meta SET value=value WHERE name='revision'")
print("locked", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # stopped inside the transaction, holding the lock
db.execute("COMMIT")
"""


async def test_a_process_stopped_inside_a_transaction_ends_no_live_lease(tmp_path: Path) -> None:
    """One process stopped while it holds the write lock (for several TTLs) must not make the
    others' leases expire: they get the stalled time back. A lease nobody keeps alive still
    ends afterwards."""
    path = str(tmp_path / "d.sqlite")
    store = FileStore(path, poll_interval=0.02)
    lease = await Lease.grant(store, TTL)
    await store.put("w/live", b"", lease_id=lease.id)
    orphan = await store.grant_lease(TTL)  # its holder is gone: never kept alive
    await store.put("w/orphan", b"", lease_id=orphan)
    watch = store.watch_prefix("w/")
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", STOPPED_WRITER, path, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        async with asyncio.timeout(20):
            assert (await child.stdout.readline()).strip() == b"locked"
            assert {(await anext(watch)).kv.key for _ in range(2)} == {"w/live", "w/orphan"}
        # Reads go on while the lock is held (WAL); the keep-alives wait.
        await asyncio.sleep(4 * TTL)
        assert {kv.key for kv in await store.get_prefix("w/")} == {"w/live", "w/orphan"}
        os.kill(child.pid, signal.SIGCONT)
        async with asyncio.timeout(20):
            assert await child.wait() == 0
            # The orphan ends (within a TTL and a poll); the kept-alive lease never does.
            event = await anext(watch)
        assert (event.kind, event.kv.key) == (WatchEventKind.DELETE, "w/orphan")
        await asyncio.sleep(2 * TTL)
        assert not lease.lost.is_set()
        assert await store.get("w/live") is not None
        await store.put("w/barrier", b"")
        async with asyncio.timeout(5):
            event = await anext(watch)
        assert (event.kind, event.kv.key) == (WatchEventKind.PUT, "w/barrier")
    finally:
        if child.returncode is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            await child.wait()
        await watch.aclose()
        await lease.revoke()
        await store.close()
