"""``turnout serve --in-process``: the frontend and its engine in one process.

For the smallest deployments (one model on one machine, nothing to supervise but this
process) and for measuring what the planes cost: the frontend's pipelines are the same, the
worker is the same ``Worker`` around the same engine, but discovery is an in-memory store and
the request plane a direct hand-over between tasks (``local``: no socket, no serialization
of the stream's framing, items passed by reference). The model watcher sees the worker's card
as it would over etcd, so every route, check and error is the one of a distributed
deployment.

An engine that fails cannot be restarted from here: the process exits non-zero with one line
(a supervisor — systemd, Kubernetes — restarts it), as ``turnout worker`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

from turnout.engines.worker import Worker
from turnout.errors import ConfigError, TurnoutError
from turnout.frontend.service import Frontend
from turnout.llm.parsers import check_parser_names
from turnout.protocols.model import EndpointId
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.planes import PlanesConfig, open_runtime
from turnout.runtime.progress import progress_bar

from .frontend import frontend_config
from .serve import worker_count
from .worker import make_engines

log = logging.getLogger("turnout.serve")

#: The planes of an in-process deployment: nothing outside the process.
IN_PROCESS_PLANES = PlanesConfig(store="memory", request_plane="local", event_plane="local")
#: Flags of the planes' credentials, which a deployment without planes has no use for.
PLANE_TLS_FLAGS = ("plane_ca", "plane_cert", "plane_key")


class InProcessServe:
    def __init__(self, args: argparse.Namespace) -> None:
        given = ["--" + n.replace("_", "-") for n in PLANE_TLS_FLAGS if getattr(args, n, None)]
        if given:
            # Refused rather than ignored: an operator who gave them expects authenticated planes.
            raise ConfigError(
                f"{', '.join(given)}: in-process serving opens no plane (its store, request and "
                "event planes are in memory, nothing to authenticate); not with --in-process"
            )
        if getattr(args, "num_prefill_workers", 0):
            raise ConfigError(
                "--num-prefill-workers: disaggregated serving runs its workers as processes; "
                "not with --in-process"
            )
        self.count = worker_count(args)
        if self.count < 1:
            raise ConfigError("--in-process needs an engine: --num-workers must be at least 1")
        try:
            check_parser_names(args.tool_call_parser, args.reasoning_parser)
            self.endpoint = EndpointId.parse(args.endpoint)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.args = args
        self.config = frontend_config(args)
        self.config.planes = IN_PROCESS_PLANES
        self.runtime: DistributedRuntime | None = None
        self.frontend: Frontend | None = None
        self.workers: list[Worker] = []

    async def start(self) -> None:
        args = self.args
        self.runtime = await open_runtime(self.config.planes)
        # The frontend first: /live answers while the engine loads, /health says why not yet.
        self.frontend = Frontend(self.config, runtime=self.runtime)
        await self.frontend.start()
        threads = max(1, os.cpu_count() or 2)
        with progress_bar("workers ready", self.count) as bar:
            for engine in make_engines(args, self.count, threads=threads):
                worker = Worker(
                    self.runtime,
                    engine,
                    self.endpoint,
                    model_name=args.model_name,
                    device_type=getattr(args, "device_type", None),
                    tool_call_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser,
                )
                self.workers.append(worker)
                await worker.start()
                bar.update(len(self.workers))
        log.info(
            "serving on %s with %d in-process %s engine(s); Ctrl-C stops everything",
            self.frontend.url,
            len(self.workers),
            args.engine,
        )

    async def wait(self) -> None:
        """Until the frontend or an engine fails (raised: the command exits non-zero)."""
        assert self.frontend is not None
        waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(self.frontend.wait())]
        waits += [asyncio.ensure_future(w.failed.wait()) for w in self.workers]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits[1:]:
                waiter.cancel()
            if not waits[0].done():
                waits[0].cancel()
        if waits[0].done() and not waits[0].cancelled():
            waits[0].result()
        failed = next(w for w in self.workers if w.failed.is_set())
        raise TurnoutError(f"in-process engine failed ({failed.failure}); exiting")

    async def stop(self) -> None:
        try:
            for worker in self.workers:
                await worker.stop(self.args.drain_timeout)
        finally:
            if self.frontend is not None:
                await self.frontend.stop()
            if self.runtime is not None:
                await self.runtime.shutdown()
