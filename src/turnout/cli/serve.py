"""``turnout serve``: a frontend and N workers on one machine, in one process tree.

The frontend runs in this process; each worker is a child process (``turnout worker``) on the
same file store and TCP request plane. Ctrl-C (or SIGTERM) stops the workers, then the
frontend. A worker that dies is reported; the frontend keeps serving with the others.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import Any

from turnout.errors import TurnoutError
from turnout.frontend.service import Frontend
from turnout.runtime.discovery import default_file_store_path

from .flags import add_flag, add_runtime_flags
from .frontend import add_frontend_flags, add_kv_router_flags, frontend_config
from .lifecycle import run_command, run_until_signal
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
        default=2,
        type=int,
        help="workers to start (processes; the mocker simulates all in one)",
    )
    add_runtime_flags(p, planes=False)
    p.set_defaults(store="file", request_plane="tcp", event_plane="zmq")
    p.set_defaults(run=run)


def worker_argv(args: argparse.Namespace, store_path: str, threads: int) -> list[str]:
    """The ``turnout worker`` command line of one child, from serve's own flags."""
    argv = [
        sys.executable, "-m", "turnout", "worker",
        "--engine", args.engine,
        "--endpoint", args.endpoint,
        "--store", "file",
        "--store-path", store_path,
        "--request-plane", "tcp",
        "--event-plane", "zmq",
        "--lease-ttl", str(args.lease_ttl),
        "--log-level", args.log_level,
    ]  # fmt: skip
    if args.engine == "mocker":
        # One process simulates every worker: the mocker is built for many per process.
        argv += ["--num-workers", str(args.num_workers)]
    engine_flags = {
        "llamacpp": ("n_ctx", "n_parallel", "threads"),
        "echo": ("echo_delay_ms",),
        "mocker": ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                   "speedup_ratio", "seed", "dp_size", "no_prefix_caching", "no_chunked_prefill",
                   "max_waiting", "fail_after_steps"),
    }[args.engine]  # fmt: skip
    values = {name: getattr(args, name) for name in engine_flags}
    if args.engine == "llamacpp":
        values["threads"] = args.threads or threads
    for name in ("model_path", "model_name", "context_length"):
        values[name] = getattr(args, name)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


def num_worker_processes(args: argparse.Namespace) -> int:
    return 1 if args.engine == "mocker" and args.num_workers > 0 else args.num_workers


class ServeTree:
    def __init__(self, args: argparse.Namespace) -> None:
        if args.num_workers < 0:
            raise TurnoutError("--num-workers must be 0 or more")
        self.args = args
        self.store_path = args.store_path or default_file_store_path()
        config = frontend_config(args)
        config.planes.store_path = self.store_path
        self.frontend = Frontend(config)
        self.children: list[asyncio.subprocess.Process] = []
        self._watchers: list[asyncio.Task[None]] = []
        self._all_dead = asyncio.Event()

    async def start(self) -> None:
        threads = max(1, (os.cpu_count() or 2) // max(1, self.args.num_workers))
        argv = worker_argv(self.args, self.store_path, threads)
        for _ in range(num_worker_processes(self.args)):
            child = await asyncio.create_subprocess_exec(*argv, start_new_session=True)
            self.children.append(child)
            self._watchers.append(asyncio.create_task(self._watch(child)))
        await self.frontend.start()
        log.info(
            "serving on %s with %d %s worker(s); Ctrl-C stops everything",
            self.frontend.url,
            self.args.num_workers,
            self.args.engine,
        )

    async def _watch(self, child: asyncio.subprocess.Process) -> None:
        code = await child.wait()
        if code not in (0, -signal.SIGTERM, -signal.SIGINT):
            log.error("worker pid %d exited with %s", child.pid, code)
        if all(c.returncode is not None for c in self.children):
            self._all_dead.set()

    async def wait(self) -> None:
        await self.frontend.wait()

    async def stop(self) -> None:
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
        await self.frontend.stop()


def run(args: argparse.Namespace) -> int:
    async def main() -> None:
        tree = ServeTree(args)
        await run_until_signal(tree.start, tree.stop, tree.wait)

    return run_command(args, main)
