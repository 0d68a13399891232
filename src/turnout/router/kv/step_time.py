"""How long each worker's engine steps take, learnt from what it reports, and the time to first
token (TTFT) that a request would see there.

Workers send a sample of their steps with every load report (``StepSample``: prompt tokens
computed, requests decoded, KV cache in use, wall seconds). Per worker two least-squares fits
are kept::

    prefill step:  t = a + b·P + c·P² + e·B + [B > 0]·(f0 + f1·u + f2·u²)
    decode step:   t = d0 + d1·B + d2·u + d3·u²

with ``P`` prompt tokens computed in the step, ``B`` requests decoding beside them and ``u``
the share of the KV cache in use. ``a`` is the fixed cost of a forward pass, ``b`` the
per-token work (the MLPs), ``c`` the attention over the chunk. Engines differ in how decodes
join a prefill step: vLLM runs them as extra tokens of the same pass (``e`` per decode),
Dynamo's mocker adds a whole decode pass, memory bound and so growing with the KV cache it
reads (the ``f`` terms); the fit takes whichever the worker shows. A decode-only step is
memory bound too (``d2``, ``d3``).

The fits are recursive (normal equations with exponential forgetting, so a worker that slows
down is followed) and pulled towards a prior (ridge), so a worker with no reports yet, or one
that cannot time its steps, is predicted by the prior: a mid-size model on one GPU (the
mocker's default timing). The token terms are kept non-negative: a prediction never falls as
work grows.

The time to first token of a request on a worker (``predict_ttft``) is the time to compute
everything queued there before it plus its own uncached prompt, in steps of the worker's token
budget, each step also carrying the worker's running decodes::

    work   = queued_prefill_tokens + max(new_tokens, 1)
    chunk  = budget - decodes                      (per step; budget: max_num_batched_tokens)
    ttft   = floor(work / chunk) · step(chunk) + step(work mod chunk)

This is what Mooncake's Conductor and Preble estimate: queueing plus prefill, in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from turnout.protocols.kv import LoadReport, StepSample
from turnout.router.kv.base import MAX_CHANGED_WORKERS, WorkerKey

#: Feature scales: the fits work in units where typical features are about 1 (public: the
#: selector's inlined TTFT uses them).
TOKENS_UNIT = 1024.0
DECODES_UNIT = 64.0
#: Per-sample forgetting: the weight of a sample halves after about 700 newer ones.
FORGETTING = 0.999
#: Ridge weight of the prior (features are about 1 in the fit's units, so a hundredth of one
#: sample's weight per direction): a few steps of data outweigh it wherever they speak, even
#: on a CPU worker 500 times slower per token than the prior's GPU (six llama.cpp prompts of
#: 16-512 tokens fit within 15%).
PRIOR_WEIGHT = 0.01
#: The per-step token budget assumed until a worker reports its own.
DEFAULT_STEP_BUDGET = 8192

_PrefillRow = tuple[float, float, float, float, float, float, float]
_DecodeRow = tuple[float, float, float, float]


def _prefill_row(tokens: float, decodes: float, usage: float) -> _PrefillRow:
    p = tokens / TOKENS_UNIT
    m = 1.0 if decodes > 0 else 0.0
    return (1.0, p, p * p, decodes / DECODES_UNIT, m, m * usage, m * usage * usage)


def _decode_row(decodes: float, usage: float) -> _DecodeRow:
    return (1.0, decodes / DECODES_UNIT, usage, usage * usage)


@dataclass(frozen=True, slots=True)
class StepTimePrior:
    """Seconds of the two kinds of step (see the module docstring), before any report.

    The defaults are the mocker's default timing (Dynamo's mocker: a mid-size model on one
    GPU) at speedup 1.
    """

    prefill_constant: float = 0.0165
    prefill_per_token: float = 1.518e-5
    prefill_per_token_sq: float = 4.21e-10
    prefill_per_decode: float = 0.0
    mixed_constant: float = 0.00574
    mixed_per_usage: float = 0.05401
    mixed_per_usage_sq: float = -0.02574
    decode_constant: float = 0.00574
    decode_per_seq: float = 0.0
    decode_per_usage: float = 0.05401
    decode_per_usage_sq: float = -0.02574

    def prefill_vector(self) -> np.ndarray:
        """The prefill coefficients in the fit's scaled units."""
        u, d = TOKENS_UNIT, DECODES_UNIT
        return np.array(
            [
                self.prefill_constant,
                self.prefill_per_token * u,
                self.prefill_per_token_sq * u * u,
                self.prefill_per_decode * d,
                self.mixed_constant,
                self.mixed_per_usage,
                self.mixed_per_usage_sq,
            ]
        )

    def decode_vector(self) -> np.ndarray:
        return np.array(
            [
                self.decode_constant,
                self.decode_per_seq * DECODES_UNIT,
                self.decode_per_usage,
                self.decode_per_usage_sq,
            ]
        )


