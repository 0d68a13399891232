"""MockerConfig.validate: bad settings fail at start-up with a message naming them."""

from __future__ import annotations

from typing import Any

import pytest

from turnout.engines.mocker import MockerConfig, MockerEngine, make_mocker_engines
from turnout.errors import ConfigError


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"block_size": -16}, "block_size must be a positive integer"),
        ({"block_size": 1 << 20}, "block_size"),
        ({"num_gpu_blocks": 0}, "num_gpu_blocks must be a positive integer"),
        ({"num_gpu_blocks": 10**12}, "lower --num-gpu-blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"speedup_ratio": -1.0}, "speedup_ratio"),
        ({"speedup_ratio": float("nan")}, "speedup_ratio"),
        ({"vocab_size": 1}, "vocab_size"),
        ({"eos_token_ids": [50000]}, "outside vocab_size"),
        ({"dp_size": 0}, "dp_size"),
        ({"load_report_interval_s": 0.0}, "load_report_interval_s"),
    ],
)
def test_bad_config_is_a_config_error(changes: dict[str, Any], message: str) -> None:
    cfg = MockerConfig(**changes)
    with pytest.raises(ConfigError, match=message):
        cfg.validate()
    with pytest.raises(ConfigError):
        MockerEngine(cfg)  # the engine refuses it at construction too


def test_defaults_are_valid() -> None:
    MockerConfig().validate()


def test_memory_check_counts_every_worker_in_the_process() -> None:
    cfg = MockerConfig(num_gpu_blocks=1_000_000)
    cfg.validate(num_workers=1, memory_bytes=2**30)
    with pytest.raises(ConfigError, match="64 worker"):
        cfg.validate(num_workers=64, memory_bytes=2**30)
    with pytest.raises(ConfigError, match="num_workers"):
        make_mocker_engines(cfg, 0)
