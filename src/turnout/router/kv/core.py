"""The KV router of one model, without I/O: hash, match, select, and keep the books.

``KvRouterCore.route`` is the whole decision::

    token ids ─hash─▶ sequence hashes ─index─▶ overlap per worker ─┐
                                      active sequences (load) ────┼─▶ select_worker ─▶ Selection
                                      load reports (busy) ────────┘         │
                                 add to active sequences; approx: record ◀──┘

and the ``on_*`` hooks feed it what happens next (first token, end of stream, KV events,
load reports, workers leaving). The async glue (event-plane subscriptions, snapshots for
resync, publishing active-sequence events to other replicas) calls these and is not here.
Everything takes ``now`` from the injected monotonic ``clock`` unless given explicitly.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from turnout.protocols.block_hashing import compute_seq_hashes
from turnout.protocols.kv import KvCacheEvent, LoadReport, SequenceHash
from turnout.router.kv.active_sequences import (
    ActiveSequenceEvent,
    ActiveSequences,
    EventPublisher,
)
from turnout.router.kv.approx import ApproxIndexer
from turnout.router.kv.base import EventOutcome, KvIndex, WorkerKey
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.cost_table import CostTable
from turnout.router.kv.indexer import GapCallback, KvIndexer, KvIndexerStats
from turnout.router.kv.selector import Selection, SelectionStatus, select_worker
from turnout.router.kv.sessions import SessionTable
from turnout.router.kv.step_time import StepTimeModels, StepTimePrior, TtftAccuracy
from turnout.router.kv.worker_load import WorkerLoads

#: Predictions kept for requests awaiting their first token, at most (a safety bound: entries
#: leave at the first token or the end of the stream).
MAX_PENDING_PREDICTIONS = 1 << 16


class KvRouterStats(msgspec.Struct, kw_only=True):
    """Counters of one model's KV router."""

    requests_routed: int
    requests_all_busy: int
    requests_no_candidates: int
    #: Full prompt blocks of the routed requests, and how many the router expected cached.
    blocks_routed: int
    overlap_blocks_routed: int
    #: ``overlap_blocks_routed / blocks_routed``: compare with the hit rate workers report.
    predicted_hit_rate: float
    active_requests: int
    active_requests_expired: int
    kv_events_ignored: int
    indexer: KvIndexerStats | None = None
    approx_blocks: int | None = None


