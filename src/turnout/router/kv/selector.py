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
from typing import TypeVar

import msgspec
import numpy as np

from turnout.router.kv.active_sequences import ActiveSequences
from turnout.router.kv.base import OverlapScores, WorkerKey
from turnout.router.kv.config import KvRouterConfig, RouterCost
from turnout.router.kv.cost_table import CostTable
from turnout.router.kv.step_time import DECODES_UNIT, TOKENS_UNIT, StepTimeModels
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
    table: CostTable | None = None,
) -> Selection:
    """Pick a worker for a request of ``new_blocks`` blocks (``num_tokens`` tokens) among
    ``candidates``.

    Busy workers (per ``loads`` at time ``now``) are left out and listed in ``busy``. The TTFT
    cost needs ``step_models`` (without them, the block cost is used); ``preferred`` (the
    worker of the session's last turn) gets the session bonus. With ``explain`` the
    selection lists every candidate's cost terms (and probability, temperature > 0); without
    it ``candidates`` is empty and only the decision is returned (the production path).

    Every path takes the same decision: ``_CostTerms.row`` is the cost as written in the
    module docstring, ``_CostTerms.costs`` the same arithmetic inlined in one loop over the
    candidates (a call and a row object per candidate are most of a decision at a thousand
    workers) or, given a ``table`` (``cost_table.CostTable`` over ``active`` and
    ``step_models``) and at least its ``min_candidates``, in numpy over its arrays.
    """
    temperature = config.router_temperature
    weight = config.overlap_score_weight
    ttft = config.router_cost is RouterCost.TTFT and step_models is not None
    cost_name = RouterCost.TTFT if ttft else RouterCost.BLOCKS
    busy: list[WorkerKey] = []
    if candidates and loads is not None and loads.any_busy:
        is_busy = loads.is_busy
        free: list[WorkerKey] = []
        for key in candidates:
            (busy if is_busy(key, now) else free).append(key)
        candidates = free
    if not candidates:
        return Selection(
            status=SelectionStatus.ALL_BUSY if busy else SelectionStatus.NO_CANDIDATES,
            new_blocks=new_blocks,
            temperature=temperature,
            overlap_score_weight=weight,
            cost=cost_name,
            busy=busy,
            request_id=request_id,
        )
    terms = _CostTerms(
        overlaps,
        active,
        new_blocks,
        config,
        num_tokens=new_blocks * config.block_size if num_tokens is None else num_tokens,
        step_models=step_models if ttft else None,
        preferred=preferred,
    )
    rows: list[CandidateCost] = []
    costs: list[float] | np.ndarray
    if explain or (ttft and config.itl_weight):
        rows = [terms.row(key) for key in candidates]
        costs = [row.cost for row in rows]
    else:
        costs = terms.costs(candidates, table)
    probabilities: list[float] | None = None
    if temperature <= 0.0:
        chosen = _argmin_random_ties(costs, rng)
    else:
        probabilities = softmax_probabilities(
            costs.tolist() if isinstance(costs, np.ndarray) else costs, temperature
        )
        chosen = _sample(probabilities, rng)
    best = rows[chosen] if rows else terms.row(candidates[chosen])
    if explain and probabilities is not None:
        rows = [
            msgspec.structs.replace(row, probability=p)
            for row, p in zip(rows, probabilities, strict=True)
        ]
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


_Costs = TypeVar("_Costs", list[float], np.ndarray)


