"""``PostgresServer``: a real PostgreSQL for the tests (Debian's ``postgresql``), in a cluster of
its own made by ``initdb`` in a fresh folder, listening on a free port of 127.0.0.1.

PostgreSQL refuses to run as root, and the tests often run as root (CI does). Then the cluster
is made and run as the ``postgres`` user that Debian's package creates: the child process
switches to that user itself (``subprocess``'s ``user``/``group``), so the server is this
process's own child and gets its signals (a ``runuser`` in between would not pass SIGINT on,
and would leave the server behind when killed). Its folder lives under ``/tmp`` (not under
pytest's ``tmp_path``, which is private to root), owned by that user. As any other user, it
runs as that user. Start-up takes about a second; ``fsync`` is off (a test cluster need not
survive a power cut).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from types import TracebackType
from typing import Any

from tests.servers.process import ServerProcess, free_port

START_DEADLINE_SECONDS = 30.0
#: The cluster's superuser (trust authentication on 127.0.0.1: no password).
USER = "turnout"


def postgres_bin_dir() -> str | None:
    """The folder of ``initdb`` and ``postgres``: on ``PATH``, or Debian's
    ``/usr/lib/postgresql/<version>/bin`` (not on ``PATH``), newest version first."""
    found = shutil.which("initdb")
    if found is not None and shutil.which("postgres") is not None:
        return os.path.dirname(os.path.realpath(found))
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(os.path.join(folder, "initdb")):
            return folder
    return None


def _run_as() -> dict[str, Any]:
    """``subprocess`` keywords that run the server as another user: none unless root, then
    Debian's ``postgres`` user."""
    if os.getuid() != 0:
        return {}
    try:
        user = pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError(
            "PostgreSQL refuses to run as root, and there is no 'postgres' user to run it as "
            "(Debian's postgresql package creates one)"
        ) from None
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": [],
            "env": {**os.environ, "HOME": user.pw_dir, "USER": "postgres"}}  # fmt: skip


class PostgresServer(ServerProcess):
    """One PostgreSQL cluster and server. ``start()`` waits (with a deadline) until it accepts
    connections; ``dsn()`` names a database in it, ``create_database`` makes a fresh one."""

    def __init__(self) -> None:
        super().__init__()
        bin_dir = postgres_bin_dir()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL is not installed (Debian: postgresql)")
        self.bin_dir = bin_dir
        self.run_as = _run_as()
        self.folder = tempfile.mkdtemp(prefix="turnout-pg-")
        self.data_dir = os.path.join(self.folder, "data")
        self.log_path = os.path.join(self.folder, "log")
        self.host = "127.0.0.1"
        self.port = free_port(self.host)
        if self.run_as:
            os.chown(self.folder, self.run_as["user"], self.run_as["group"])
        self._initdb()

    def _initdb(self) -> None:
        subprocess.run(
            [os.path.join(self.bin_dir, "initdb"), "-D", self.data_dir,
             "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync"],
            check=True, capture_output=True, timeout=60, cwd=self.folder, **self.run_as,
        )  # fmt: skip

    def dsn(self, database: str = "postgres") -> str:
        return f"postgres://{USER}@{self.host}:{self.port}/{database}"

    def start(self) -> PostgresServer:
        assert self.process is None, "already running"
        args = [
            os.path.join(self.bin_dir, "postgres"),
            "-D", self.data_dir, "-p", str(self.port), "-k", self.folder,
            "-c", f"listen_addresses={self.host}", "-c", "fsync=off",
            "-c", "full_page_writes=off", "-c", "synchronous_commit=off",
        ]  # fmt: skip
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child keeps it)
        try:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.folder, **self.run_as,
            )  # fmt: skip
        finally:
            log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_DEADLINE_SECONDS
        isready = os.path.join(self.bin_dir, "pg_isready")
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.process.returncode}: "
                                   f"{self._tail()}")  # fmt: skip
            probe = subprocess.run(
                [isready, "-h", self.host, "-p", str(self.port), "-U", USER, "-t", "1"],
                capture_output=True, timeout=10,
            )  # fmt: skip
            if probe.returncode == 0:
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"postgres did not start within {START_DEADLINE_SECONDS}s")
            time.sleep(0.05)

    async def create_database(self) -> str:
        """A fresh, empty database; its DSN."""
        import asyncpg

        name = "t_" + uuid.uuid4().hex[:12]
        conn = await asyncpg.connect(self.dsn(), timeout=10)
        try:
            await conn.execute(f"CREATE DATABASE {name}")
        finally:
            await conn.close()
        return self.dsn(name)

    def _tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-2000:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Fast shutdown (SIGINT: clients are disconnected; SIGTERM would wait for them)."""
        self._end(signal.SIGINT)

    def remove(self) -> None:
        """Stop it and remove its cluster."""
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        self.remove()
