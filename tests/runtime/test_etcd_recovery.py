"""Recovery after etcd is restored from a snapshot or rebuilt empty, on a real etcd.

Each scenario runs without auth and with auth on (root and the non-root user turnout runs as,
limited to ``v1/``). A restore brings back an older store: old revisions, leases that may be
gone or stale, keys that changed since. A rebuild brings back an empty one (users and roles
re-created). A single-node "member replaced" (a new member, a new data dir, the same address)
is the rebuild. Every process recovers by itself within a few lease TTLs: watches re-list
(instances that no longer exist go, new ones come), lease holders register again, and a real
request is served.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from tests.integration.procs import ProcessSet, health, wait_until
from tests.polling import eventually
from tests.runtime.conftest import (
    ETCD_PASSWORD,
    ETCD_ROOT_PASSWORD,
    ETCD_USER,
    etcdctl,
    limit_etcd_to_prefix,
    start_etcd,
)
from tests.servers.etcd import EtcdServer

from turnout.runtime.discovery import EtcdStore, WatchEvent, WatchEventKind
from turnout.runtime.lease import Lease

PUT, DELETE = WatchEventKind.PUT, WatchEventKind.DELETE
RESTORED = "etcd store was restored or rebuilt"


def snapshot(server: EtcdServer, auth: bool) -> Path:
    """``etcdctl snapshot save``, as the backup docs say (root: a snapshot reads it all)."""
    path = server.data_dir.parent / f"snapshot-{server.data_dir.name}.db"
    etcdctl(
        server, "snapshot", "save", str(path), user=f"root:{ETCD_ROOT_PASSWORD}" if auth else None
    )
    return path


def restore(server: EtcdServer, path: Path) -> None:
    """Stop etcd, ``etcdctl snapshot restore`` into a new data dir, start it on the same
    address."""
    server.kill()
    peer = f"http://{server.host}:{server.peer_port}"
    new = server.data_dir.with_name(server.data_dir.name + "-restored")
    subprocess.run(
        ["etcdctl", "snapshot", "restore", str(path), "--data-dir", str(new),
         "--name", server.name, "--initial-cluster", f"{server.name}={peer}",
         "--initial-advertise-peer-urls", peer],
        check=True, capture_output=True, timeout=30,
        env={"ETCDCTL_API": "3", "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )  # fmt: skip
    server.data_dir = new
    server.start()


def rebuild(server: EtcdServer, auth: bool) -> None:
    """Stop etcd and start an empty one on the same address, its users and roles re-created."""
    server.kill()
    server.data_dir = server.data_dir.with_name(server.data_dir.name + "-rebuilt")
    server.start()
    if auth:
        limit_etcd_to_prefix(server)


@pytest.fixture(params=["no-auth", "auth"])
def auth(request: pytest.FixtureRequest) -> bool:
    return bool(request.param == "auth")


@pytest.fixture
def etcd(tmp_path: Path, auth: bool) -> Iterator[EtcdServer]:
    server = start_etcd(tmp_path / "etcd")
    try:
        if auth:
            limit_etcd_to_prefix(server)
        yield server
    finally:
        server.kill()


@pytest.fixture
async def store(etcd: EtcdServer, auth: bool) -> AsyncIterator[EtcdStore]:
    credentials = {"user": ETCD_USER, "password": ETCD_PASSWORD} if auth else {}
    s = EtcdStore(etcd.endpoints, connect_timeout=2.0, **credentials)
    yield s
    await s.close()


async def follow(watch: AsyncIterator[WatchEvent], into: dict[str, bytes]) -> None:
    """Apply a watch's events to ``into`` until it ends, as a frontend does."""
    async for event in watch:
        if event.kind is PUT:
            into[event.kv.key] = event.kv.value
        else:
            into.pop(event.kv.key, None)


