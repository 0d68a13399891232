"""``turnout serve``: a frontend and N workers on one machine, in one process tree.

The frontend runs in this process; each worker is a child process (``turnout worker``) on the
same file store and TCP request plane. Ctrl-C (or SIGTERM) stops the workers, then the
frontend. Killed outright (SIGKILL, OOM), serve still takes its workers with it: each holds
the read end of a pipe whose write end only serve holds, and stops, revoking its lease, when
that closes (``parent_watch``; on Linux a parent-death signal too).

Supervision: a worker that dies unexpectedly (its exit status is logged) is restarted after
a backoff of 1 s, 2 s, 4 s ... capped at ``RESTART_MAX_DELAY`` (back to 1 s after a run
longer than ``CRASH_WINDOW``); one that dies ``MAX_CRASHES`` times within ``CRASH_WINDOW``
seconds is given up on, with one error line. The frontend keeps serving with the others;
when every worker is given up on, ``serve`` exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from turnout.errors import ConfigError, TurnoutError
from turnout.llm.parsers import check_parser_names
from turnout.runtime.discovery import default_file_store_path
from turnout.runtime.progress import progress_bar, progress_shown, relay_lines

from .engine_flags import check_engine_flags, engine_flags
from .flags import add_flag, add_runtime_flags
from .frontend import RegisteredFrontend, add_frontend_flags, add_kv_router_flags, frontend_config
from .lifecycle import run_command, run_until_signal
from .parent_watch import ParentPipe
from .worker import add_worker_flags

log = logging.getLogger("turnout.serve")


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="start a frontend and N workers on this machine")
    add_frontend_flags(p)
    add_kv_router_flags(p)
    add_worker_flags(p, engine_default="llamacpp")
    add_flag(
        p,
        "--num-workers",
        type=int,
        help="workers to start (processes; the mocker simulates all in one; default 2, "
        "or 1 with --in-process)",
    )
    add_flag(
        p,
        "--in-process",
        action="store_true",
        help="run the engine inside the frontend's process: no worker processes, in-memory "
        "discovery, no request-plane sockets (the smallest deployment; what the planes cost)",
    )
    add_flag(
        p,
        "--num-prefill-workers",
        default=0,
        type=int,
        help="mocker: also start this many prefill workers (one more process); the "
        "--num-workers then run as decode workers (disaggregated serving)",
    )
    add_runtime_flags(p, planes=False)
    p.set_defaults(store="file", request_plane="tcp", event_plane="zmq")
    p.set_defaults(run=run)


def worker_count(args: argparse.Namespace) -> int:
    """``--num-workers``, or its default: 2 worker processes, 1 engine ``--in-process``."""
    if args.num_workers is not None:
        return int(args.num_workers)
    return 1 if getattr(args, "in_process", False) else 2


def prefill_endpoint(endpoint: str) -> str:
    """Where a tree's prefill workers serve: the ``prefill`` component of its namespace."""
    namespace = endpoint.split("/", 1)[0]
    return f"{namespace}/prefill/generate"


