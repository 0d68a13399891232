"""``EtcdServer``: a real, single-member ``etcd`` for the tests, on free ports of one loopback
address, in its own data directory.

It starts in about a tenth of a second, so tests may own one each when they disrupt it
(kill, restart, pause, enable auth) and share one otherwise. Its raft timings are shortened
(heartbeat 50 ms, election 250 ms): startup is quicker, and etcd's minimum lease TTL, 1.5
election timeouts rounded up to whole seconds, drops from 2 s to 1 s, which keeps the lease
expiry tests short.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import grpc.aio
from tests.servers.process import ServerProcess, free_port

from turnout.runtime.discovery import etcd_v3_pb2 as pb
from turnout.runtime.discovery.etcd_client import EtcdCalls

ETCD_BINARY = "etcd"
START_DEADLINE_SECONDS = 20.0


def etcd_binary() -> str | None:
    """The path of the ``etcd`` binary, or None when it is not installed."""
    return shutil.which(ETCD_BINARY)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of a throwaway CA, a server certificate for 127.0.0.1/localhost and a
    client certificate, all signed by that CA."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """Create ``TlsFiles`` in ``directory`` with the ``openssl`` command (EC keys: fast)."""
    directory.mkdir(parents=True, exist_ok=True)
    d = directory

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem",
            "-days", "2", "-subj", "/CN=turnout test CA")  # fmt: skip
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl("req", *ec, "-keyout", f"{d}/{name}.key", "-out", f"{d}/{name}.csr",
                "-subj", f"/CN=turnout test {name}")  # fmt: skip
        openssl("x509", "-req", "-in", f"{d}/{name}.csr", "-CA", f"{d}/ca.pem",
                "-CAkey", f"{d}/ca.key", "-CAcreateserial", "-days", "2",
                "-out", f"{d}/{name}.pem", "-extfile", f"{d}/{name}.ext")  # fmt: skip
    return TlsFiles(
        ca=d / "ca.pem",
        server_cert=d / "server.pem",
        server_key=d / "server.key",
        client_cert=d / "client.pem",
        client_key=d / "client.key",
    )


class EtcdServer(ServerProcess):
    """One etcd process. ``start()`` waits (with a deadline) until it answers ``/health``;
    ``restart()`` brings it back on the same ports and data, as after a crash or reboot."""

    def __init__(
        self,
        data_dir: Path,
        host: str = "127.0.0.1",
        tls: TlsFiles | None = None,
        *,
        command_prefix: Sequence[str] = (),
        ports: tuple[int, int] | None = None,
        progress_notify_interval: float | None = None,
    ) -> None:
        """``command_prefix`` runs etcd through another command (``ip netns exec NS``: on a
        test host of its own); ``ports`` (client, peer) are then needed, since free ports
        cannot be probed from here. ``progress_notify_interval`` (seconds) shortens etcd's
        watch progress notifications (10 minutes by default), for tests of quiet watches."""
        super().__init__()
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("the etcd binary is not installed (Debian: etcd-server)")
        self.binary = binary
        self.host = host
        self.data_dir = Path(data_dir)
        self.command_prefix = list(command_prefix)
        self.client_port, self.peer_port = ports or (free_port(host), free_port(host))
        self.name = f"turnout-test-{uuid.uuid4().hex[:8]}"
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")
        #: With TLS, clients must show a certificate signed by ``tls.ca`` (mutual TLS).
        self.tls = tls
        self.progress_notify_interval = progress_notify_interval

    @property
    def url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def endpoints(self) -> list[str]:
        return [self.url]

    # -- process ----------------------------------------------------------------------------

    def start(self) -> EtcdServer:
        assert self.process is None, "already running"
        peer = f"http://{self.host}:{self.peer_port}"
        args = [
            *self.command_prefix,
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--heartbeat-interval", "50",
            "--election-timeout", "250",
            "--log-level", "warn",
        ]  # fmt: skip
        if self.progress_notify_interval is not None:
            interval_ms = max(1, round(self.progress_notify_interval * 1000))
            args += ["--experimental-watch-progress-notify-interval", f"{interval_ms}ms"]
        if self.tls is not None:
            args += [
                "--cert-file", str(self.tls.server_cert),
                "--key-file", str(self.tls.server_key),
                "--trusted-ca-file", str(self.tls.ca),
                "--client-cert-auth",
            ]  # fmt: skip
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_DEADLINE_SECONDS
        assert self.process is not None
        context: ssl.SSLContext | None = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.process.returncode}: {self._tail()}")
            try:
                url = f"{self.url}/health"
                with urllib.request.urlopen(url, timeout=1, context=context) as resp:
                    if json.loads(resp.read()).get("health") == "true":
                        return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"etcd did not answer within {START_DEADLINE_SECONDS}s")
            time.sleep(0.02)

    def _tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def remove_data(self) -> None:
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- client-side helpers (each opens and closes its own channel) ------------------------

    @contextlib.asynccontextmanager
    async def _client(self) -> AsyncIterator[EtcdCalls]:
        assert self.tls is None, "the client helpers speak plain http only"
        channel = grpc.aio.insecure_channel(f"{self.host}:{self.client_port}")
        try:
            yield EtcdCalls(channel)
        finally:
            await channel.close()

    async def compact(self, revision: int) -> None:
        """Compact etcd's history up to ``revision`` (watches cannot start before it)."""
        async with self._client() as client:
            await client.compact(pb.CompactionRequest(revision=revision, physical=True), timeout=5)

    async def revision(self) -> int:
        """The current store revision."""
        async with self._client() as client:
            request = pb.RangeRequest(key=b"\0", range_end=b"\0", count_only=True)
            resp = await client.range(request, timeout=5)
            return int(resp.header.revision)

    async def lease_granted_ttl(self, lease_id: int) -> int:
        """The TTL etcd granted ``lease_id`` (seconds; -1 when the lease does not exist)."""
        async with self._client() as client:
            request = pb.LeaseTimeToLiveRequest(ID=lease_id)
            resp = await client.lease_time_to_live(request, timeout=5)
            return int(resp.grantedTTL)

    async def wipe(self) -> None:
        """Delete every key and revoke every lease: a clean store for the next test."""
        async with self._client() as client:
            await client.delete_range(pb.DeleteRangeRequest(key=b"\0", range_end=b"\0"), timeout=5)
            leases = await client.lease_leases(pb.LeaseLeasesRequest(), timeout=5)
            for lease in leases.leases:
                await client.lease_revoke(pb.LeaseRevokeRequest(ID=lease.ID), timeout=5)

    async def enable_auth(self, user: str, password: str) -> None:
        """Add ``root`` (etcd's only way to enable auth) with ``password`` and ``user`` with the
        root role, then turn auth on: afterwards every call needs credentials."""
        async with self._client() as client:
            await client.role_add(pb.AuthRoleAddRequest(name="root"), timeout=5)
            await client.user_add(pb.AuthUserAddRequest(name="root", password=password), timeout=5)
            grant = pb.AuthUserGrantRoleRequest(user="root", role="root")
            await client.user_grant_role(grant, timeout=5)
            if user != "root":
                request = pb.AuthUserAddRequest(name=user, password=password)
                await client.user_add(request, timeout=5)
                grant = pb.AuthUserGrantRoleRequest(user=user, role="root")
                await client.user_grant_role(grant, timeout=5)
            await client.auth_enable(pb.AuthEnableRequest(), timeout=5)

    def __repr__(self) -> str:
        pid = self.process.pid if self.process is not None else None
        return f"EtcdServer({self.url}, pid={pid}, data={os.fspath(self.data_dir)})"
