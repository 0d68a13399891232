"""Settings of the KV-aware router (one model). Every field becomes a CLI flag later."""

from __future__ import annotations

import enum
import math

import msgspec

from turnout.errors import ConfigError


class RouterCost(enum.StrEnum):
    """What the KV router minimises (``--router-cost``)."""

    #: The predicted time to first token, in seconds, from each worker's fitted step times
    #: (``step_time.py``): queued prefill + this request's uncached prefill + decode ride-along.
    TTFT = "ttft"
    #: Dynamo's cost in blocks: ``overlap_score_weight * prefill_blocks + decode_blocks``.
    BLOCKS = "blocks"


class KvRouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the KV router weighs cache overlap against load, and when a worker counts as busy.

    Block cost of sending a request of ``new_blocks`` blocks to a worker (DESIGN.md §3)::

        prefill_blocks = max(active_prefill_blocks + new_blocks - overlap_blocks, 0)
        decode_blocks  = active_decode_blocks + new_blocks
        cost           = overlap_score_weight * prefill_blocks + decode_blocks

    The TTFT cost (the default) is the predicted seconds to first token instead.
    """

    #: What is minimised: predicted seconds to first token, or Dynamo's blocks.
    router_cost: RouterCost = RouterCost.TTFT
    #: TTFT cost: weight of the delay this request's prefill inflicts on the requests decoding
    #: on the worker (each waits through it for its next token): ``decodes * own prefill``
    #: seconds, added to the cost. 0 (the default) ignores others' inter-token latency.
    itl_weight: float = 0.0
    #: Bonus of the worker that served a session's last turn (``x-session-id``): in TTFT cost,
    #: this many of that worker's smallest steps (one block's prefill); in block cost, this many
    #: blocks. 0 turns the preference off.
    session_weight: float = 1.0
    #: A session's preference lasts this long after its last turn.
    session_ttl_s: float = 600.0
    #: Most sessions remembered (least recently used go first).
    max_sessions: int = 65536

    #: Tokens per KV block; must equal the workers' ``kv_cache_block_size``.
    block_size: int = 16
    #: Weight of the prefill term (Dynamo's ``overlap_score_weight``; "prefill load scale").
    #: Higher favours cache hits and light prefill queues; 0 ignores both.
    overlap_score_weight: float = 1.0
    #: 0 picks the cheapest worker (ties at random); > 0 samples from a softmax of the
    #: normalised negative costs, spreading load at the price of some cache hits.
    router_temperature: float = 0.0
    #: True: exact index from workers' KV events. False: approximate index from the router's
    #: own decisions (``--no-kv-events``).
    use_kv_events: bool = True
    #: Approximate mode: how long a routed prefix is predicted to stay cached.
    approx_ttl_s: float = 120.0
    #: Safety net: an in-flight request never freed (lost stream end) is dropped after this.
    active_request_ttl_s: float = 600.0
    #: A worker whose last load report has ``kv_usage`` above this is busy (None: never).
    busy_kv_usage_threshold: float | None = None
    #: A worker whose last load report has more waiting requests than this is busy (None: never).
    busy_num_waiting_threshold: int | None = None
    #: A load report older than this no longer marks its worker busy.
    load_report_ttl_s: float = 10.0
    #: The ``event_id`` of a worker's first KV event (None: accept any id as the first).
    first_event_id: int | None = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"kv block size must be positive, got {self.block_size}")
        _check_finite("overlap_score_weight", self.overlap_score_weight, minimum=0.0)
        _check_finite("router_temperature", self.router_temperature, minimum=0.0)
        _check_finite("session_weight", self.session_weight, minimum=0.0)
        _check_finite("itl_weight", self.itl_weight, minimum=0.0)
        if self.max_sessions <= 0:
            raise ConfigError(f"max_sessions must be positive, got {self.max_sessions}")
        for name in ("approx_ttl_s", "active_request_ttl_s", "load_report_ttl_s", "session_ttl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
        threshold = self.busy_kv_usage_threshold
        if threshold is not None and not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"busy_kv_usage_threshold must be in [0, 1], got {threshold}")
        limit = self.busy_num_waiting_threshold
        if limit is not None and limit < 0:
            raise ConfigError(f"busy_num_waiting_threshold must be >= 0, got {limit}")


def _check_finite(name: str, value: float, *, minimum: float) -> None:
    if not (math.isfinite(value) and value >= minimum):
        raise ConfigError(f"{name} must be a finite number >= {minimum}, got {value}")