def worker_argv(
    args: argparse.Namespace,
    store_path: str,
    threads: int,
    *,
    role: str = "aggregated",
    count: int | None = None,
    planes: list[str] | None = None,
) -> list[str]:
    """The ``turnout worker`` command line of one child, from serve's own flags (``count``
    mocker workers in it, default ``--num-workers``). ``planes``: the store and plane flags
    (default: serve's, the file store at ``store_path``, tcp and zmq)."""
    endpoint = prefill_endpoint(args.endpoint) if role == "prefill" else args.endpoint
    if planes is None:
        planes = ["--store", "file", "--store-path", store_path,
                  "--request-plane", "tcp", "--event-plane", "zmq"]  # fmt: skip
    argv = [
        sys.executable, "-m", "turnout", "worker",
        "--engine", args.engine,
        "--endpoint", endpoint,
        *planes,
        "--lease-ttl", str(args.lease_ttl),
        "--max-frame-bytes", str(args.max_frame_bytes),
        "--drain-timeout", str(args.drain_timeout),
        "--log-level", args.log_level,
        "--log-format", args.log_format,
    ]  # fmt: skip
    if getattr(args, "otlp_endpoint", None):
        argv += ["--otlp-endpoint", args.otlp_endpoint]
    if getattr(args, "device_type", None):
        argv += ["--device-type", args.device_type]
    if getattr(args, "log_prompts", False):
        argv.append("--log-prompts")
    for name in ("plane_ca", "plane_cert", "plane_key"):
        # Each worker shows serve's certificate too: they are one deployment on one machine.
        if getattr(args, name, None):
            argv += ["--" + name.replace("_", "-"), getattr(args, name)]
    if args.engine == "mocker":
        # One process simulates every worker: the mocker is built for many per process.
        argv += ["--num-workers", str(worker_count(args) if count is None else count)]
    if role != "aggregated":
        argv += ["--role", role]
    values = {name: getattr(args, name) for name in engine_flags(args.engine)}
    if "threads" in values:
        values["threads"] = args.threads or threads
    for name in ("model_path", "model_name", "tool_call_parser", "reasoning_parser"):
        values[name] = getattr(args, name)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


#: Supervision of worker processes (see the module docstring).
RESTART_MIN_DELAY = 1.0
RESTART_MAX_DELAY = 30.0
CRASH_WINDOW = 60.0
MAX_CRASHES = 5


class ChildProcess(Protocol):
    """What the supervisor needs of a child (``asyncio.subprocess.Process``)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


Spawn = Callable[[list[str]], Awaitable[ChildProcess]]


#: Variables of one worker process's own settings, never inherited by serve's workers: every
#: child would read the same port, and all but one would fail to bind it.
PER_PROCESS_ENV = ("TURNOUT_SYSTEM_PORT", "TURNOUT_SYSTEM_HOST")


#: The tasks copying children's stderr through this process (``relay_lines``), each until its
#: child's stderr closes.
_RELAYS: set[asyncio.Task[None]] = set()


async def spawn_child(
    argv: list[str], *, pass_fds: Sequence[int] = (), relay_stderr: bool = False
) -> ChildProcess:
    """Start ``argv`` in a session of its own, with ``pass_fds`` open in it, in this process's
    environment less ``PER_PROCESS_ENV``. ``relay_stderr``: the child's stderr comes through
    this process, so that its log lines pass above a progress bar shown here."""
    env = {k: v for k, v in os.environ.items() if k not in PER_PROCESS_ENV}
    proc = await asyncio.create_subprocess_exec(
        *argv,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
        env=env,
        stderr=asyncio.subprocess.PIPE if relay_stderr else None,
    )
    if proc.stderr is not None:
        relay = asyncio.create_task(relay_lines(proc.stderr))
        _RELAYS.add(relay)
        relay.add_done_callback(_RELAYS.discard)
    return proc


def describe_exit(code: int) -> str:
    """``exit status 3`` or ``signal SIGKILL``."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


