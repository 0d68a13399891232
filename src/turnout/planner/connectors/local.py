"""``local``: worker processes on this machine, started and stopped as ``turnout serve`` does.

A pool's workers are the instances of its endpoint that discovery lists on this host, plus
the processes this connector started that have not registered yet. Scaling up starts
``turnout worker`` processes (``argv_for(pool)``, one worker each) in sessions of their own,
so a planner that dies does not take the fleet with it: the planner that takes over finds the
same workers in discovery and manages them by their pid. Scaling down sends SIGTERM to the
chosen workers (the least loaded first): each revokes its lease at once (frontends stop
routing to it, KV routers forget it), lets its streams finish within its drain timeout and
hands the rest back to the frontends, which migrate them; one still running
``stop_timeout`` seconds later is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from turnout.planner.connectors.base import ConnectorError
from turnout.protocols.model import INSTANCES_ROOT, EndpointId, Instance
from turnout.runtime.addresses import is_loopback
from turnout.runtime.discovery.base import DiscoveryStore

log = logging.getLogger("turnout.planner")

#: Seconds a started worker may take to register before it is killed as stuck.
DEFAULT_START_TIMEOUT = 120.0
#: Seconds a worker told to stop may take (its drain timeout and a margin) before it is killed.
DEFAULT_STOP_TIMEOUT = 40.0
STORE_TIMEOUT = 5.0


@dataclass(slots=True)
class _Started:
    process: asyncio.subprocess.Process
    pool: str
    at: float


@dataclass(frozen=True, slots=True)
class LocalWorker:
    """A worker of a pool on this host, as discovery lists it."""

    instance_id: int
    pid: int


class LocalConnector:
    """See the module docstring."""

    name = "local"

    def __init__(
        self,
        store: DiscoveryStore,
        endpoints: dict[str, EndpointId],
        argv_for: Callable[[str], list[str]],
        *,
        hosts: set[str] | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._endpoints = endpoints
        self._argv_for = argv_for
        #: Host names this machine's workers advertise (loopback addresses always count).
        self._hosts = hosts if hosts is not None else {socket.gethostname()}
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._clock = clock
        self._started: dict[int, _Started] = {}  # pid -> process not yet seen registered
        self._stopping: dict[int, asyncio.Task[None]] = {}
        self._reapers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self._workers()  # the store answers

    def _local(self, record: Instance) -> bool:
        return record.host in self._hosts or is_loopback(record.host)

    async def _workers(self) -> dict[str, list[LocalWorker]]:
        """This host's registered workers of each pool, oldest instance first."""
        out: dict[str, list[LocalWorker]] = {}
        for pool, endpoint in self._endpoints.items():
            try:
                kvs = await asyncio.wait_for(
                    self._store.get_prefix(f"{INSTANCES_ROOT}/{endpoint.path()}/"), STORE_TIMEOUT
                )
            except Exception as exc:
                raise ConnectorError(f"cannot list the {pool} workers in the store: {exc}") from exc
            workers = []
            for kv in sorted(kvs, key=lambda kv: kv.revision):
                try:
                    record = msgspec.json.decode(kv.value, type=Instance)
                except msgspec.DecodeError as exc:
                    log.warning("skipping the malformed instance record %s: %s", kv.key, exc)
                    continue
                if self._local(record) and record.pid not in self._stopping:
                    workers.append(LocalWorker(record.instance_id, record.pid))
            out[pool] = workers
        return out

    def _pending(self, pool: str, registered: set[int]) -> int:
        """Started processes of ``pool`` not registered yet (stuck ones are killed)."""
        now = self._clock()
        count = 0
        for pid, started in list(self._started.items()):
            if pid in registered or started.process.returncode is not None:
                del self._started[pid]
                continue
            if started.pool != pool:
                continue
            if now - started.at > self._start_timeout:
                log.error(
                    "worker pid %d did not register within %.0fs; killing it", pid,
                    self._start_timeout,
                )  # fmt: skip
                with contextlib.suppress(ProcessLookupError):
                    started.process.kill()
                del self._started[pid]
                continue
            count += 1
        return count

    async def replicas(self, pool: str) -> int | None:
        workers = (await self._workers()).get(pool, [])
        return len(workers) + self._pending(pool, {w.pid for w in workers})

    async def scale(self, pool: str, replicas: int, *, drain_first: list[int]) -> None:
        workers = (await self._workers()).get(pool, [])
        pending = self._pending(pool, {w.pid for w in workers})
        current = len(workers) + pending
        if replicas > current:
            for _ in range(replicas - current):
                await self._spawn(pool)
        elif replicas < current:
            surplus = current - replicas
            rank = {instance: i for i, instance in enumerate(drain_first)}
            # The least loaded first, then the newest (a worker that drain_first does not
            # name has not reported load yet).
            order = sorted(reversed(workers), key=lambda w: rank.get(w.instance_id, len(rank)))
            for worker in order[:surplus]:
                self._stop(worker)

    async def _spawn(self, pool: str) -> None:
        argv = self._argv_for(pool)
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, start_new_session=True
            )
        except OSError as exc:
            raise ConnectorError(f"cannot start a {pool} worker: {exc}") from exc
        self._started[process.pid] = _Started(process, pool, self._clock())
        reaper = asyncio.create_task(self._reap(process, pool))
        self._reapers.add(reaper)
        reaper.add_done_callback(self._reapers.discard)
        log.info("started a worker for the %s pool, pid %d", pool, process.pid)

    async def _reap(self, process: asyncio.subprocess.Process, pool: str) -> None:
        code = await process.wait()
        if process.pid not in self._stopping:
            log.warning("%s worker pid %d exited with status %d", pool, process.pid, code)

    def _stop(self, worker: LocalWorker) -> None:
        log.info("draining worker %x (pid %d)", worker.instance_id, worker.pid)
        task = asyncio.create_task(self._terminate(worker.pid))
        self._stopping[worker.pid] = task
        task.add_done_callback(lambda _: self._stopping.pop(worker.pid, None))

    async def _terminate(self, pid: int) -> None:
        """SIGTERM (the worker leaves discovery and drains), then SIGKILL past the timeout."""
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = self._clock() + self._stop_timeout
        while self._clock() < deadline:
            if not _alive(pid):
                return
            await asyncio.sleep(0.2)
        log.warning("worker pid %d did not stop in %.0fs; killing it", pid, self._stop_timeout)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    async def close(self, *, stop_workers: bool) -> None:
        if stop_workers:
            with contextlib.suppress(ConnectorError):
                for workers in (await self._workers()).values():
                    for worker in workers:
                        self._stop(worker)
            for pid in list(self._started):
                if pid not in self._stopping:
                    self._stopping[pid] = asyncio.create_task(self._terminate(pid))
            if self._stopping:
                await asyncio.wait(list(self._stopping.values()))
        for task in list(self._reapers):
            task.cancel()


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie this process has yet to reap."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True
