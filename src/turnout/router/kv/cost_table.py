"""The selector's cost of many candidates at once, in numpy, from arrays kept per worker.

What the cost of a worker reads (``selector.py``'s module docstring) is its in-flight counters
(``ActiveSequences``), its fitted step times (``StepTimeModels``, as ``TtftTerms``) and the
request's overlap with its cache. The first two change per request or per load report, not
per decision, so they are kept here in arrays, one row (*slot*) per worker::

    _slots:  WorkerKey -> slot          _keys: slot -> WorkerKey | None (free)
    _ints[:, slot]   = queued tokens, decodes, decode blocks     from ActiveSequences
                       step budget                               from StepTimeModels
    _floats[:, slot] = a, b, c, e, mixed (TtftTerms)             from StepTimeModels

Both sources list the workers they changed (``take_changed``); a decision first copies those
rows (a few, typically: the request booked and the one that ended since), then gathers the
candidates' rows with one lookup each in C (``map(dict.get)``) and computes every cost with
array operations. No Python bytecode runs per candidate, so a candidate that cannot win costs
tens of nanoseconds, not the micro-second of a loop iteration.

The operations are ``WorkerStepModel.predict_ttft``'s and the block cost's, in the same order
on float64 and int64 elements, so each cost is the float the plain formula gives (IEEE
arithmetic per element; ``np.where`` stands for the formula's branches).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import repeat

import numpy as np

from turnout.router.kv.active_sequences import ActiveSequences
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.step_time import DECODES_UNIT, TOKENS_UNIT, StepTimeModels

#: Below this many candidates the selector's loop is cheaper than the arrays' fixed cost
#: (measured: even at 64 with the TTFT cost, the loop ahead with the block cost; the table
#: twice as fast at 128 and four times at 1,024).
MIN_CANDIDATES = 96


class CostTable:
    """Per-worker arrays of what the cost reads, for one ``ActiveSequences`` and one
    ``StepTimeModels``, of which it is the only ``take_changed`` reader. Not thread-safe."""

    __slots__ = ("_active", "_floats", "_free", "_gathered", "_gathered_for", "_ints", "_keys",
                 "_models", "_slots", "min_candidates")  # fmt: skip

    def __init__(
        self,
        active: ActiveSequences,
        models: StepTimeModels,
        *,
        min_candidates: int = MIN_CANDIDATES,
    ) -> None:
        self._active = active
        self._models = models
        #: The selector uses the table from this many candidates on.
        self.min_candidates = min_candidates
        self._slots: dict[WorkerKey, int] = {}
        self._keys: list[WorkerKey | None] = []
        self._free: list[int] = []
        #: Rows ``_QUEUED, _DECODES, _DECODE_BLOCKS, _BUDGET`` by slot (one gather for all).
        self._ints = np.zeros((4, 0), np.int64)
        #: Rows ``_A, _B, _C, _E, _MIXED`` (``TtftTerms``) by slot.
        self._floats = np.zeros((5, 0))
        #: The last gather's slots and the candidate tuple they are of: a router passes the
        #: same tuple until its live set changes, and the slots stay valid until one moves.
        self._gathered_for: tuple[WorkerKey, ...] | None = None
        self._gathered = np.zeros(0, np.intp)

    def __len__(self) -> int:
        return len(self._slots)

    def remove_worker(self, worker_id: int) -> None:
        """Free the slots of every rank of ``worker_id`` (it left)."""
        for key in [k for k in self._slots if k.worker_id == worker_id]:
            slot = self._slots.pop(key)
            self._keys[slot] = None
            heapq.heappush(self._free, slot)
            self._gathered_for = None

    def _gather(self, candidates: Sequence[WorkerKey]) -> np.ndarray:
        """The candidates' slots, after copying the rows that changed; new workers get one."""
        counters = self._active.take_changed()
        models = self._models.take_changed()
        slots = self._slots
        if counters is None or models is None:  # any may have changed: reload every row
            for key, at in slots.items():
                self._load(at, key)
        else:
            for key in counters | models:
                slot = slots.get(key)
                if slot is not None:
                    self._load(slot, key)
        if candidates is self._gathered_for:
            return self._gathered
        found = list(map(slots.get, candidates))
        if None in found:
            for key in candidates:
                if key not in slots:
                    self._load(self._allocate(key), key)
            found = list(map(slots.get, candidates))
        gathered = np.array(found, dtype=np.intp)
        if type(candidates) is tuple:  # immutable: its identity names its contents
            self._gathered_for, self._gathered = candidates, gathered
        return gathered

    def _allocate(self, key: WorkerKey) -> int:
        if self._free:
            slot = heapq.heappop(self._free)
            self._keys[slot] = key
        else:
            slot = len(self._keys)
            self._keys.append(key)
            size = self._ints.shape[1]
            if slot >= size:
                grown = max(64, 2 * size)
                self._ints = np.pad(self._ints, ((0, 0), (0, grown - size)))
                self._floats = np.pad(self._floats, ((0, 0), (0, grown - size)))
        self._slots[key] = slot
        self._gathered_for = None
        return slot

    def _load(self, slot: int, key: WorkerKey) -> None:
        counters = self._active.counters_lookup(key)
        if counters is None:
            queued = decodes = decode_blocks = 0
        else:
            queued = counters.prefill_tokens
            decodes = counters.num_requests - counters.prefill_requests
            decode_blocks = counters.decode_blocks
        terms = self._models.get(key).ttft_terms()
        self._ints[:, slot] = (queued, decodes, decode_blocks, terms.budget)
        self._floats[:, slot] = (terms.a, terms.b, terms.c, terms.e, terms.mixed)

    def _overlaps(self, scores: dict[WorkerKey, int]) -> np.ndarray:
        """Overlap by slot (one past the last slot: workers without one). Built from the
        scores, which name only workers holding the prompt's first block: fewer than the
        candidates, usually."""
        size = self._ints.shape[1]
        by_slot = np.zeros(size + 1, np.int64)
        if scores:
            count = len(scores)
            at = np.fromiter(map(self._slots.get, scores, repeat(size)), np.intp, count)
            by_slot[at] = np.fromiter(scores.values(), np.int64, count)
        return by_slot

    def costs(
        self,
        candidates: Sequence[WorkerKey],
        scores: dict[WorkerKey, int],
        *,
        ttft: bool,
        new_blocks: int,
        num_tokens: int,
        block_size: int,
        weight: float,
    ) -> np.ndarray:
        """Each candidate's cost without session bonus and ITL term (float64, in order):
        the TTFT cost with ``ttft``, else the block cost."""
        slots = self._gather(candidates)
        overlap = self._overlaps(scores)[slots]
        queued, decodes, decode_blocks, budget = self._ints[:, slots]
        if not ttft:
            # prefill = max(ceil(queued / bs) + new_blocks - overlap, 0)
            prefill = np.maximum(-(queued // -block_size) + new_blocks - overlap, 0)
            result: np.ndarray = weight * prefill + (decode_blocks + new_blocks)
            return result
        a, b, c, e, mixed = self._floats[:, slots]
        new_tokens = num_tokens - overlap * block_size
        work = queued + np.maximum(new_tokens, 1)
        chunk = np.maximum(budget - decodes, 1)
        base = a + e * decodes / DECODES_UNIT
        base = np.where(decodes > 0, base + mixed, base)
        full, rest = np.divmod(work, chunk)
        p = chunk / TOKENS_UNIT
        total = np.where(full > 0, full * (base + b * p + c * p * p), 0.0)
        p = rest / TOKENS_UNIT
        result = np.where(rest > 0, total + (base + b * p + c * p * p), total)
        return result