class KvRouterCore:
    """KV-aware routing state and decisions for one model. Synchronous, not thread-safe."""

    def __init__(
        self,
        config: KvRouterConfig | None = None,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        router_id: str = "local",
        publish_active: EventPublisher | None = None,
        on_gap: GapCallback | None = None,
        step_prior: StepTimePrior | None = None,
    ) -> None:
        self.config = config = config if config is not None else KvRouterConfig()
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._exact: KvIndexer | None = None
        self._approx: ApproxIndexer | None = None
        self._index: KvIndex
        if config.use_kv_events:
            self._exact = KvIndexer(first_event_id=config.first_event_id, on_gap=on_gap)
            self._index = self._exact
        else:
            self._approx = ApproxIndexer(ttl_s=config.approx_ttl_s)
            self._index = self._approx
        self.active = ActiveSequences(
            block_size=config.block_size,
            ttl_s=config.active_request_ttl_s,
            router_id=router_id,
            publish=publish_active,
        )
        self.loads = WorkerLoads.from_config(config)
        self.step_models = StepTimeModels(step_prior)
        #: The selector's arrays over ``active`` and ``step_models`` (many candidates); the one
        #: reader of their changes: pass it to ``select_worker``, create no other over them.
        self.cost_table = CostTable(self.active, self.step_models)
        self.sessions = SessionTable(ttl_s=config.session_ttl_s, max_sessions=config.max_sessions)
        #: request id -> (worker, predicted TTFT, routed at): realised TTFT is measured against it.
        self._pending_ttft: dict[str, tuple[WorkerKey, float, float]] = {}
        #: Per worker: predicted against realised TTFT of its requests.
        self.ttft_accuracy: dict[WorkerKey, TtftAccuracy] = {}
        self._requests_routed = 0
        self._requests_all_busy = 0
        self._requests_no_candidates = 0
        self._blocks_routed = 0
        self._overlap_blocks_routed = 0
        self._kv_events_ignored = 0

    @property
    def index(self) -> KvIndex:
        return self._index

    # --- the decision --------------------------------------------------------------------------

    def seq_hashes(
        self,
        token_ids: Sequence[int] | np.ndarray,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        block_extra: Sequence[bytes | None] | None = None,
    ) -> list[SequenceHash]:
        """The sequence hashes of a prompt under this router's block size: what ``route`` and
        ``book`` take as ``seq_hashes``, so a caller that routes (or books, or re-routes) one
        prompt several times hashes it once."""
        return compute_seq_hashes(
            token_ids,
            self.config.block_size,
            lora_name=lora_name,
            cache_salt=cache_salt,
            block_extra=block_extra,
        )

    def route(
        self,
        request_id: str,
        token_ids: Sequence[int] | np.ndarray,
        candidates: Sequence[WorkerKey],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
        block_extra: Sequence[bytes | None] | None = None,
        now: float | None = None,
        book: bool = True,
        explain: bool = False,
        seq_hashes: Sequence[int] | None = None,
    ) -> Selection:
        """Choose a worker for the request and book it there (when one is chosen).

        ``candidates`` are the live workers allowed for this request (e.g. those holding
        ``lora_name``). A request id already in flight is re-booked (migration). With
        ``book=False`` the question is only answered: no state changes (``turnout router``'s
        query, or a dry run). With ``explain`` the selection lists every candidate's cost
        terms (``Selection.candidates``); without it, only the decision.

        ``seq_hashes``, when given, are the prompt's sequence hashes as ``self.seq_hashes``
        computes them from the same ``token_ids``, ``lora_name``, ``cache_salt`` and
        ``block_extra``: they are used as they are, not checked (``token_ids`` still give the
        prompt's length).
        """
        if now is None:
            now = self._clock()
        config = self.config
        self._index.expire(now)
        self.active.expire(now)
        if seq_hashes is None:
            seq_hashes = self.seq_hashes(
                token_ids, lora_name=lora_name, cache_salt=cache_salt, block_extra=block_extra
            )
        overlaps = self._index.find_matches(seq_hashes)
        num_tokens = len(token_ids)
        new_blocks = -(-num_tokens // config.block_size)
        preferred = None if session_id is None else self.sessions.get(session_id, now)
        selection = select_worker(
            candidates,
            overlaps,
            self.active,
            new_blocks,
            config,
            self._rng,
            loads=self.loads,
            now=now,
            request_id=request_id,
            num_tokens=num_tokens,
            step_models=self.step_models,
            preferred=preferred,
            explain=explain,
            table=self.cost_table,
        )
        status = selection.status
        if not book:
            return selection
        if status is SelectionStatus.SELECTED:
            key = selection.worker_key
            assert key is not None, "a SELECTED selection names its worker"
            self.active.add_request(
                request_id,
                key,
                num_prompt_tokens=num_tokens,
                overlap_blocks=selection.overlap_blocks,
                now=now,
            )
            self._index.record_routed(key, seq_hashes, now)
            if session_id is not None:
                self.sessions.record(session_id, key, now)
            if selection.predicted_ttft_s is not None:
                pending = self._pending_ttft
                pending.pop(request_id, None)  # a migrated request is predicted afresh
                if len(pending) >= MAX_PENDING_PREDICTIONS:
                    del pending[next(iter(pending))]
                pending[request_id] = (key, selection.predicted_ttft_s, now)
            self._requests_routed += 1
            self._blocks_routed += len(seq_hashes)
            self._overlap_blocks_routed += selection.overlap_blocks
        elif status is SelectionStatus.ALL_BUSY:
            self._requests_all_busy += 1
        else:
            self._requests_no_candidates += 1
        return selection

    def book(
        self,
        request_id: str,
        token_ids: Sequence[int] | np.ndarray,
        worker_key: WorkerKey,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
        now: float | None = None,
        seq_hashes: Sequence[int] | None = None,
    ) -> int:
        """Count a request that was sent to ``worker_key`` without a decision here (it was
        pinned: a session's binding, a client's ``backend_instance_id``) as ``route`` books
        a chosen one, so its load weighs on the next decisions until ``on_finished``.
        Returns the blocks of its prompt the worker is predicted to hold. ``seq_hashes``: as
        in ``route`` (computed by ``self.seq_hashes`` from the same prompt and partition)."""
        if now is None:
            now = self._clock()
        self.active.expire(now)
        if seq_hashes is None:
            seq_hashes = self.seq_hashes(token_ids, lora_name=lora_name, cache_salt=cache_salt)
        overlap = self._index.find_matches(seq_hashes).scores.get(worker_key, 0)
        self.active.add_request(
            request_id,
            worker_key,
            num_prompt_tokens=len(token_ids),
            overlap_blocks=overlap,
            now=now,
        )
        self._index.record_routed(worker_key, seq_hashes, now)
        if session_id is not None:
            self.sessions.record(session_id, worker_key, now)
        return overlap

    # --- what happens next ---------------------------------------------------------------------

    def on_first_token(self, request_id: str, now: float | None = None) -> bool:
        """Prefill of the request is done; False when it is not in flight (or already was)."""
        if now is None:
            now = self._clock()
        pending = self._pending_ttft.pop(request_id, None)
        if pending is not None:
            key, predicted, routed_at = pending
            accuracy = self.ttft_accuracy.get(key)
            if accuracy is None:
                accuracy = self.ttft_accuracy[key] = TtftAccuracy()
            accuracy.add(predicted, now - routed_at)
        return self.active.mark_prefill_done(request_id, now)

    def on_finished(self, request_id: str) -> bool:
        """The request's stream ended (any reason); False when it was not in flight."""
        self._pending_ttft.pop(request_id, None)
        return self.active.free(request_id)

    def on_kv_event(self, event: KvCacheEvent) -> EventOutcome:
        outcome = self._index.apply_event(event)
        if outcome is EventOutcome.IGNORED:
            self._kv_events_ignored += 1
        return outcome

    def on_kv_snapshot(
        self,
        worker_key: WorkerKey,
        snapshot_events: Sequence[KvCacheEvent],
        *,
        next_event_id: int | None = None,
    ) -> None:
        """Resync one worker's cache from a snapshot (exact mode; ignored in approx mode)."""
        if self._exact is not None:
            self._exact.reset_worker(worker_key, snapshot_events, next_event_id=next_event_id)

    def on_active_event(self, event: ActiveSequenceEvent, now: float | None = None) -> bool:
        """Another router replica's change to the in-flight requests."""
        return self.active.apply_event(event, self._clock() if now is None else now)

    def on_load(self, report: LoadReport, now: float | None = None) -> bool:
        """A worker's load report; returns whether it marks the worker busy."""
        self.step_models.on_load(report)
        return self.loads.on_load(report, self._clock() if now is None else now)

    def on_worker_removed(self, worker_id: int) -> None:
        """The instance left discovery: forget its cache, its requests and its load."""
        self._index.remove_worker(worker_id)
        self.active.remove_worker(worker_id)
        self.loads.remove_worker(worker_id)
        self.step_models.remove_worker(worker_id)
        self.cost_table.remove_worker(worker_id)
        self.sessions.remove_worker(worker_id)
        for key in [k for k in self.ttft_accuracy if k.worker_id == worker_id]:
            del self.ttft_accuracy[key]

    def get_workers_needing_resync(self) -> list[WorkerKey]:
        return [] if self._exact is None else self._exact.get_workers_needing_resync()

    # --- metrics -------------------------------------------------------------------------------

    @property
    def predicted_hit_rate(self) -> float:
        """Share of routed prompt blocks the router expected workers to have cached."""
        if self._blocks_routed == 0:
            return 0.0
        return self._overlap_blocks_routed / self._blocks_routed

    def get_stats(self) -> KvRouterStats:
        return KvRouterStats(
            requests_routed=self._requests_routed,
            requests_all_busy=self._requests_all_busy,
            requests_no_candidates=self._requests_no_candidates,
            blocks_routed=self._blocks_routed,
            overlap_blocks_routed=self._overlap_blocks_routed,
            predicted_hit_rate=self.predicted_hit_rate,
            active_requests=len(self.active),
            active_requests_expired=self.active.num_expired,
            kv_events_ignored=self._kv_events_ignored,
            indexer=None if self._exact is None else self._exact.get_stats(),
            approx_blocks=None if self._approx is None else self._approx.num_blocks,
        )