class WorkerSupervisor:
    """Runs one worker process, restarting it with backoff until it crashes too often.

    ``spawn``, ``clock`` and ``sleep`` are injectable for tests. ``run`` returns when the
    supervisor is stopped or gives up (``gave_up`` is then set).
    """

    def __init__(
        self,
        argv: list[str],
        name: str,
        *,
        spawn: Spawn = spawn_child,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        max_crashes: int = MAX_CRASHES,
        window: float = CRASH_WINDOW,
        min_delay: float = RESTART_MIN_DELAY,
        max_delay: float = RESTART_MAX_DELAY,
    ) -> None:
        self.argv = argv
        self.name = name
        self.process: ChildProcess | None = None
        self.gave_up = False
        self.restarts = 0
        self._spawn = spawn
        self._clock = clock
        self._sleep = sleep
        self._max_crashes = max_crashes
        self._window = window
        self._min_delay = min_delay
        self._max_delay = max_delay
        self._stopping = False
        self._deaths: deque[float] = deque()

    async def start(self) -> None:
        self.process = await self._spawn(self.argv)

    async def run(self) -> None:
        """Watch the process started by ``start``; restart it when it dies."""
        delay = self._min_delay
        while True:
            process = self.process
            assert process is not None
            started = self._clock()
            code = await process.wait()
            if self._stopping:
                return
            now = self._clock()
            if now - started > self._window:
                delay = self._min_delay  # it ran a good while: a fresh crash, not a loop
            deaths = self._deaths
            deaths.append(now)
            while deaths and now - deaths[0] > self._window:
                deaths.popleft()
            if len(deaths) >= self._max_crashes:
                log.error(
                    "%s (pid %d) exited with %s, its %d%s death within %gs; giving up on it",
                    self.name, process.pid, describe_exit(code), len(deaths),
                    _ordinal(len(deaths)), self._window,
                )  # fmt: skip
                self.gave_up = True
                return
            log.error(
                "%s (pid %d) exited with %s; restarting it in %gs",
                self.name, process.pid, describe_exit(code), delay,
            )  # fmt: skip
            await self._sleep(delay)
            if self._stopping:
                return
            delay = min(delay * 2, self._max_delay)
            self.restarts += 1
            while True:
                try:
                    self.process = await self._spawn(self.argv)
                    break
                except OSError as exc:  # no process to watch: counts as one more death
                    now = self._clock()
                    deaths.append(now)
                    while deaths and now - deaths[0] > self._window:
                        deaths.popleft()
                    if len(deaths) >= self._max_crashes:
                        log.error("%s could not be restarted (%s); giving up on it",
                                  self.name, exc)  # fmt: skip
                        self.gave_up = True
                        return
                    log.error("%s could not be restarted (%s); trying again in %gs",
                              self.name, exc, delay)  # fmt: skip
                    await self._sleep(delay)
                    if self._stopping:
                        return
                    delay = min(delay * 2, self._max_delay)
            if self._stopping:  # stopped while it was being spawned
                with contextlib.suppress(ProcessLookupError):
                    self.process.send_signal(signal.SIGTERM)
                return

    def stop(self) -> None:
        """Stop restarting (the caller then signals the process)."""
        self._stopping = True