class RidgeFit:
    """Least squares with exponential forgetting, pulled towards the prior (ridge).

    Solves ``(A + wI) θ = r + w θ₀`` where ``A = Σ λ^age x xᵀ`` and ``r = Σ λ^age x y`` over
    the samples: a direction the data pins down (eigenvalues of ``A`` far above ``w``) is
    the data's, one it cannot tell (say, decodes riding along when a worker never mixes them)
    keeps the prior's value. A prior on the coefficients, not pseudo-samples at chosen points:
    those would weigh most exactly where the data is silent and bend the fit there. θ is then
    clipped at 0 where ``nonneg`` says so (a step never gets faster with more tokens).
    Solving is lazy: once per batch of samples, at the first prediction after it.
    """

    def __init__(
        self,
        prior: np.ndarray,
        weight: float,
        forgetting: float,
        nonneg: np.ndarray | None = None,
    ) -> None:
        n = len(prior)
        self._nonneg = np.ones(n, dtype=bool) if nonneg is None else nonneg
        self._prior = prior
        self._weight = weight
        self._forgetting = forgetting
        self._a = np.zeros((n, n))
        self._r = np.zeros(n)
        self._theta: tuple[float, ...] = tuple(float(x) for x in prior)
        self._dirty = False
        self.num_samples = 0

    def add(self, rows: np.ndarray, targets: np.ndarray) -> None:
        """Add samples (one feature row each, oldest first)."""
        k = len(targets)
        if k == 0:
            return
        lam = self._forgetting
        # The j-th of k new samples is k-1-j samples old at the end of the batch.
        weights = lam ** np.arange(k - 1, -1, -1, dtype=float)
        decay = lam**k
        weighted = rows * weights[:, None]
        self._a = decay * self._a + weighted.T @ rows
        self._r = decay * self._r + weighted.T @ targets
        self.num_samples += k
        self._dirty = True

    @property
    def coefficients(self) -> tuple[float, ...]:
        """The fitted coefficients, as Python floats (cheap to compute with, per decision)."""
        if self._dirty:
            n = len(self._prior)
            lhs = self._a + self._weight * np.eye(n)
            rhs = self._r + self._weight * self._prior
            theta = np.linalg.solve(lhs, rhs)
            theta = np.where(self._nonneg & (theta < 0), 0.0, theta)
            self._theta = tuple(float(x) for x in theta)
            self._dirty = False
        return self._theta


class TtftTerms(NamedTuple):
    """What ``WorkerStepModel.predict_ttft`` needs of a worker: the prefill fit's ``a, b, c,
    e`` (scaled units), ``mixed = f0 + f1·u + f2·u²`` at the worker's KV usage ``u``, and its
    step budget in tokens."""

    a: float
    b: float
    c: float
    e: float
    mixed: float
    budget: int


