"""The KV router's policy: the cost of each candidate worker, and the choice among them.

Two costs (``KvRouterConfig.router_cost``). ``ttft`` (the default) is the predicted seconds
to first token on the worker (``step_time.WorkerStepModel.predict_ttft``: its queued prefill,
this request's uncached prompt, its running decodes, through step times fitted from the
worker's reports). ``blocks`` is Dynamo's cost, in blocks:

::

    active_prefill_blocks = ceil(active_prefill_tokens / block_size)
    prefill_blocks        = max(active_prefill_blocks + new_blocks - overlap_blocks, 0)
    decode_blocks         = active_decode_blocks + new_blocks
    cost                  = overlap_score_weight * prefill_blocks + decode_blocks

A session's last worker (``preferred``) has ``session_weight`` of its smallest steps (TTFT
cost) or blocks (block cost) taken off its cost: ties and near-ties keep a conversation where
its context is, a clearly worse worker still loses it.

With ``itl_weight`` the TTFT cost also counts, weighted, the delay this request's prefill
inflicts on the requests decoding on the worker (each waits through it for its next token).

Temperature 0 takes the lowest cost; ties are broken with the injected ``rng``, so equal
workers share the load rather than the first one in the list taking it all. Temperature
``T > 0`` samples worker ``i`` with probability proportional to ``exp(-n_i / T)``, where
``n_i = (cost_i - min) / (max - min)`` is the cost normalised to [0, 1] (uniform when all
costs are equal): the scale of costs does not change how much ``T`` spreads.

The result, ``Selection``, is a msgspec struct, so it can be logged or returned to a user as
is; asked to ``explain``, it also lists every candidate's cost terms and probability.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence

import msgspec

from turnout.router.kv.active_sequences import ActiveSequences
from turnout.router.kv.base import OverlapScores, WorkerKey
from turnout.router.kv.config import KvRouterConfig, RouterCost
from turnout.router.kv.step_time import StepTimeModels
from turnout.router.kv.worker_load import WorkerLoads


class SelectionStatus(enum.StrEnum):
    SELECTED = "selected"
    #: Every candidate is busy: the caller queues the request or answers 503.
    ALL_BUSY = "all_busy"
    #: No candidate at all (no live instance, or none holds the requested adapter).
    NO_CANDIDATES = "no_candidates"


class CandidateCost(msgspec.Struct, frozen=True, omit_defaults=True):
    """One candidate's terms in the cost (blocks, and seconds for the TTFT cost). Positional
    fields: built once per candidate per decision, where keyword construction costs
    measurably more."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    active_prefill_blocks: int
    active_decode_blocks: int
    #: ``max(active_prefill_blocks + new_blocks - overlap_blocks, 0)``
    prefill_blocks: int
    #: ``active_decode_blocks + new_blocks``
    decode_blocks: int
    cost: float
    #: Sampling probability (temperature > 0 only).
    probability: float | None = None
    #: TTFT cost: the predicted seconds to first token on this worker.
    predicted_ttft_s: float | None = None
    #: Subtracted from ``cost``: this worker served the session's last turn.
    session_bonus: float | None = None
    #: TTFT cost with an ITL weight: seconds this request's prefill would stall the requests
    #: decoding on this worker, summed over them (added to ``cost`` times the weight).
    inflicted_delay_s: float | None = None

    @property
    def worker_key(self) -> WorkerKey:
        return WorkerKey(self.worker_id, self.dp_rank)


class Selection(msgspec.Struct, kw_only=True):
    """A routing decision and why it was made."""

    status: SelectionStatus
    worker_id: int | None = None
    dp_rank: int | None = None
    #: Leading prompt blocks the chosen worker already caches.
    overlap_blocks: int = 0
    #: ``ceil(prompt_tokens / block_size)``
    new_blocks: int = 0
    temperature: float = 0.0
    overlap_score_weight: float = 1.0
    #: The cost minimised: ``ttft`` (seconds) or ``blocks``.
    cost: RouterCost = RouterCost.BLOCKS
    #: TTFT cost: the chosen worker's predicted seconds to first token.
    predicted_ttft_s: float | None = None
    #: The worker of the session's last turn, when the request named a known session.
    preferred_worker_id: int | None = None
    candidates: list[CandidateCost] = msgspec.field(default_factory=list)
    #: Candidates left out because their load report says busy.
    busy: list[WorkerKey] = msgspec.field(default_factory=list)
    request_id: str | None = None

    @property
    def worker_key(self) -> WorkerKey | None:
        if self.worker_id is None:
            return None
        return WorkerKey(self.worker_id, self.dp_rank or 0)

    @property
    def ok(self) -> bool:
        return self.status is SelectionStatus.SELECTED