def _ordinal(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def num_worker_processes(args: argparse.Namespace) -> int:
    workers = worker_count(args)
    return 1 if args.engine == "mocker" and workers > 0 else workers


#: Longest time the bar of workers coming up shows.
WORKERS_UP_VIEW_S = 300.0


class ServeTree:
    def __init__(self, args: argparse.Namespace) -> None:
        if worker_count(args) < 0:
            raise TurnoutError("--num-workers must be 0 or more")
        prefill = getattr(args, "num_prefill_workers", 0)
        if prefill < 0:
            raise TurnoutError("--num-prefill-workers must be 0 or more")
        if prefill and args.engine != "mocker":
            raise TurnoutError(
                f"--num-prefill-workers: only the mocker engine runs disaggregated roles so far, "
                f"not {args.engine}"
            )
        if prefill and worker_count(args) < 1:
            raise TurnoutError("--num-prefill-workers needs decode workers (--num-workers >= 1)")
        check_engine_flags(args)  # here too: worker_argv passes only the engine's flags
        try:  # here, not in every child after it started: one line, at once
            check_parser_names(args.tool_call_parser, args.reasoning_parser)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.args = args
        # One store per tree (named by its HTTP port), not one per user: two trees on one
        # machine would otherwise serve each other's workers.
        self.store_path = args.store_path or default_file_store_path(f"serve-{args.port}")
        config = frontend_config(args)
        config.planes.store_path = self.store_path
        self.frontend = RegisteredFrontend(config)
        self.supervisors: list[WorkerSupervisor] = []
        self._watchers: list[asyncio.Task[None]] = []
        self._all_dead = asyncio.Event()
        #: The workers' link to this process (made by ``start``, closed by ``stop``).
        self._parent_pipe: ParentPipe | None = None

    @property
    def children(self) -> list[ChildProcess]:
        """The current process of every supervised worker."""
        return [s.process for s in self.supervisors if s.process is not None]

    async def start(self) -> None:
        threads = max(1, (os.cpu_count() or 2) // max(1, worker_count(self.args)))
        prefill = getattr(self.args, "num_prefill_workers", 0)
        role = "decode" if prefill else "aggregated"
        argv = worker_argv(self.args, self.store_path, threads, role=role)
        for i in range(num_worker_processes(self.args)):
            await self._supervise(argv, f"worker {i}")
        if prefill:
            argv = worker_argv(self.args, self.store_path, threads, role="prefill", count=prefill)
            await self._supervise(argv, "prefill workers")
        await self.frontend.start()
        log.info(
            "serving on %s with %d %s worker(s); Ctrl-C stops everything",
            self.frontend.url,
            worker_count(self.args),
            self.args.engine,
        )
        if progress_shown():
            self._watchers.append(asyncio.create_task(self._show_workers_coming_up()))

    async def _show_workers_coming_up(self) -> None:
        """On a terminal: a bar of the workers registered with the frontend, until all are,
        or for ``WORKERS_UP_VIEW_S`` at most (supervision says why a worker does not come)."""
        expected = worker_count(self.args)
        manager = self.frontend.manager
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WORKERS_UP_VIEW_S
        with progress_bar("workers ready", expected) as bar:
            while loop.time() < deadline:
                ready = sum(len(manager.model_instances(n)) for n in manager.list_models())
                bar.update(min(ready, expected))
                if ready >= expected:
                    return
                await asyncio.sleep(0.2)

    async def _supervise(self, argv: list[str], name: str) -> None:
        if self._parent_pipe is None:
            self._parent_pipe = ParentPipe()
        fd = self._parent_pipe.read_fd
        # On a terminal, the workers' lines pass through here, above the bar of them coming up.
        spawn = functools.partial(spawn_child, pass_fds=(fd,), relay_stderr=progress_shown())
        supervisor = WorkerSupervisor([*argv, "--parent-fd", str(fd)], name, spawn=spawn)
        await supervisor.start()
        self.supervisors.append(supervisor)
        self._watchers.append(asyncio.create_task(self._watch(supervisor)))

    async def _watch(self, supervisor: WorkerSupervisor) -> None:
        await supervisor.run()
        if supervisor.gave_up and all(s.gave_up for s in self.supervisors):
            self._all_dead.set()

    async def wait(self) -> None:
        """Until the frontend fails, or every worker was given up on (exit non-zero)."""
        frontend = asyncio.ensure_future(self.frontend.wait())
        all_dead = asyncio.ensure_future(self._all_dead.wait())
        try:
            await asyncio.wait({frontend, all_dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            all_dead.cancel()
            if not frontend.done():
                frontend.cancel()
        if frontend.done() and not frontend.cancelled():
            frontend.result()
        raise TurnoutError("every worker failed for good (see above); stopping")

    async def stop(self) -> None:
        for supervisor in self.supervisors:
            supervisor.stop()
        for child in self.children:
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)
        for child in self.children:
            try:
                await asyncio.wait_for(child.wait(), timeout=15)
            except TimeoutError:
                log.warning("worker pid %d did not stop in time; killing it", child.pid)
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                await child.wait()
        for task in self._watchers:
            task.cancel()
        try:
            await self.frontend.stop()
        finally:
            if self._parent_pipe is not None:  # the workers are gone: nobody reads it
                self._parent_pipe.close()
                self._parent_pipe = None


def run(args: argparse.Namespace) -> int:
    async def main() -> None:
        from .serve_in_process import InProcessServe  # it imports this module

        tree: ServeTree | InProcessServe = (
            InProcessServe(args) if args.in_process else ServeTree(args)
        )

        async def drain() -> None:  # the frontend first: workers drain in ``stop``
            if tree.frontend is not None:
                await tree.frontend.drain()

        await run_until_signal(tree.start, tree.stop, tree.wait, drain)

    return run_command(args, main)