class WorkerStepModel:
    """One worker's fitted step times, token budget and KV usage."""

    def __init__(self, prior: StepTimePrior) -> None:
        # Token and decode terms stay non-negative; the usage curves may bend down (u²).
        self.prefill = RidgeFit(
            prior.prefill_vector(),
            PRIOR_WEIGHT,
            FORGETTING,
            nonneg=np.array([True, True, True, True, True, False, False]),
        )
        self.decode = RidgeFit(
            prior.decode_vector(),
            PRIOR_WEIGHT,
            FORGETTING,
            nonneg=np.array([True, True, False, False]),
        )
        self._step_budget = DEFAULT_STEP_BUDGET
        self._kv_usage = 0.0
        #: ``ttft_terms``' cache: cleared by whatever changes the fit, the budget or the usage.
        self._terms: TtftTerms | None = None

    @property
    def step_budget(self) -> int:
        """Tokens the worker computes per step at most (its ``max_num_batched_tokens``)."""
        return self._step_budget

    @step_budget.setter
    def step_budget(self, tokens: int) -> None:
        self._step_budget = tokens
        self._terms = None

    @property
    def kv_usage(self) -> float:
        """The KV usage of the worker's recent decode steps (its load report's, when it sends
        no step timings)."""
        return self._kv_usage

    @kv_usage.setter
    def kv_usage(self, usage: float) -> None:
        self._kv_usage = usage
        self._terms = None

    def ttft_terms(self) -> TtftTerms:
        """The prefill fit, the budget and the usage as ``predict_ttft`` uses them, computed
        once per change of any of them (the selector reads them once per candidate)."""
        terms = self._terms
        if terms is None:
            a, b, c, e, f0, f1, f2 = self.prefill.coefficients
            u = self._kv_usage
            terms = self._terms = TtftTerms(a, b, c, e, f0 + f1 * u + f2 * u * u, self._step_budget)
        return terms

    def observe(self, samples: Iterable[StepSample]) -> None:
        prefill_rows: list[_PrefillRow] = []
        prefill_y: list[float] = []
        decode_rows: list[_DecodeRow] = []
        decode_y: list[float] = []
        for s in samples:
            if not (math.isfinite(s.seconds) and s.seconds >= 0):
                continue  # a broken clock on the worker: not data
            usage = min(max(s.kv_usage, 0.0), 1.0)
            if s.prefill_tokens > 0:
                prefill_rows.append(_prefill_row(s.prefill_tokens, s.num_decodes, usage))
                prefill_y.append(s.seconds)
            elif s.num_decodes > 0:
                decode_rows.append(_decode_row(s.num_decodes, usage))
                decode_y.append(s.seconds)
        if prefill_y:
            self.prefill.add(np.array(prefill_rows), np.array(prefill_y))
            self._terms = None
        if decode_y:
            self.decode.add(np.array(decode_rows), np.array(decode_y))

    def prefill_step_s(self, tokens: int, decodes: int, kv_usage: float | None = None) -> float:
        """Seconds of a step computing ``tokens`` prompt tokens beside ``decodes`` decodes
        (at ``kv_usage``; default: the worker's last reported)."""
        a, b, c, e, f0, f1, f2 = self.prefill.coefficients
        p = tokens / TOKENS_UNIT
        t = a + b * p + c * p * p + e * decodes / DECODES_UNIT
        if decodes > 0:
            u = self.kv_usage if kv_usage is None else min(max(kv_usage, 0.0), 1.0)
            t += f0 + f1 * u + f2 * u * u
        return t

    def decode_step_s(self, decodes: int, kv_usage: float) -> float:
        """Seconds of a step that only decodes ``decodes`` requests with ``kv_usage`` of the
        cache in use (the inter-token time)."""
        d0, d1, d2, d3 = self.decode.coefficients
        u = min(max(kv_usage, 0.0), 1.0)
        return d0 + d1 * decodes / DECODES_UNIT + d2 * u + d3 * u * u

    def terms(self) -> dict[str, float]:
        """The fitted coefficients in SI units (seconds; per token; per token²; per decode)."""
        a, b, c, e, f0, f1, f2 = self.prefill.coefficients
        d0, d1, d2, d3 = self.decode.coefficients
        u, d = TOKENS_UNIT, DECODES_UNIT
        return {
            "a": a, "b": b / u, "c": c / (u * u), "e": e / d, "f0": f0, "f1": f1, "f2": f2,
            "d0": d0, "d1": d1 / d, "d2": d2, "d3": d3,
        }  # fmt: skip

    def predict_ttft(self, queued_tokens: int, new_tokens: int, decodes: int) -> float:
        """Seconds until the first token of a request with ``new_tokens`` uncached prompt
        tokens, behind ``queued_tokens`` of prefill, beside ``decodes`` running requests."""
        # ``selector._CostTerms.costs`` and ``cost_table.CostTable.costs`` repeat these
        # operations in this order (same floats).
        a, b, c, e, mixed, budget = self.ttft_terms()
        work = queued_tokens + (new_tokens if new_tokens > 1 else 1)
        chunk = budget - decodes
        if chunk < 1:
            chunk = 1
        base = a + e * decodes / DECODES_UNIT
        if decodes > 0:
            base += mixed
        full, rest = divmod(work, chunk)
        total = 0.0
        if full:
            p = chunk / TOKENS_UNIT
            total = full * (base + b * p + c * p * p)
        if rest:
            p = rest / TOKENS_UNIT
            total += base + b * p + c * p * p
        return total