def select_worker(
    candidates: Sequence[WorkerKey],
    overlaps: OverlapScores,
    active: ActiveSequences,
    new_blocks: int,
    config: KvRouterConfig,
    rng: random.Random,
    *,
    loads: WorkerLoads | None = None,
    now: float = 0.0,
    request_id: str | None = None,
    num_tokens: int | None = None,
    step_models: StepTimeModels | None = None,
    preferred: WorkerKey | None = None,
    explain: bool = False,
) -> Selection:
    """Pick a worker for a request of ``new_blocks`` blocks (``num_tokens`` tokens) among
    ``candidates``.

    Busy workers (per ``loads`` at time ``now``) are left out and listed in ``busy``. The TTFT
    cost needs ``step_models`` (without them, the block cost is used); ``preferred`` (the
    worker of the session's last turn) gets the session bonus. With ``explain`` the
    selection lists every candidate's cost terms (and probability, temperature > 0); without
    it ``candidates`` is empty and only the decision is returned (the production path).
    """
    temperature = config.router_temperature
    weight = config.overlap_score_weight
    ttft = config.router_cost is RouterCost.TTFT and step_models is not None
    cost_name = RouterCost.TTFT if ttft else RouterCost.BLOCKS
    if not candidates:
        return Selection(
            status=SelectionStatus.NO_CANDIDATES,
            new_blocks=new_blocks,
            temperature=temperature,
            overlap_score_weight=weight,
            cost=cost_name,
            request_id=request_id,
        )
    bs = config.block_size
    if num_tokens is None:
        num_tokens = new_blocks * bs
    get_overlap = overlaps.scores.get
    get_counters = active.counters.get
    check_busy = loads is not None and loads.any_busy
    session_weight = config.session_weight if preferred is not None else 0.0
    itl_weight = config.itl_weight
    busy: list[WorkerKey] = []
    rows: list[CandidateCost] = []
    costs: list[float] = []
    for key in candidates:
        if check_busy and loads is not None and loads.is_busy(key, now):
            busy.append(key)
            continue
        overlap = get_overlap(key, 0)
        counters = get_counters(key)
        if counters is None:
            active_prefill = active_decode = 0
            queued_tokens = decodes = 0
        else:
            active_prefill = -(-counters.prefill_tokens // bs)
            active_decode = counters.decode_blocks
            queued_tokens = counters.prefill_tokens
            decodes = counters.num_requests - counters.prefill_requests
        prefill = active_prefill + new_blocks - overlap
        if prefill < 0:
            prefill = 0
        decode = active_decode + new_blocks
        if not ttft:
            cost = weight * prefill + decode
            if session_weight and key == preferred:
                cost -= session_weight
                # Positional: worker_id, dp_rank, overlap, active prefill/decode, prefill,
                # decode, cost, probability, predicted TTFT, session bonus.
                row = CandidateCost(
                    key[0], key[1], overlap, active_prefill, active_decode, prefill, decode,
                    cost, None, None, session_weight,
                )  # fmt: skip
            else:
                row = CandidateCost(
                    key[0], key[1], overlap, active_prefill, active_decode, prefill, decode, cost
                )
        else:
            assert step_models is not None
            model = step_models.get(key)
            new_tokens = num_tokens - overlap * bs
            predicted = model.predict_ttft(queued_tokens, new_tokens, decodes)
            bonus = 0.0
            if session_weight and key == preferred:
                bonus = session_weight * model.prefill_step_s(bs, decodes)
            inflicted = None
            cost = predicted - bonus
            if itl_weight and decodes:
                inflicted = decodes * model.predict_ttft(0, new_tokens, decodes)
                cost += itl_weight * inflicted
            row = CandidateCost(
                key[0], key[1], overlap, active_prefill, active_decode, prefill, decode,
                cost, None, predicted, bonus, inflicted,
            )  # fmt: skip
        costs.append(cost)
        rows.append(row)
    if not rows:
        return Selection(
            status=SelectionStatus.ALL_BUSY,
            new_blocks=new_blocks,
            temperature=temperature,
            overlap_score_weight=weight,
            cost=cost_name,
            busy=busy,
            request_id=request_id,
        )
    if temperature <= 0.0:
        chosen = _argmin_random_ties(costs, rng)
    else:
        probabilities = softmax_probabilities(costs, temperature)
        chosen = _sample(probabilities, rng)
        if explain:
            rows = [
                msgspec.structs.replace(row, probability=p)
                for row, p in zip(rows, probabilities, strict=True)
            ]
    best = rows[chosen]
    return Selection(
        status=SelectionStatus.SELECTED,
        worker_id=best.worker_id,
        dp_rank=best.dp_rank,
        overlap_blocks=best.overlap_blocks,
        new_blocks=new_blocks,
        temperature=temperature,
        overlap_score_weight=weight,
        cost=cost_name,
        predicted_ttft_s=best.predicted_ttft_s,
        preferred_worker_id=None if preferred is None else preferred.worker_id,
        candidates=rows if explain else [],
        busy=busy,
        request_id=request_id,
    )


def _argmin_random_ties(costs: list[float], rng: random.Random) -> int:
    lowest = min(costs)
    tied = [i for i, c in enumerate(costs) if c == lowest]
    return tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]


def softmax_probabilities(costs: Sequence[float], temperature: float) -> list[float]:
    """``p_i ∝ exp(-n_i / T)`` with ``n_i`` the cost normalised to [0, 1] (see module doc)."""
    lowest = min(costs)
    spread = max(costs) - lowest
    if spread <= 0.0:
        return [1.0 / len(costs)] * len(costs)
    scale = 1.0 / (spread * temperature)
    # Normalised costs are in [0, 1], so exp(-x / T) cannot overflow; it may underflow to 0
    # for tiny T, but the cheapest worker always has weight exp(0) = 1.
    weights = [math.exp(-(c - lowest) * scale) for c in costs]
    total = math.fsum(weights)
    return [w / total for w in weights]


def _sample(probabilities: list[float], rng: random.Random) -> int:
    r = rng.random()
    acc = 0.0
    for i, p in enumerate(probabilities):
        acc += p
        if r < acc:
            return i
    # Rounding left r above the running sum: take the likeliest (never a 0-probability one).
    return max(range(len(probabilities)), key=probabilities.__getitem__)