# -- the store -------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["restore", "rebuild"])
async def test_store_recovers_watches_and_leases(
    etcd: EtcdServer,
    store: EtcdStore,
    auth: bool,
    how: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A watch open across the restore or rebuild ends up with exactly the store's keys (a
    key put before it and gone since is dropped, one put after it is seen); a lease granted
    before it is reported lost within a few TTLs, its old copy revoked; a new lease works."""
    caplog.set_level(logging.WARNING, logger="turnout")
    seen: dict[str, bytes] = {}
    watcher = asyncio.get_running_loop().create_task(follow(store.watch_prefix("v1/i/"), seen))
    lease = await Lease.grant(store, 2)
    try:
        await store.put("v1/i/leased", b"1", lease_id=lease.id)
        await store.put("v1/i/kept", b"1")
        path = snapshot(etcd, auth) if how == "restore" else None
        await store.put("v1/i/later", b"1")  # not in the snapshot
        for n in range(20):  # the store moves on past the snapshot's revision
            await store.put("v1/i/churn", str(n).encode())
        await eventually(lambda: seen.get("v1/i/churn") == b"19", timeout=20, what="the churn")
        # On this loop: the process is frozen while etcd goes and comes back (as a stalled
        # loop or a paused VM would be), and its channels must not stay stuck on the old one.
        if path is not None:
            restore(etcd, path)
            expected = {"v1/i/kept": b"1", "v1/i/leased": b"1"}  # the leased one: an old copy
        else:
            rebuild(etcd, auth)
            expected = {}
        await eventually(
            lease.lost.is_set, timeout=20, what="the lease of the earlier store to be lost"
        )

        def relisted() -> bool:
            if watcher.done():
                watcher.result()  # the watch must not end: raise what ended it
            return seen == expected or seen == {
                k: v for k, v in expected.items() if k != "v1/i/leased"
            }

        await eventually(relisted, timeout=20, what="the watch to re-list")
        # Registering again, as a worker does: a new lease, the key put again.
        renewed = await Lease.grant(store, 2)
        await store.put("v1/i/leased", b"2", lease_id=renewed.id)
        await store.put("v1/i/new", b"1")
        expected.update({"v1/i/leased": b"2", "v1/i/new": b"1"})
        await eventually(
            lambda: seen == expected, timeout=20, what="the watch to follow the new store"
        )
        assert {kv.key for kv in await store.get_prefix("v1/i/")} == set(expected)
        assert await store.keep_alive(renewed.id)
        await renewed.revoke()
        await eventually(
            lambda: "v1/i/leased" not in seen, timeout=20, what="the new lease's key to go with it"
        )
        restored = [r for r in caplog.records if RESTORED in r.getMessage()]
        assert len(restored) == 1, [r.getMessage() for r in caplog.records]
    finally:
        watcher.cancel()
        await asyncio.wait([watcher])
        await lease.revoke()


async def test_a_watch_resumed_past_the_head_relists(
    etcd: EtcdServer, store: EtcdStore, auth: bool
) -> None:
    """A caller resuming with a revision of the store's earlier history (beyond the rebuilt
    store's head) is not left waiting for that revision: it gets the store's keys."""
    old = await store.put("v1/i/a", b"1")
    for n in range(10):
        old = await store.put("v1/i/b", str(n).encode())
    rebuild(etcd, auth)
    credentials = {"user": ETCD_USER, "password": ETCD_PASSWORD} if auth else {}
    fresh = EtcdStore(etcd.endpoints, connect_timeout=2.0, **credentials)
    try:
        await fresh.put("v1/i/c", b"1")
    finally:
        await fresh.close()
    watch = store.watch_prefix("v1/i/", start_revision=old)
    try:
        async with asyncio.timeout(20):
            events = [await anext(watch)]
            while events[-1].kv.key != "v1/i/c":
                events.append(await anext(watch))
        assert (events[-1].kind, events[-1].kv.value) == (PUT, b"1")
    finally:
        await watch.aclose()


# -- real processes --------------------------------------------------------------------------


def instances_in_etcd(etcd: EtcdServer, auth: bool) -> set[str]:
    user = f"root:{ETCD_ROOT_PASSWORD}" if auth else None
    out = etcdctl(etcd, "get", "--prefix", "--keys-only", "v1/instances/", user=user)
    return {line.rsplit("/", 1)[-1] for line in out.split()}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["restore", "rebuild"])
def test_frontend_and_workers_recover(
    etcd: EtcdServer, auth: bool, how: str, tmp_path: Path
) -> None:
    """A frontend and a worker running across the restore or rebuild: the worker is registered
    (again, under a new id, when its lease was lost or of the earlier store), the frontend
    lists exactly the instances etcd has (the second worker, gone before the restore, is not
    among them), a worker started afterwards reaches it, and requests are served."""
    store = ["--store", "etcd", "--store-endpoints", etcd.url]
    if auth:
        store += ["--store-user", ETCD_USER, "--store-password", ETCD_PASSWORD]
    procs = ProcessSet(tmp_path, lease_ttl=2.0, store_flags=store)

    def listed() -> set[str]:
        return set(health(procs.url).get("echo", []))

    try:
        procs.frontend()
        procs.worker("--engine", "echo", "--model-name", "echo")
        wait_until(lambda: len(listed()) == 1, 60, "the worker", procs.logs)
        before = listed()
        path = snapshot(etcd, auth) if how == "restore" else None
        # A second worker comes and goes after the snapshot: revisions move past it.
        second = procs.worker("--engine", "echo", "--model-name", "echo")
        wait_until(lambda: len(listed()) == 2, 60, "the second worker", procs.logs)
        second.terminate()
        second.wait(timeout=30)
        wait_until(lambda: listed() == before, 30, "the second worker to leave", procs.logs)
        if path is not None:
            restore(etcd, path)
        else:
            rebuild(etcd, auth)
        procs.worker("--engine", "echo", "--model-name", "echo")

        def recovered() -> bool:
            now = listed()
            # After a rebuild the worker's earlier id cannot be there; after a restore it may
            # (its lease and keys restored as they were, if it has not seen the store's
            # revision go back), and then it is still served by that worker.
            kept = bool(now & before) and how == "restore"
            return (
                len(now) == 2
                and now == instances_in_etcd(etcd, auth)
                and (kept or not now & before)
            )

        wait_until(recovered, 60, "the frontend to list the re-registered workers", procs.logs)
        for _ in range(4):
            r = httpx.post(
                procs.url + "/v1/completions",
                json={"model": "echo", "prompt": "hi there", "max_tokens": 2},
                timeout=20,
            )
            assert r.status_code == 200, r.text
        logs = procs.logs()
        # A line per change of state and process (three processes ran across it), no loop.
        assert logs.count("watch creation timed out") <= 3, logs
        assert logs.count("etcd unreachable") <= 3, logs
        assert logs.count(RESTORED) <= 3, logs
    finally:
        procs.close()
