"""``turnout router``: the KV router as a standalone service (see ``router.service``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from turnout.errors import ConfigError
from turnout.protocols.model import EndpointId
from turnout.router.service import RouterService
from turnout.runtime.planes import open_runtime

from .flags import add_flag, add_runtime_flags, planes_config
from .frontend import add_kv_router_flags, kv_router_config
from .lifecycle import run_command, run_until_signal
from .worker import DEFAULT_ENDPOINT

log = logging.getLogger("turnout.cli")


def register(sub: Any) -> None:
    p = sub.add_parser("router", help="run the KV router as a service that answers best_worker")
    add_flag(p, "--endpoint", default=DEFAULT_ENDPOINT, help="the workers' endpoint")
    add_flag(p, "--router-endpoint", default="turnout/router/best_worker",
             help="where this service registers (namespace/component/endpoint)")  # fmt: skip
    add_flag(p, "--block-size", type=int,
             help="KV block size (default: from the workers' model cards)")  # fmt: skip
    add_kv_router_flags(p)
    add_runtime_flags(p)
    p.set_defaults(run=run)


def _endpoint(flag: str, text: str) -> EndpointId:
    try:
        return EndpointId.parse(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


async def run_router(args: argparse.Namespace) -> None:
    workers = _endpoint("--endpoint", args.endpoint)
    endpoint = _endpoint("--router-endpoint", args.router_endpoint)
    config = kv_router_config(args)
    runtime = await open_runtime(planes_config(args))
    service = RouterService(
        runtime, workers, endpoint, config,
        block_size=args.block_size, share_active=not args.no_router_replica_sync,
    )  # fmt: skip

    async def start() -> None:
        await service.start()

    async def stop() -> None:
        try:
            await service.stop()
        finally:
            await runtime.shutdown()

    async def forever() -> None:
        await asyncio.Event().wait()

    await run_until_signal(start, stop, forever)


def run(args: argparse.Namespace) -> int:
    return run_command(args, lambda: run_router(args))
