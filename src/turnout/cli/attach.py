"""``turnout attach``: running vLLM, SGLang, llama.cpp or OpenAI-compatible servers as worker
instances of a model, each under its own lease (see ``engines.attach.server``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

from turnout.errors import ConfigError
from turnout.llm.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, check_parser_names
from turnout.protocols.model import EndpointId
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.planes import open_runtime
from turnout.runtime.process_metrics import StoreContactCollector
from turnout.runtime.start_checks import check_worker_start
from turnout.runtime.system_server import SystemServer

from .flags import add_flag, add_runtime_flags, env_name, planes_config
from .lifecycle import run_command, run_until_signal
from .system_port import (
    AttachCollector,
    AttachHealth,
    EngineCollector,
    add_system_flags,
    advertise_system_metrics,
    attach_engines,
    system_server,
)

if TYPE_CHECKING:
    from turnout.engines.attach.server import AttachedServer

log = logging.getLogger("turnout.cli")

DEFAULT_ENDPOINT = "turnout/backend/generate"
API_CHOICES = ("vllm", "sglang", "llamacpp", "openai")


def _repeated(parser: argparse.ArgumentParser, flag: str, help_text: str, **kw: Any) -> None:
    """A repeatable flag whose environment variable holds comma-separated values."""
    env = env_name(flag)
    raw = os.environ.get(env)
    default = [v.strip() for v in raw.split(",") if v.strip()] if raw else None
    parser.add_argument(flag, action="append", default=None, help=f"{help_text} [env {env}, "
                        "comma-separated]", **kw)  # fmt: skip
    parser.set_defaults(**{f"{flag.lstrip('-').replace('-', '_')}_env": default})


def register(sub: Any) -> None:
    p = sub.add_parser(
        "attach",
        help="register running vLLM / SGLang / llama.cpp / OpenAI-compatible servers as "
        "worker instances",
    )
    _repeated(p, "--url", "base URL of a running server (repeat for several: each is its own "
              "instance)", metavar="URL")  # fmt: skip
    add_flag(p, "--api", choices=API_CHOICES,
             help="the servers' API: vllm, sglang, llamacpp (tokens mode: the frontend "
                  "tokenizes, routes on KV and migrates) or openai (text mode: relayed as is); "
                  "default: detected from what each server answers")  # fmt: skip
    _repeated(p, "--kv-events", "the server's KV-events publisher (tcp://HOST:PORT, its "
              "--kv-events-config endpoint); with several --url, one per --url in the same "
              "order; with one --url, one per data-parallel rank", metavar="ENDPOINT")  # fmt: skip
    _repeated(p, "--kv-events-replay", "the replay socket of each --kv-events (same order)",
              metavar="ENDPOINT")  # fmt: skip
    add_flag(p, "--tokenizer", metavar="PATH",
             help="tokens mode: the model's Hugging Face folder (tokenizer.json, chat template) "
                  "or GGUF file; checked against each server's tokenizer (default: the path "
                  "the server loaded, when it exists on this machine)")  # fmt: skip
    add_flag(p, "--model-name", help="served model name (default: the server's)")
    add_flag(p, "--block-size", type=int,
             help="KV block size of the card (default: the server's; llama.cpp: 16)")  # fmt: skip
    add_flag(p, "--endpoint", default=DEFAULT_ENDPOINT, help="namespace/component/endpoint")
    add_flag(p, "--tool-call-parser", metavar="NAME",
             help="how the model writes tool calls, read by the frontend (one of: "
                  f"{', '.join(TOOL_CALL_PARSERS)}; tokens mode)")  # fmt: skip
    add_flag(p, "--reasoning-parser", metavar="NAME",
             help=f"how the model writes its reasoning (one of: {', '.join(REASONING_PARSERS)}; "
                  "tokens mode)")  # fmt: skip
    add_flag(p, "--device-type", choices=["cpu", "gpu"],
             help="device announced in the card (default: llama.cpp cpu, else gpu)")  # fmt: skip
    g = p.add_argument_group("deadlines and bounds (per server)")
    add_flag(g, "--connect-timeout", default=3.0, type=float,
             help="seconds to open a connection to a server")  # fmt: skip
    add_flag(g, "--first-token-timeout", default=300.0, type=float,
             help="seconds from sending a request to its first streamed event (queue and "
                  "prefill); past it the request fails over to another instance")  # fmt: skip
    add_flag(g, "--idle-timeout", default=30.0, type=float,
             help="seconds a stream may stay silent; past it the request fails over to another "
                  "instance and the server's health is checked")  # fmt: skip
    add_flag(g, "--probe-timeout", default=5.0, type=float,
             help="seconds for each health, metrics, tokenize or description call")  # fmt: skip
    add_flag(g, "--pool-size", default=64, type=int,
             help="HTTP/1.1 keep-alive connections per server (requests in flight)")  # fmt: skip
    add_flag(g, "--max-waiting", default=256, type=int,
             help="requests waiting for a connection per server; more are refused as "
                  "overloaded (503)")  # fmt: skip
    add_flag(g, "--health-interval", default=2.0, type=float,
             help="seconds between health checks; an unanswered one (or two failed in a row) "
                  "takes the instance out of discovery")  # fmt: skip
    add_flag(g, "--load-interval", default=1.0, type=float,
             help="seconds between reads of a server's metrics (its load)")  # fmt: skip
    add_flag(g, "--retry-interval", default=2.0, type=float,
             help="seconds between attempts to bring back a server that is set aside or does "
                  "not answer")  # fmt: skip
    add_flag(g, "--drain-timeout", default=5.0, type=float,
             help="on SIGTERM, seconds in-flight requests may finish")  # fmt: skip
    add_system_flags(p)
    add_runtime_flags(p)
    p.set_defaults(run=run)


def _values(args: argparse.Namespace, name: str) -> list[str]:
    given = getattr(args, name)
    return list(given) if given else list(getattr(args, f"{name}_env") or [])


def kv_assignment(
    urls: list[str], events: list[str], replays: list[str]
) -> list[tuple[list[str], list[str | None]]]:
    """Each URL's (publishers, replay sockets), from the flags' order (see ``--kv-events``)."""
    if replays and len(replays) != len(events):
        raise ConfigError(
            f"--kv-events-replay: give one per --kv-events ({len(events)}), not {len(replays)}"
        )
    paired: list[str | None] = list(replays) if replays else [None] * len(events)
    if not events:
        return [([], []) for _ in urls]
    if len(urls) == 1:
        return [(events, paired)]
    if len(events) != len(urls):
        raise ConfigError(
            f"--kv-events: with {len(urls)} --url, give one per --url in the same order "
            f"(got {len(events)})"
        )
    return [([e], [r]) for e, r in zip(events, paired, strict=True)]


def settings_from(args: argparse.Namespace) -> Any:
    from turnout.engines.attach.server import AttachSettings
    from turnout.engines.attach.upstream import Deadlines

    try:
        endpoint = EndpointId.parse(args.endpoint)
    except ValueError as exc:
        raise ConfigError(f"--endpoint: {exc}") from None
    try:
        check_parser_names(args.tool_call_parser, args.reasoning_parser)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if (args.tool_call_parser or args.reasoning_parser) and args.api == "openai":
        raise ConfigError("--tool-call-parser and --reasoning-parser: an openai (text mode) "
                          "server parses its own output")  # fmt: skip
    if args.tokenizer is not None and not os.path.exists(args.tokenizer):
        raise ConfigError(f"--tokenizer: {args.tokenizer} does not exist")
    if args.block_size is not None and args.block_size < 1:
        raise ConfigError(f"--block-size must be at least 1, got {args.block_size}")
    for flag in ("pool_size", "max_waiting"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1")
    for flag in ("health_interval", "load_interval", "retry_interval"):
        if not getattr(args, flag) > 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive")
    try:
        deadlines = Deadlines(
            connect=args.connect_timeout,
            first_byte=args.first_token_timeout,
            idle=args.idle_timeout,
            probe=args.probe_timeout,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return AttachSettings(
        endpoint=endpoint,
        api=args.api,
        model_name=args.model_name,
        block_size=args.block_size,
        deadlines=deadlines,
        pool_size=args.pool_size,
        max_waiting=args.max_waiting,
        health_interval=args.health_interval,
        load_interval=args.load_interval,
        retry_interval=args.retry_interval,
        drain_timeout=args.drain_timeout,
        device_type=args.device_type,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )


async def run_attach(args: argparse.Namespace) -> None:
    from turnout.engines.attach.cards import TokenizerSource
    from turnout.engines.attach.server import AttachedServer

    urls = _values(args, "url")
    if not urls:
        raise ConfigError("give at least one --url (the base URL of a running server)")
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise ConfigError(f"--url must be an http:// or https:// URL, got {bad[0]!r}")
    if len(set(urls)) != len(urls):
        raise ConfigError("--url: a server is named twice")
    kv = kv_assignment(urls, _values(args, "kv_events"), _values(args, "kv_events_replay"))
    settings = settings_from(args)
    tokenizers = TokenizerSource(args.tokenizer)
    servers: list[AttachedServer] = []
    health = AttachHealth(servers, len(urls))
    collectors = [
        AttachCollector(servers),
        EngineCollector(attach_engines(servers)),
        StoreContactCollector(lambda: servers[0].runtime.store if servers else None),
    ]
    system = system_server(args, "attach", health.checks, collectors, health.details)
    # Up before the store and the servers: /live answers while they start.
    if system is not None:
        await system.start()
    try:
        runtime = await open_runtime(planes_config(args))
        advertise_system_metrics(system, runtime)
        servers += [
            AttachedServer(runtime, url, settings, tokenizers, kv_endpoints=e, kv_replays=r)
            for url, (e, r) in zip(urls, kv, strict=True)
        ]
        await _serve_attached(runtime, servers, system)
    finally:
        if system is not None:
            system.stop()


async def _serve_attached(
    runtime: DistributedRuntime, servers: list[AttachedServer], system: SystemServer | None
) -> None:
    """Attach ``servers`` and keep them attached until a signal."""
    tasks: list[asyncio.Task[None]] = []

    async def start() -> None:
        for server in servers:
            await server.first_start()
        await check_worker_start(runtime)  # frontends on its planes, its addresses reach it
        for server in servers:
            tasks.append(asyncio.create_task(server.run(), name=f"attach {server.url}"))

    async def stop() -> None:
        if system is not None:
            system.drain()  # readiness goes first, then the instances leave
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        try:
            await asyncio.gather(*(s.stop() for s in servers))
        finally:
            await runtime.shutdown()

    async def wait() -> None:
        """Until a supervisor fails (a bug: its loop handles every server failure)."""
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    await run_until_signal(start, stop, wait)


def run(args: argparse.Namespace) -> int:
    return run_command(args, lambda: run_attach(args))
