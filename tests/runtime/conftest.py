"""Fixtures for the runtime tests; every test is checked for leaks on teardown."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import psutil
import pytest
import uvloop
from tests.servers.etcd import EtcdServer, TlsFiles, etcd_binary
from tests.servers.process import require

from turnout.runtime.discovery import DiscoveryStore, EtcdStore, FileStore, MemoryStore
from turnout.runtime.request_plane import local as local_plane


def _tcp_sockets() -> int:
    return len(psutil.Process().net_connections(kind="tcp"))


_HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
async def no_leaks(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Fail a test that leaves a task, a store thread, a local server or a socket behind.

    Only for the modules beside this file; sub-packages (e.g. ``event_plane/``) keep their own.
    """
    if request.node.path.parent != _HERE:
        yield
        return
    sockets_before = _tcp_sockets()
    yield
    for _ in range(5):
        await asyncio.sleep(0)
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    assert not tasks, f"tasks left running: {tasks}"
    threads = [t.name for t in threading.enumerate() if t.name.startswith("turnout-filestore")]
    assert not threads, f"file store threads left: {threads}"
    assert not local_plane._SERVERS, f"local servers left: {list(local_plane._SERVERS)}"
    assert _tcp_sockets() <= sockets_before, "tcp sockets left open"


def start_etcd(data_dir: Path, host: str = "127.0.0.1", tls: TlsFiles | None = None) -> EtcdServer:
    """A running ``EtcdServer`` in ``data_dir``; skips the test when etcd is not installed."""
    require("etcd", etcd_binary() is not None)
    return EtcdServer(data_dir, host=host, tls=tls).start()


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for a test module; tests that disrupt it (kill, pause, auth) start their own.
    The ``store`` fixture wipes it before each test."""
    server = start_etcd(tmp_path_factory.mktemp("etcd") / "data")
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(params=["memory", "file", "etcd"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[DiscoveryStore]:
    """Each discovery store kind in turn: the contract tests run against all of them."""
    s: DiscoveryStore
    if request.param == "memory":
        s = MemoryStore()
    elif request.param == "file":
        s = FileStore(tmp_path / "d.sqlite", 0.02)
    else:
        server: EtcdServer = request.getfixturevalue("etcd_server")
        await server.wipe()
        s = EtcdStore(server.endpoints, connect_timeout=5.0)
    yield s
    await s.close()


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The request-plane and component tests run on both loops: the frontend and workers use
    uvloop, whose transports differ from asyncio's in small ways."""
    if item.path.parent == _HERE and item.path.name in _BOTH_LOOPS:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


_BOTH_LOOPS = {"test_request_plane.py", "test_component.py", "test_tcp_mtls.py"}


#: The etcd user turnout runs as in the least-privilege and recovery tests, and root's password.
ETCD_USER = "turnout"
ETCD_PASSWORD = "sk-turnout-test-etcd-user"
ETCD_ROOT_PASSWORD = "sk-turnout-test-etcd-root"


def etcdctl(server: EtcdServer, *args: str, user: str | None = None) -> str:
    """Run ``etcdctl`` against ``server`` (as ``user``, ``name:password``), as an operator
    would; its output, or an assertion naming what etcd said."""
    require("etcdctl")
    command = ["etcdctl", "--endpoints", server.url, "--command-timeout", "10s"]
    if user is not None:
        command += ["--user", user]
    env = {"ETCDCTL_API": "3", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    done = subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=30, env=env, check=False
    )
    assert done.returncode == 0, f"etcdctl {' '.join(args)}: {done.stderr.strip()}"
    return done.stdout


def limit_etcd_to_prefix(
    server: EtcdServer, prefix: str = "v1/", user: str = ETCD_USER, role: str = "turnout"
) -> None:
    """etcd's auth as the deployment docs set it up: a role with ``readwrite`` on ``prefix``
    alone, ``user`` (password ``ETCD_PASSWORD``) with that role, ``root``, then auth on."""
    etcdctl(server, "role", "add", role)
    etcdctl(server, "role", "grant-permission", role, "--prefix=true", "readwrite", prefix)
    etcdctl(server, "user", "add", f"root:{ETCD_ROOT_PASSWORD}")
    etcdctl(server, "user", "grant-role", "root", "root")
    etcdctl(server, "user", "add", f"{user}:{ETCD_PASSWORD}")
    etcdctl(server, "user", "grant-role", user, role)
    etcdctl(server, "auth", "enable")