class StepTimeModels:
    """``WorkerStepModel`` per worker, fed from load reports; workers that leave are dropped."""

    def __init__(self, prior: StepTimePrior | None = None) -> None:
        self._prior = prior or StepTimePrior()
        self._models: dict[WorkerKey, WorkerStepModel] = {}
        self._default = WorkerStepModel(self._prior)
        #: Workers whose model changed since the last ``take_changed`` (its one reader,
        #: ``cost_table.CostTable``, copies only those into its arrays); None until it first
        #: reads, and past ``MAX_CHANGED_WORKERS`` (the reader then reloads every worker).
        self._changed: set[WorkerKey] | None = None

    def _mark(self, key: WorkerKey) -> None:
        changed = self._changed
        if changed is not None:
            changed.add(key)
            if len(changed) > MAX_CHANGED_WORKERS:
                self._changed = None

    def on_load(self, report: LoadReport) -> None:
        key = WorkerKey(report.worker_id, report.dp_rank)
        self._mark(key)
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = WorkerStepModel(self._prior)
        if report.max_num_batched_tokens > 0:
            model.step_budget = report.max_num_batched_tokens
        decoding = [s.kv_usage for s in report.steps if s.num_decodes > 0]
        if decoding:
            # The usage the worker's decode passes ran at (what the fit learnt from); an
            # engine may count it differently from its reported occupancy (shared prefixes).
            model.kv_usage = min(max(sum(decoding) / len(decoding), 0.0), 1.0)
        elif not report.steps:
            model.kv_usage = min(max(report.kv_usage, 0.0), 1.0)
        if report.steps:
            model.observe(report.steps)

    def get(self, key: WorkerKey) -> WorkerStepModel:
        """The worker's model; the prior's for a worker that has not reported."""
        return self._models.get(key, self._default)

    @property
    def lookup(self) -> Callable[[WorkerKey, WorkerStepModel], WorkerStepModel]:
        """``lookup(key, default)``: the worker's model, else ``default`` (the selector's
        per-candidate read: a bound ``dict.get``, no call of ``get`` per worker)."""
        return self._models.get

    @property
    def default(self) -> WorkerStepModel:
        """The prior's model, for workers that have not reported."""
        return self._default

    def items(self) -> Iterable[tuple[WorkerKey, WorkerStepModel]]:
        return self._models.items()

    def remove_worker(self, worker_id: int) -> None:
        for key in [k for k in self._models if k.worker_id == worker_id]:
            del self._models[key]
            self._mark(key)

    def take_changed(self) -> set[WorkerKey] | None:
        """The workers whose model changed (a report, a removal) since the last call (for
        one reader only); None: any may have (the first call, or more than
        ``MAX_CHANGED_WORKERS`` changed). Models changed directly, not through ``on_load``,
        are not seen."""
        changed, self._changed = self._changed, set()
        return changed


@dataclass(slots=True)
class TtftAccuracy:
    """Predicted against realised TTFT of one worker's requests (sums, for metrics)."""

    count: int = 0
    predicted_s: float = 0.0
    realised_s: float = 0.0
    abs_error_s: float = 0.0

    def add(self, predicted: float, realised: float) -> None:
        self.count += 1
        self.predicted_s += predicted
        self.realised_s += realised
        self.abs_error_s += abs(realised - predicted)
