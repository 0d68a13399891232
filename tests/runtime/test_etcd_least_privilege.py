"""turnout under an etcd role limited to its own prefix, on a real etcd with auth on.

The role is set up with ``etcdctl`` as the deployment docs do: ``readwrite`` on the prefix
``v1/`` alone, a non-root user with that role, root, ``auth enable``. Every call turnout
makes (the start-up check, keys, watches, leases, compaction) stays inside; a user whose role
lacks the prefix is refused at start with one line naming the prefix, and the process exits 2.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.integration.procs import ProcessSet, health, wait_until
from tests.runtime.conftest import (
    ETCD_PASSWORD,
    ETCD_ROOT_PASSWORD,
    ETCD_USER,
    etcdctl,
    limit_etcd_to_prefix,
    start_etcd,
)
from tests.servers.etcd import EtcdServer

from turnout.errors import ConfigError, DiscoveryError
from turnout.runtime.discovery import EtcdStore, WatchEventKind, open_store
from turnout.runtime.lease import Lease


@pytest.fixture
def limited_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd whose user ``turnout`` may only read and write under ``v1/``."""
    server = start_etcd(tmp_path / "etcd")
    try:
        limit_etcd_to_prefix(server)
        yield server
    finally:
        server.kill()


async def test_every_store_call_stays_under_the_prefix(limited_etcd: EtcdServer) -> None:
    store = await open_store(
        "etcd", endpoints=limited_etcd.endpoints, user=ETCD_USER, password=ETCD_PASSWORD
    )
    assert isinstance(store, EtcdStore)
    watch = store.watch_prefix("v1/instances/")
    try:
        lease = await Lease.grant(store, 2)
        await store.put("v1/instances/a", b"1", lease_id=lease.id)
        async with asyncio.timeout(10):
            event = await anext(watch)
        assert (event.kind, event.kv.key) == (WatchEventKind.PUT, "v1/instances/a")
        assert [kv.key for kv in await store.get_prefix("v1/")] == ["v1/instances/a"]
        assert await store.keep_alive(lease.id)
        revision = await store.put("v1/other", b"2")
        await store.compact(revision)  # etcd 3.4 asks no key permission for it
        await lease.revoke()
        async with asyncio.timeout(10):
            event = await anext(watch)
        assert (event.kind, event.kv.key) == (WatchEventKind.DELETE, "v1/instances/a")
        # The role is in force: outside the prefix, etcd refuses.
        with pytest.raises(DiscoveryError, match="PERMISSION_DENIED"):
            await store.put("elsewhere", b"x")
    finally:
        await watch.aclose()
        await store.close()


async def test_a_role_without_the_prefix_is_one_clear_config_error(
    limited_etcd: EtcdServer,
) -> None:
    root = f"root:{ETCD_ROOT_PASSWORD}"
    etcdctl(limited_etcd, "role", "add", "elsewhere", user=root)
    etcdctl(limited_etcd, "role", "grant-permission", "elsewhere", "--prefix=true",
            "readwrite", "other/", user=root)  # fmt: skip
    etcdctl(limited_etcd, "user", "add", f"stranger:{ETCD_PASSWORD}", user=root)
    etcdctl(limited_etcd, "user", "grant-role", "stranger", "elsewhere", user=root)
    with pytest.raises(ConfigError) as caught:
        await open_store(
            "etcd", endpoints=limited_etcd.endpoints, user="stranger", password=ETCD_PASSWORD
        )
    message = str(caught.value)
    assert "\n" not in message
    assert "user 'stranger'" in message
    assert "grant its role readwrite on the prefix 'v1/'" in message
    assert ETCD_PASSWORD not in message


def test_a_worker_without_the_prefix_exits_2_with_one_line(limited_etcd: EtcdServer) -> None:
    root = f"root:{ETCD_ROOT_PASSWORD}"
    etcdctl(limited_etcd, "user", "add", f"stranger:{ETCD_PASSWORD}", user=root)
    done = subprocess.run(
        [sys.executable, "-m", "turnout", "worker", "--engine", "echo", "--model-name", "echo",
         "--store", "etcd", "--store-endpoints", limited_etcd.url,
         "--store-user", "stranger", "--store-password", ETCD_PASSWORD],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "PERMISSION_DENIED" in lines[0] and "'v1/'" in lines[0]
    assert ETCD_PASSWORD not in done.stderr


@pytest.mark.slow
def test_a_frontend_serves_through_a_worker_under_the_limited_role(
    limited_etcd: EtcdServer, tmp_path: Path
) -> None:
    procs = ProcessSet(
        tmp_path,
        store_flags=["--store", "etcd", "--store-endpoints", limited_etcd.url,
                     "--store-user", ETCD_USER, "--store-password", ETCD_PASSWORD],
    )  # fmt: skip
    try:
        procs.frontend()
        procs.worker("--engine", "echo", "--model-name", "echo")
        wait_until(lambda: len(health(procs.url).get("echo", [])) == 1, 60, "worker", procs.logs)
        r = httpx.post(
            procs.url + "/v1/completions",
            json={"model": "echo", "prompt": "hi there", "max_tokens": 2},
            timeout=20,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]
        assert "PERMISSION_DENIED" not in procs.logs()
    finally:
        procs.close()
