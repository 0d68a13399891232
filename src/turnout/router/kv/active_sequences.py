"""Requests in flight per worker, and the load they put on it, as the router predicts it.

A request routed to a worker first *prefills* the prompt tokens the worker does not cache,
then *decodes* while its blocks stay resident. So per worker the router keeps two counters:

* ``active_prefill_tokens``: prompt tokens still to prefill, summed over requests that have
  not produced their first token (``prompt_tokens - overlap_blocks * block_size``, >= 0);
* ``active_decode_blocks``: KV blocks held by requests in flight (``ceil(prompt / block)``
  each, from routing until the end of the stream; output blocks are not predicted).

Lifecycle of one request, with every transition in ``_transition``::

    add_request ─▶ PREFILL ── mark_prefill_done ─▶ DECODE ── free ─▶ (gone)
                      └──────────────── free / expire / worker removed ──┘

Counters change only at those transitions, never by scanning. Several router replicas share
this state: each local transition is published as an ``ActiveSequenceEvent`` (through the
``publish`` callback) that the other replicas ``apply_event``. Replays are harmless: an add
of a known id replaces it, a prefill-done or free of an unknown or finished id is ignored.
Requests whose end was lost are dropped ``ttl_s`` after their last transition.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import msgspec

from turnout.errors import ConfigError
from turnout.router.kv.base import MAX_CHANGED_WORKERS, WorkerKey

DEFAULT_ACTIVE_TTL_S = 600.0


class RequestPhase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    GONE = "gone"


class ActiveSequenceEventKind(enum.StrEnum):
    ADDED = "added"
    PREFILL_DONE = "prefill_done"
    FREED = "freed"


class ActiveSequenceEvent(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One replica's change to the shared in-flight state (published on the event plane)."""

    kind: ActiveSequenceEventKind
    request_id: str
    #: The replica that made the change; a replica ignores its own events.
    router_id: str
    worker_key: WorkerKey
    #: ADDED only: prompt tokens to prefill and blocks held.
    prefill_tokens: int = 0
    num_blocks: int = 0


class ActiveSequenceBatch(msgspec.Struct, array_like=True, frozen=True):
    """One replica's changes since its last flush, in the order it made them: replica sync
    sends one message per event-loop iteration rather than one per change."""

    events: list[ActiveSequenceEvent]


class ActiveLoad(NamedTuple):
    """A worker's predicted load (a snapshot)."""

    active_prefill_tokens: int
    active_decode_blocks: int
    num_requests: int


@dataclass(slots=True)
class _Request:
    """One request in flight. Only ``_transition`` changes ``phase``; ``expires_at`` also
    moves in ``_touch``."""

    request_id: str
    worker_key: WorkerKey
    prefill_tokens: int
    num_blocks: int
    router_id: str
    phase: RequestPhase
    expires_at: float


@dataclass(slots=True)
class WorkerCounters:
    """A worker's counters. Changed only by ``ActiveSequences._add``/``_transition``; readers
    (the selector, through ``ActiveSequences.counters``) must not write them."""

    prefill_tokens: int = 0
    decode_blocks: int = 0
    num_requests: int = 0
    #: Requests that have not produced their first token (the rest are decoding).
    prefill_requests: int = 0


EventPublisher = Callable[[ActiveSequenceEvent], None]


