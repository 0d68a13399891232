"""Which engine reads which engine-specific flag: one table that ``turnout worker`` checks
given flags against (``check_engine_flags``) and ``turnout serve`` builds its workers'
command lines from (``engine_flags``), so the two never disagree about an engine."""

from __future__ import annotations

import argparse

from turnout.errors import ConfigError

_MOCKER = ("mocker",)
#: Each engine-specific flag (its argparse dest) and the engines that read it. Given to
#: another engine (a value other than its default), it is refused rather than accepted and
#: ignored.
ENGINE_FLAGS: dict[str, tuple[str, ...]] = {
    "context_length": ("echo", "mocker", "embeddings"),
    "n_ctx": ("llamacpp",),
    "n_parallel": ("llamacpp",),
    "threads": ("llamacpp", "embeddings", "onnx"),
    "max_waiting": ("mocker", "llamacpp", "embeddings", "onnx", "numeric"),
    "max_batch_size": ("embeddings",),
    "max_batch_tokens": ("embeddings",),
    "echo_delay_ms": ("echo",),
    **dict.fromkeys(
        (
            "num_gpu_blocks",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "speedup_ratio",
            "seed",
            "dp_size",
            "no_prefix_caching",
            "no_chunked_prefill",
            "fail_after_steps",
            "lora_adapters",
            "lora_load_ms",
            "max_loras",
        ),
        _MOCKER,
    ),
}


def engine_flags(engine: str) -> tuple[str, ...]:
    """The engine-specific flags (argparse dests) that ``engine`` reads, in table order."""
    return tuple(name for name, engines in ENGINE_FLAGS.items() if engine in engines)


def check_engine_flags(args: argparse.Namespace) -> None:
    """``ConfigError`` naming the first flag set for an engine other than ``--engine``.

    ``args.engine_flag_defaults`` holds each flag's value when not given (environment
    included), as ``add_worker_flags`` records it."""
    defaults: dict[str, object] = getattr(args, "engine_flag_defaults", {})
    for name, engines in ENGINE_FLAGS.items():
        if args.engine in engines or name not in defaults:
            continue
        if getattr(args, name) != defaults[name]:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(
                f"{flag} is read by the {', '.join(engines)} engine"
                f"{'s' if len(engines) > 1 else ''}, not by {args.engine}; leave it out"
            )
