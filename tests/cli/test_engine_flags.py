"""``turnout serve`` hands each worker process exactly the engine flags its engine reads, from
the same table ``turnout worker`` checks flags against: every flag an engine reads arrives
with the value serve was given, and the worker accepts the command line."""

from __future__ import annotations

import pytest

from turnout.cli.engine_flags import ENGINE_FLAGS, check_engine_flags, engine_flags
from turnout.cli.main import build_parser
from turnout.cli.serve import worker_argv
from turnout.cli.worker import ENGINES

#: A value other than the default for each engine flag (None: a switch).
SAMPLES: dict[str, str | None] = {
    "context_length": "64",
    "n_ctx": "2048",
    "n_parallel": "2",
    "threads": "3",
    "max_waiting": "7",
    "max_batch_size": "4",
    "max_batch_tokens": "512",
    "echo_delay_ms": "1.5",
    "num_gpu_blocks": "100",
    "block_size": "32",
    "max_num_seqs": "9",
    "max_num_batched_tokens": "1000",
    "speedup_ratio": "0",
    "seed": "5",
    "dp_size": "2",
    "no_prefix_caching": None,
    "no_chunked_prefill": None,
    "fail_after_steps": "3",
    "lora_adapters": "a,b",
    "lora_load_ms": "2.0",
    "max_loras": "2",
}


def test_every_engine_flag_has_a_sample() -> None:
    assert set(SAMPLES) == set(ENGINE_FLAGS)


@pytest.mark.parametrize("engine", ENGINES)
def test_serve_passes_each_flag_the_engine_reads(engine: str) -> None:
    names = engine_flags(engine)
    assert names, f"{engine} reads no engine flag"
    given = ["--engine", engine]
    for name in names:
        given.append("--" + name.replace("_", "-"))
        if SAMPLES[name] is not None:
            given.append(SAMPLES[name])  # type: ignore[arg-type]
    parser = build_parser()
    serve = parser.parse_args(["serve", *given])
    check_engine_flags(serve)
    argv = worker_argv(serve, "/s", 1)
    assert argv[1:4] == ["-m", "turnout", "worker"]
    worker = build_parser().parse_args(argv[3:])
    check_engine_flags(worker)
    for name in names:
        assert getattr(worker, name) == getattr(serve, name), name
        assert getattr(worker, name) != worker.engine_flag_defaults[name], name
    other = {n for n in ENGINE_FLAGS if n not in names}
    passed = {a[2:].replace("-", "_") for a in argv if a.startswith("--")}
    assert not other & passed, f"{engine} workers got flags of other engines"