class ActiveSequences:
    """Per-worker in-flight requests and their counters. Synchronous, not thread-safe."""

    def __init__(
        self,
        *,
        block_size: int,
        ttl_s: float = DEFAULT_ACTIVE_TTL_S,
        router_id: str = "local",
        publish: EventPublisher | None = None,
    ) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        if not ttl_s > 0:
            raise ConfigError(f"active request TTL must be positive, got {ttl_s}")
        self._block_size = block_size
        self._ttl_s = ttl_s
        self._router_id = router_id
        self._publish = publish
        self._requests: dict[str, _Request] = {}
        self._counters: dict[WorkerKey, WorkerCounters] = {}
        self._by_worker: dict[WorkerKey, set[str]] = {}
        self._counters_view = MappingProxyType(self._counters)
        #: (expires_at, tie-breaker, request_id); entries go stale when a request is touched or
        #: freed and are skipped on pop.
        self._deadlines: list[tuple[float, int, str]] = []
        self._seq = 0
        self._num_expired = 0
        #: Workers whose counters changed since the last ``take_changed`` (its one reader,
        #: ``cost_table.CostTable``, copies only those into its arrays); None until it first
        #: reads, and past ``MAX_CHANGED_WORKERS`` (the reader then reloads every worker).
        self._changed: set[WorkerKey] | None = None

    @property
    def router_id(self) -> str:
        return self._router_id

    # --- local changes (published) -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        worker_key: WorkerKey,
        *,
        num_prompt_tokens: int,
        overlap_blocks: int,
        now: float,
        block_size: int | None = None,
    ) -> None:
        """A request was routed to ``worker_key``; an id already in flight is replaced
        (a migrated request is routed again under its id)."""
        bs = self._block_size if block_size is None else block_size
        if num_prompt_tokens < 0 or overlap_blocks < 0 or bs <= 0:
            raise ValueError(
                f"bad request sizes: prompt {num_prompt_tokens}, overlap {overlap_blocks}, "
                f"block size {bs}"
            )
        prefill_tokens = max(num_prompt_tokens - overlap_blocks * bs, 0)
        num_blocks = -(-num_prompt_tokens // bs)
        key = WorkerKey(*worker_key)
        self._add(request_id, key, prefill_tokens, num_blocks, self._router_id, now)
        if self._publish is not None:
            self._publish(
                ActiveSequenceEvent(
                    kind=ActiveSequenceEventKind.ADDED,
                    request_id=request_id,
                    router_id=self._router_id,
                    worker_key=key,
                    prefill_tokens=prefill_tokens,
                    num_blocks=num_blocks,
                )
            )

    def mark_prefill_done(self, request_id: str, now: float | None = None) -> bool:
        """The request produced its first token; False when unknown or already done."""
        req = self._requests.get(request_id)
        if req is None or req.phase is not RequestPhase.PREFILL:
            return False
        self._transition(req, RequestPhase.DECODE)
        if now is not None:
            self._touch(req, now)
        self._maybe_publish(ActiveSequenceEventKind.PREFILL_DONE, req)
        return True

    def free(self, request_id: str) -> bool:
        """The request ended (finished, failed or cancelled); False when unknown."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._transition(req, RequestPhase.GONE)
        self._maybe_publish(ActiveSequenceEventKind.FREED, req)
        return True

    def _maybe_publish(self, kind: ActiveSequenceEventKind, req: _Request) -> None:
        if self._publish is not None:
            self._publish(
                ActiveSequenceEvent(
                    kind=kind,
                    request_id=req.request_id,
                    router_id=self._router_id,
                    worker_key=req.worker_key,
                )
            )

    def snapshot_events(self) -> list[ActiveSequenceEvent]:
        """This replica's own requests in flight as the events that rebuild them on another
        replica (``apply_event`` in order): ``ADDED`` for each, then ``PREFILL_DONE`` for one
        that is decoding. For a replica that joined after they were routed (replica sync)."""
        own = self._router_id
        out = []
        for req in self._requests.values():
            if req.router_id != own:
                continue
            out.append(
                ActiveSequenceEvent(
                    kind=ActiveSequenceEventKind.ADDED,
                    request_id=req.request_id,
                    router_id=own,
                    worker_key=req.worker_key,
                    prefill_tokens=req.prefill_tokens,
                    num_blocks=req.num_blocks,
                )
            )
            if req.phase is RequestPhase.DECODE:
                out.append(
                    ActiveSequenceEvent(
                        kind=ActiveSequenceEventKind.PREFILL_DONE,
                        request_id=req.request_id,
                        router_id=own,
                        worker_key=req.worker_key,
                    )
                )
        return out

    # --- replicas' changes ---------------------------------------------------------------------

    def apply_event(self, event: ActiveSequenceEvent, now: float) -> bool:
        """Apply another replica's change; own events are ignored. True when state changed."""
        if event.router_id == self._router_id:
            return False
        kind = event.kind
        if kind is ActiveSequenceEventKind.ADDED:
            self._add(
                event.request_id,
                WorkerKey(*event.worker_key),
                event.prefill_tokens,
                event.num_blocks,
                event.router_id,
                now,
            )
            return True
        req = self._requests.get(event.request_id)
        if req is None:
            return False
        if kind is ActiveSequenceEventKind.PREFILL_DONE:
            if req.phase is not RequestPhase.PREFILL:
                return False
            self._transition(req, RequestPhase.DECODE)
            self._touch(req, now)
            return True
        self._transition(req, RequestPhase.GONE)
        return True

    def remove_router(self, router_id: str) -> int:
        """Drop the requests another replica routed (it is gone); returns how many."""
        if router_id == self._router_id:
            return 0
        gone = [r for r in self._requests.values() if r.router_id == router_id]
        for req in gone:
            self._transition(req, RequestPhase.GONE)
        return len(gone)

    # --- transitions ---------------------------------------------------------------------------

    def _add(
        self,
        request_id: str,
        key: WorkerKey,
        prefill_tokens: int,
        num_blocks: int,
        router_id: str,
        now: float,
    ) -> None:
        old = self._requests.get(request_id)
        if old is not None:
            self._transition(old, RequestPhase.GONE)
        req = _Request(
            request_id, key, prefill_tokens, num_blocks, router_id, RequestPhase.PREFILL, now
        )
        self._requests[request_id] = req
        counters = self._counters.get(key)
        if counters is None:
            counters = self._counters[key] = WorkerCounters()
            self._by_worker[key] = set()
        counters.prefill_tokens += prefill_tokens
        counters.decode_blocks += num_blocks
        counters.num_requests += 1
        counters.prefill_requests += 1
        self._by_worker[key].add(request_id)
        changed = self._changed
        if changed is not None:
            changed.add(key)
            if len(changed) > MAX_CHANGED_WORKERS:
                self._changed = None
        self._touch(req, now)

    def _transition(self, req: _Request, to: RequestPhase) -> None:
        """The one place a request's phase and its worker's counters change."""
        frm = req.phase
        counters = self._counters[req.worker_key]
        changed = self._changed
        if changed is not None:
            changed.add(req.worker_key)
            if len(changed) > MAX_CHANGED_WORKERS:
                self._changed = None
        if frm is RequestPhase.PREFILL and to is RequestPhase.DECODE:
            counters.prefill_tokens -= req.prefill_tokens
            counters.prefill_requests -= 1
        elif frm is not RequestPhase.GONE and to is RequestPhase.GONE:
            if frm is RequestPhase.PREFILL:
                counters.prefill_tokens -= req.prefill_tokens
                counters.prefill_requests -= 1
            counters.decode_blocks -= req.num_blocks
            counters.num_requests -= 1
            del self._requests[req.request_id]
            peers = self._by_worker[req.worker_key]
            peers.discard(req.request_id)
            if not peers:
                del self._by_worker[req.worker_key]
                del self._counters[req.worker_key]
        else:
            raise ValueError(
                f"request {req.request_id}: illegal transition {frm.value} -> {to.value}"
            )
        req.phase = to

    def _touch(self, req: _Request, now: float) -> None:
        req.expires_at = now + self._ttl_s
        self._seq += 1
        heap = self._deadlines
        heapq.heappush(heap, (req.expires_at, self._seq, req.request_id))
        if len(heap) > 4 * len(self._requests) + 1024:
            # Mostly stale entries (requests freed or touched since): rebuild from the live
            # requests so the heap stays O(requests in flight). Amortised O(1) a push.
            live = self._requests.values()
            heap[:] = [(r.expires_at, i, r.request_id) for i, r in enumerate(live)]
            heapq.heapify(heap)

    # --- housekeeping --------------------------------------------------------------------------

    def expire(self, now: float) -> int:
        """Drop requests untouched for ``ttl_s`` (their end was lost); returns how many.

        Cheap when nothing is due: one look at the heap's top.
        """
        heap = self._deadlines
        expired = 0
        while heap and heap[0][0] <= now:
            expires_at, _, request_id = heapq.heappop(heap)
            req = self._requests.get(request_id)
            if req is not None and req.expires_at == expires_at:
                self._transition(req, RequestPhase.GONE)
                expired += 1
        self._num_expired += expired
        return expired

    def remove_worker(self, worker_id: int) -> int:
        """Drop the requests of every rank of ``worker_id`` (it left); returns how many."""
        dropped = 0
        for key in [k for k in self._by_worker if k.worker_id == worker_id]:
            for request_id in list(self._by_worker.get(key, ())):
                self._transition(self._requests[request_id], RequestPhase.GONE)
                dropped += 1
        return dropped

    # --- reads ---------------------------------------------------------------------------------

    def get_load(self, worker_key: WorkerKey) -> ActiveLoad:
        c = self._counters.get(worker_key)
        if c is None:
            return ActiveLoad(0, 0, 0)
        return ActiveLoad(c.prefill_tokens, c.decode_blocks, c.num_requests)

    @property
    def counters(self) -> Mapping[WorkerKey, WorkerCounters]:
        """Live read-only view of the per-worker counters (workers with requests only); the
        selector's hot-path read, without a call or a copy per worker."""
        return self._counters_view

    @property
    def counters_lookup(self) -> Callable[[WorkerKey], WorkerCounters | None]:
        """``lookup(key)``: the worker's live counters, None when it has no request in flight
        (a bound ``dict.get``: the selector's per-candidate read, cheaper than the view's)."""
        return self._counters.get

    def take_changed(self) -> set[WorkerKey] | None:
        """The workers whose counters changed since the last call (for one reader only);
        None: any may have (the first call, or more than ``MAX_CHANGED_WORKERS`` changed)."""
        changed, self._changed = self._changed, set()
        return changed

    def get_counts(self, worker_key: WorkerKey) -> tuple[int, int]:
        """``(active_prefill_tokens, active_decode_blocks)``; the selector's hot-path read."""
        c = self._counters.get(worker_key)
        return (0, 0) if c is None else (c.prefill_tokens, c.decode_blocks)

    def get_prefill_tokens(self, request_id: str) -> int | None:
        """The prompt tokens the router expected ``request_id``'s worker to compute (the rest
        were predicted cached); None when it is not in flight."""
        req = self._requests.get(request_id)
        return None if req is None else req.prefill_tokens

    def get_worker_key(self, request_id: str) -> WorkerKey | None:
        req = self._requests.get(request_id)
        return None if req is None else req.worker_key

    def get_phase(self, request_id: str) -> RequestPhase:
        req = self._requests.get(request_id)
        return RequestPhase.GONE if req is None else req.phase

    def get_workers(self) -> list[WorkerKey]:
        return list(self._counters)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def num_expired(self) -> int:
        return self._num_expired
