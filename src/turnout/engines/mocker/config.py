"""The mocker's settings: every knob of the simulated engine, checked once at start-up.

Names follow vLLM's flags (``--num-gpu-blocks``, ``--block-size``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--enable-prefix-caching``, ``--enable-chunked-prefill``) so a
benchmark written against vLLM reads the same against the mocker.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from turnout.errors import ConfigError

#: An upper estimate of what the mocker keeps per resident KV block (a slotted record, a dict
#: slot, an LRU slot): used to refuse a ``num_gpu_blocks`` that would not fit in RAM.
BOOKKEEPING_BYTES_PER_BLOCK = 400
#: The share of physical memory the block bookkeeping of all workers may claim.
MAX_MEMORY_SHARE = 0.5
#: ``MockerConfig.role`` and ``kv_transfer`` values (``protocols.model.WorkerRole`` and
#: ``protocols.disagg.KvTransferMode``).
ROLES = ("aggregated", "prefill", "decode")
KV_TRANSFER_MODES = ("pull", "push")
#: Larger blocks than this are surely a typo (vLLM's largest is 256; Dynamo's mocker allows more).
MAX_BLOCK_SIZE = 65536


def physical_memory_bytes() -> int | None:
    """Total RAM of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(slots=True, kw_only=True)
class MockerConfig:
    """Settings of one simulated worker (``make_mocker_engines`` shares one among N workers).

    Plain data: construct it, then call ``validate()`` (the engine does) before use.
    """

    #: KV blocks in the simulated GPU pool.
    num_gpu_blocks: int = 16384
    #: Tokens per KV block; also the block size of the hashes in KV events.
    block_size: int = 64
    #: Most requests in the running batch.
    max_num_seqs: int = 256
    #: Most tokens (prefill chunks + decodes) scheduled in one step.
    max_num_batched_tokens: int = 8192
    #: Reuse resident blocks of an identical prefix (and report cached tokens).
    enable_prefix_caching: bool = True
    #: Split a long prompt over several steps; when off, a prompt longer than
    #: ``max_num_batched_tokens`` is refused with a per-request error.
    enable_chunked_prefill: bool = True
    #: Every simulated duration is divided by this; 0 means do not wait at all.
    speedup_ratio: float = 1.0
    #: Seed of the deterministic output tokens.
    seed: int = 0
    vocab_size: int = 32000
    #: Used when a request names no ``eos_token_ids`` of its own.
    eos_token_ids: list[int] = field(default_factory=lambda: [2])
    #: Output length of a request that sets no ``max_tokens``: that many tokens, the last an
    #: EOS (unless ``ignore_eos``). A real model decides this; the mocker needs a rule.
    default_max_tokens: int = 128
    #: Data-parallel ranks per worker: each rank is an independent pool and scheduler.
    dp_size: int = 1
    #: Seconds between steady load reports (reports on change come in between).
    load_report_interval_s: float = 1.0
    #: Most requests in the waiting queue (per rank); more are refused as ``overloaded``.
    max_waiting: int = 1024
    #: Seconds the step loop may go without stepping while it has work before the health
    #: probe calls the engine stuck.
    health_timeout_s: float = 30.0
    #: Testing aid (fault injection): the step loop raises after this many steps (0: never).
    fail_after_steps: int = 0
    #: LoRA adapters this worker can load (name -> path or None; see ``mocker.lora``), the
    #: simulated cold-load time of one, and how many may be resident at once (LRU eviction).
    lora_adapters: dict[str, str | None] = field(default_factory=dict)
    lora_load_ms: float = 0.0
    max_loras: int = 4
    #: Disaggregated serving (``protocols.disagg``): the part of requests this worker runs
    #: (``aggregated``, ``prefill``, ``decode``) and, on a prefill worker, how its KV reaches
    #: the decode side (``pull`` or ``push``).
    role: str = "aggregated"
    kv_transfer: str = "pull"
    #: KV bytes per token of the simulated model (Llama-3-8B in fp16: 32 layers x 8 KV heads
    #: x 128 dims x 2 (K and V) x 2 bytes) and the link's bandwidth in GB/s (a 200 Gb/s RDMA
    #: NIC): a transfer takes tokens x bytes / bandwidth (divided by the speedup).
    kv_bytes_per_token: int = 131072
    kv_transfer_bandwidth_gbps: float = 25.0
    #: Wall seconds a prefill worker keeps a handle's blocks for its decode worker at most.
    kv_handle_ttl_s: float = 30.0
    #: Wall seconds a decode worker waits for a handle's KV (pull reply or push) at most.
    kv_transfer_timeout_s: float = 30.0

    def validate(self, *, num_workers: int = 1, memory_bytes: int | None = None) -> None:
        """Raise ``ConfigError`` naming the first bad setting.

        ``memory_bytes`` defaults to this machine's RAM; ``num_workers`` is how many workers
        will share the process (their bookkeeping adds up).
        """
        _positive_int("block_size", self.block_size)
        if self.block_size > MAX_BLOCK_SIZE:
            raise ConfigError(f"block_size {self.block_size} is larger than {MAX_BLOCK_SIZE}")
        _positive_int("num_gpu_blocks", self.num_gpu_blocks)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("dp_size", self.dp_size)
        _positive_int("default_max_tokens", self.default_max_tokens)
        _positive_int("num_workers", num_workers)
        _positive_int("max_waiting", self.max_waiting)
        if isinstance(self.fail_after_steps, bool) or not isinstance(self.fail_after_steps, int):
            raise ConfigError(f"fail_after_steps must be an integer, got {self.fail_after_steps!r}")
        if self.fail_after_steps < 0:
            raise ConfigError(f"fail_after_steps must be >= 0, got {self.fail_after_steps}")
        if not (math.isfinite(self.health_timeout_s) and self.health_timeout_s > 0):
            raise ConfigError(f"health_timeout_s must be > 0, got {self.health_timeout_s!r}")
        if not isinstance(self.vocab_size, int) or self.vocab_size < 2:
            raise ConfigError(f"vocab_size must be an integer >= 2, got {self.vocab_size!r}")
        bad_eos = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad_eos:
            raise ConfigError(f"eos_token_ids {bad_eos} are outside vocab_size {self.vocab_size}")
        if len(set(self.eos_token_ids)) >= self.vocab_size:
            raise ConfigError("eos_token_ids cover the whole vocabulary")
        if not (math.isfinite(self.speedup_ratio) and self.speedup_ratio >= 0):
            raise ConfigError(
                f"speedup_ratio must be a finite number >= 0 (0: no waiting), "
                f"got {self.speedup_ratio!r}"
            )
        if not (math.isfinite(self.load_report_interval_s) and self.load_report_interval_s > 0):
            raise ConfigError(
                f"load_report_interval_s must be > 0, got {self.load_report_interval_s!r}"
            )
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.kv_transfer not in KV_TRANSFER_MODES:
            raise ConfigError(
                f"kv_transfer must be one of {', '.join(KV_TRANSFER_MODES)}, "
                f"got {self.kv_transfer!r}"
            )
        _positive_int("kv_bytes_per_token", self.kv_bytes_per_token)
        for name in ("kv_transfer_bandwidth_gbps", "kv_handle_ttl_s", "kv_transfer_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        from turnout.engines.mocker.lora import validate_lora_settings

        validate_lora_settings(self.lora_adapters, self.lora_load_ms, self.max_loras)
        memory = physical_memory_bytes() if memory_bytes is None else memory_bytes
        if memory is not None:
            need = self.bookkeeping_bytes() * num_workers
            if need > memory * MAX_MEMORY_SHARE:
                raise ConfigError(
                    f"num_gpu_blocks={self.num_gpu_blocks} x dp_size={self.dp_size} x "
                    f"{num_workers} worker(s) needs about {need / 2**30:.1f} GiB of block "
                    f"bookkeeping, more than {MAX_MEMORY_SHARE:.0%} of this machine's "
                    f"{memory / 2**30:.1f} GiB; lower --num-gpu-blocks"
                )

    def bookkeeping_bytes(self) -> int:
        """Upper estimate of one worker's block bookkeeping when its pools are full."""
        return self.num_gpu_blocks * self.dp_size * BOOKKEEPING_BYTES_PER_BLOCK

    def transfer_seconds(self, num_bytes: int) -> float:
        """Wall seconds moving ``num_bytes`` of KV takes (0 at speedup 0)."""
        if self.speedup_ratio <= 0:
            return 0.0
        return num_bytes / (self.kv_transfer_bandwidth_gbps * 1e9) / self.speedup_ratio

    @property
    def max_context_tokens(self) -> int:
        """The most tokens one request can hold: the whole pool."""
        return self.num_gpu_blocks * self.block_size


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
