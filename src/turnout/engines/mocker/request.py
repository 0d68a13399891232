"""One request inside the simulated engine: its tokens, its blocks, its lifecycle."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from turnout.protocols.llm import FinishReason


class RequestState(enum.Enum):
    """Lifecycle of a request in the scheduler::

    WAITING ──schedule──▶ RUNNING ──finish/abort──▶ FINISHED
       ▲                     │
       └─────preempt─────────┘        (WAITING ──abort──▶ FINISHED too)

    Orthogonal to the state, a request may be *paused* (``MockRequest.paused``): its reader
    fell behind, so the scheduler gives it no tokens until it is resumed (see
    ``Scheduler.pause``).
    """

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    RequestState.WAITING: frozenset({RequestState.RUNNING, RequestState.FINISHED}),
    RequestState.RUNNING: frozenset({RequestState.WAITING, RequestState.FINISHED}),
    RequestState.FINISHED: frozenset(),
}


@dataclass(slots=True, kw_only=True, eq=False)
class MockRequest:
    """A request's state. The scheduler owns every field; samplers only read.

    ``token_ids`` is prompt + output so far. ``num_computed`` tokens of it have KV in the
    cache; the scheduler schedules ``len(token_ids) - num_computed`` more (a prefill chunk,
    or 1 for a decode) and samples a token each time it catches up::

        token_ids  [ p0 p1 ... p(P-1) | o0 o1 ... o(k-1) ]
                   |<-- num_computed -->|   (decode: num_computed == len - 1)
        blocks     [ held full blocks (hashed) ][ private tail ]
    """

    request_id: str
    token_ids: list[int]
    prompt_len: int
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    #: When the request did not set ``max_tokens``: end with an EOS at ``max_tokens``.
    eos_at_end: bool
    eos_token_ids: frozenset[int]
    stop_token_ids: frozenset[int]
    lora_name: str | None = None
    #: The tenant's cache partition: seeds the block hashes, as the router's are seeded.
    cache_salt: str | None = None
    #: Per-request seed of the output tokens (derived from the prompt and the engine seed).
    token_seed: int = 0
    state: RequestState = RequestState.WAITING
    num_computed: int = 0
    num_output: int = 0
    #: Local and sequence hashes of every full block of ``token_ids`` (kept up to date).
    local_hashes: list[int] = field(default_factory=list)
    seq_hashes: list[int] = field(default_factory=list)
    #: Resident blocks this request holds a reference on: a prefix of ``seq_hashes``.
    held_hashes: list[int] = field(default_factory=list)
    #: Private (unhashed) blocks this request holds.
    num_private: int = 0
    #: Prompt tokens served from the cache at first scheduling; None until then.
    cached_tokens: int | None = None
    num_preemptions: int = 0
    #: Simulated time of the first output token (the end of the step that produced it).
    first_token_time: float | None = None
    #: Report each token's (simulated, deterministic) log probability.
    want_logprobs: bool = False
    #: Simulated alternatives to report per token (0: none).
    want_top: int = 0
    #: Disaggregated serving, prefill stage: when the request ends at its token limit, its
    #: blocks stay held (parked) for a decode worker instead of going back to the pool.
    hold_kv: bool = False
    #: Disaggregated serving, decode stage: leading tokens whose KV came from a prefill worker
    #: (stored at first admission instead of computed; 0 once admitted).
    imported_tokens: int = 0
    #: Its output is not being read: scheduled for nothing (no prefill chunk, no decode)
    #: until resumed. Set and cleared by ``Scheduler.pause`` / ``Scheduler.resume`` only.
    paused: bool = False
    finish_reason: FinishReason | None = None

    @property
    def num_blocks_held(self) -> int:
        return len(self.held_hashes) + self.num_private

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed (0 once decoding)."""
        return max(0, self.prompt_len - self.num_computed)

    def move_to(self, state: RequestState) -> None:
        """The one place a request changes state; an illegal move is a bug."""
        if state not in _ALLOWED[self.state]:
            raise RuntimeError(
                f"request {self.request_id}: illegal transition {self.state.value} -> {state.value}"
            )
        self.state = state