class _CostTerms:
    """One request's cost on any worker: ``row`` for one candidate (every term, readable),
    ``costs`` for many (the cost alone, the same operations in the same order, inlined)."""

    __slots__ = (
        "bs",
        "get_counters",
        "itl_weight",
        "new_blocks",
        "num_tokens",
        "overlaps",
        "preferred",
        "session_weight",
        "step_models",
        "weight",
    )

    def __init__(
        self,
        overlaps: OverlapScores,
        active: ActiveSequences,
        new_blocks: int,
        config: KvRouterConfig,
        *,
        num_tokens: int,
        step_models: StepTimeModels | None,
        preferred: WorkerKey | None,
    ) -> None:
        self.overlaps = overlaps.scores
        self.get_counters = active.counters_lookup
        self.new_blocks = new_blocks
        self.num_tokens = num_tokens
        self.bs = config.block_size
        self.weight = config.overlap_score_weight
        self.itl_weight = config.itl_weight
        self.step_models = step_models
        self.preferred = preferred
        self.session_weight = config.session_weight if preferred is not None else 0.0

    def row(self, key: WorkerKey) -> CandidateCost:
        """Every term of ``key``'s cost (``step_models`` set: the TTFT cost)."""
        bs, new_blocks = self.bs, self.new_blocks
        overlap = self.overlaps.get(key, 0)
        counters = self.get_counters(key)
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
        preferred = self.session_weight and key == self.preferred
        if self.step_models is None:
            cost = self.weight * prefill + decode
            if preferred:
                cost -= self.session_weight
            # Positional: worker_id, dp_rank, overlap, active prefill/decode, prefill,
            # decode, cost, probability, predicted TTFT, session bonus.
            return CandidateCost(
                key[0], key[1], overlap, active_prefill, active_decode, prefill, decode,
                cost, None, None, self.session_weight if preferred else None,
            )  # fmt: skip
        model = self.step_models.get(key)
        new_tokens = self.num_tokens - overlap * bs
        predicted = model.predict_ttft(queued_tokens, new_tokens, decodes)
        bonus = self.session_weight * model.prefill_step_s(bs, decodes) if preferred else 0.0
        inflicted = None
        cost = predicted - bonus
        if self.itl_weight and decodes:
            inflicted = decodes * model.predict_ttft(0, new_tokens, decodes)
            cost += self.itl_weight * inflicted
        return CandidateCost(
            key[0], key[1], overlap, active_prefill, active_decode, prefill, decode,
            cost, None, predicted, bonus, inflicted,
        )  # fmt: skip

    def costs(
        self, candidates: Sequence[WorkerKey], table: CostTable | None = None
    ) -> list[float] | np.ndarray:
        """``[row(key).cost for key in candidates]`` without the rows and without a call per
        candidate (no ITL weight); from ``table`` when given and there are enough candidates.
        The session's worker, if a candidate, is priced by ``row``."""
        bs, new_blocks, num_tokens = self.bs, self.new_blocks, self.num_tokens
        models = self.step_models
        if table is not None and len(candidates) >= table.min_candidates:
            return self._with_session(
                candidates,
                table.costs(
                    candidates,
                    self.overlaps,
                    ttft=models is not None,
                    new_blocks=new_blocks,
                    num_tokens=num_tokens,
                    block_size=bs,
                    weight=self.weight,
                ),
            )
        get_overlap = self.overlaps.get
        get_counters = self.get_counters
        costs: list[float] = []
        append = costs.append
        if models is None:
            weight = self.weight
            for key in candidates:
                counters = get_counters(key)
                prefill = new_blocks - get_overlap(key, 0)
                if counters is None:
                    decode = new_blocks
                else:
                    prefill -= counters.prefill_tokens // -bs  # + ceil(tokens / bs)
                    decode = counters.decode_blocks + new_blocks
                append(weight * (prefill if prefill > 0 else 0) + decode)
        else:
            get_model, default = models.lookup, models.default
            tokens_unit, decodes_unit = TOKENS_UNIT, DECODES_UNIT
            for key in candidates:
                # WorkerStepModel.predict_ttft, inlined (same operations, same order).
                a, b, c, e, mixed, budget = get_model(key, default).ttft_terms()
                counters = get_counters(key)
                new_tokens = num_tokens - get_overlap(key, 0) * bs
                work = new_tokens if new_tokens > 1 else 1
                if counters is None:
                    decodes = 0
                else:
                    work += counters.prefill_tokens
                    decodes = counters.num_requests - counters.prefill_requests
                chunk = budget - decodes
                if chunk < 1:
                    chunk = 1
                base = a + e * decodes / decodes_unit
                if decodes > 0:
                    base += mixed
                full, rest = divmod(work, chunk)
                total = 0.0
                if full:
                    p = chunk / tokens_unit
                    total = full * (base + b * p + c * p * p)
                if rest:
                    p = rest / tokens_unit
                    total += base + b * p + c * p * p
                append(total)
        return self._with_session(candidates, costs)

    def _with_session(self, candidates: Sequence[WorkerKey], costs: _Costs) -> _Costs:
        """``costs`` with the session's worker, if a candidate, priced by ``row``."""
        preferred = self.preferred
        if self.session_weight and preferred is not None:
            at = -1
            while True:  # list.index scans in C; a candidate may be listed twice
                try:
                    at = candidates.index(preferred, at + 1)
                except ValueError:
                    break
                costs[at] = self.row(preferred).cost
        return costs


def _argmin_random_ties(costs: list[float] | np.ndarray, rng: random.Random) -> int:
    """Index of the lowest cost; among equal lowest, one drawn with ``rng``. The scans run in C
    (``min``, ``list.index``, numpy): the common case, one cheapest worker, costs no Python
    loop."""
    if isinstance(costs, np.ndarray):
        tied_at = np.flatnonzero(costs == costs.min())
        if len(tied_at) == 1:
            return int(tied_at[0])
        return int(tied_at[rng.randrange(len(tied_at))])
    lowest = min(costs)
    first = costs.index(lowest)
    if costs.count(lowest) == 1:
        return first
    tied = [first]
    while True:
        try:
            tied.append(costs.index(lowest, tied[-1] + 1))
        except ValueError:
            break
    return tied[rng.randrange(len(tied))]


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
