"""The KV router of one model, alive: ``KvRouterCore`` fed from the planes.

What this adds to the core:

* subscriptions on the event plane to the workers' ``kv_events`` and ``load`` topics
  (namespace/component of the model's endpoint): KV events applied to the core as they
  arrive, load reports a batch at a time, folded (``load_feed``);
* resynchronisation: when the indexer sees a gap in a worker's event ids (lost events, or a
  router that joined late), the worker's resident cache is fetched through its
  ``kv_snapshot`` side handler and replaces what the index holds for it;
* membership: a worker that leaves discovery is forgotten (its blocks, requests, load);
* replicas: with ``share_active`` on, the local changes to the in-flight requests are
  collected and published on the ``kv_router_active`` topic as one batch per event-loop
  iteration (at most ``ACTIVE_BATCH_MAX`` changes each); the other replicas' batches are
  applied in order, so several frontends (or ``turnout router`` services) see the same load.
  Batches go out only while another replica hears this one: replicas announce themselves on
  the same topic, and one that starts to listen gets a snapshot of this replica's requests in
  flight; a replica that goes silent is forgotten with its requests (``replicas``);
* a watchdog for silent workers: a worker in exact mode that keeps getting requests but sends
  no KV event for ``silence_warn_s`` is logged once and counted (a misconfigured engine
  without KV events otherwise degrades routing silently).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from time import perf_counter
from typing import Any, Protocol

import msgspec

from turnout.protocols.kv import (
    KV_EVENTS_TOPIC,
    KV_SNAPSHOT_HANDLER,
    LOAD_TOPIC,
    KvEventBatch,
    KvSnapshot,
    KvSnapshotRequest,
    LoadReport,
    SequenceHash,
)
from turnout.protocols.model import EndpointId
from turnout.router.event_batches import BatchDecoder, take_ready
from turnout.router.kv.active_sequences import ActiveSequenceBatch, ActiveSequenceEvent
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.core import KvRouterCore
from turnout.router.kv.decisions import DecisionLog, WorkerHits
from turnout.router.kv.load_feed import StepBacklog, latest_per_worker
from turnout.router.kv.replicas import (
    DEFAULT_PRESENCE_INTERVAL_S,
    ReplicaPeers,
    ReplicaPresence,
    is_presence,
)
from turnout.router.kv.selector import Selection
from turnout.router.kv.timing import DurationHistogram
from turnout.runtime.context import RequestContext
from turnout.runtime.event_plane import EventPlane, EventPublisher, EventSubscription

log = logging.getLogger("turnout.router.kv")

ACTIVE_TOPIC = "kv_router_active"
#: The most active-sequence changes one replica-sync message carries (a burst beyond it is
#: sent in several).
ACTIVE_BATCH_MAX = 256
#: The most requests one snapshot message carries (a larger snapshot is sent in several).
SNAPSHOT_CHUNK = 1024
_encode = msgspec.msgpack.Encoder().encode
_batch_decoder = msgspec.msgpack.Decoder(ActiveSequenceBatch)
_presence_decoder = msgspec.msgpack.Decoder(ReplicaPresence)
_snapshot_decoder = msgspec.msgpack.Decoder(KvSnapshot)


#: Departed workers remembered, to drop their late KV events (see ``KvRouter._departed``).
DEPARTED_MEMORY = 4096


class KvRouterClient(Protocol):
    """What the KV router (and its push router) use of the workers' endpoint client
    (``runtime.endpoint_client.EndpointClient`` is one; so is a routing view over it)."""

    def instance_ids(self) -> Sequence[int]:
        """Live instances; the same object until the set changes lets the candidate list be
        cached (a client returning a fresh sequence each time only costs the rebuild)."""
        ...

    def announced_ids(self) -> set[int]: ...

    def stream(
        self, instance_id: int, payload: bytes, ctx: RequestContext
    ) -> AsyncIterator[bytes]: ...

    def call(
        self, instance_id: int, name: str, payload: bytes, ctx: RequestContext
    ) -> AsyncIterator[bytes]: ...

    def add_listener(self, callback: Callable[[], None]) -> None: ...

    def remove_listener(self, callback: Callable[[], None]) -> None: ...


class KvRouter:
    def __init__(
        self,
        config: KvRouterConfig,
        client: KvRouterClient,
        event_plane: EventPlane,
        endpoint: EndpointId,
        *,
        dp_size: int = 1,
        share_active: bool = True,
        silence_warn_s: float = 30.0,
        router_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        presence_interval_s: float = DEFAULT_PRESENCE_INTERVAL_S,
    ) -> None:
        """``clock``: monotonic seconds, for the core, the load feed and replica presence
        (injected by tests); ``presence_interval_s``: seconds between this replica's
        presences (``replicas``)."""
        self.router_id = router_id or uuid.uuid4().hex[:12]
        self.client = client
        self.endpoint = endpoint
        self.dp_size = max(1, dp_size)
        self._plane = event_plane
        self._share_active = share_active
        self._publisher: EventPublisher | None = None
        self._pending_active: list[ActiveSequenceEvent] = []
        self.peers = ReplicaPeers(self.router_id, interval_s=presence_interval_s)
        #: Replica-sync messages that did not decode (a peer of another version, a bug).
        self.num_invalid_active = 0
        self._subscriptions: list[EventSubscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._resyncing: set[WorkerKey] = set()
        #: ``candidates()`` with nothing excluded, and the live set it was built from.
        self._all_candidates: tuple[WorkerKey, ...] = ()
        self._candidates_source: Sequence[int] | None = None
        self._known_workers: set[int] = set()
        #: Workers that left discovery, newest last (at most ``DEPARTED_MEMORY``): the events a
        #: leaving worker publishes as its last streams end arrive after it left, and must not
        #: bring back a cache of a worker that is gone (nor a gap and a resync it cannot answer).
        self._departed: dict[int, None] = {}
        self._silence_warn_s = silence_warn_s
        #: worker id -> (monotonic time of its last KV event, requests routed since then)
        self._last_event: dict[int, float] = {}
        self._routed_since_event: dict[int, int] = {}
        self._silent_warned: set[int] = set()
        self._clock = clock
        self._step_backlog = StepBacklog()
        self._load_decoder = BatchDecoder(LoadReport, LOAD_TOPIC)
        #: Counters for metrics (read by the frontend's collector).
        self.num_silent_warnings = 0
        self.num_resyncs = 0
        self.num_resync_failures = 0
        self.predicted_cached_tokens = 0
        self.reported_cached_tokens = 0
        self.reported_prompt_tokens = 0
        #: Time of each ``route`` decision (exported as ``turnout_kv_router_decision_seconds``).
        self.decision_seconds = DurationHistogram()
        #: A sample of recent decisions, explained (``/dashboard``).
        self.decisions = DecisionLog()
        #: Prompt tokens predicted cached against those reported cached: per live worker, and
        #: in all (requests whose worker reported its cached tokens).
        self.worker_hits: dict[int, WorkerHits] = {}
        self.hits = WorkerHits()
        self.core = KvRouterCore(
            config,
            clock=clock,
            router_id=self.router_id,
            publish_active=self._publish_active if share_active else None,
            on_gap=self._on_gap,
        )

    @property
    def config(self) -> KvRouterConfig:
        return self.core.config

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        ns, comp = self.endpoint.namespace, self.endpoint.component
        plane = self._plane
        feeds: list[tuple[str, Any]] = [(LOAD_TOPIC, self._consume_load)]
        if self.config.use_kv_events:
            feeds.append((KV_EVENTS_TOPIC, self._consume_kv))
        if self._share_active:
            self._publisher = await plane.publisher(ns, comp)
            feeds.append((ACTIVE_TOPIC, self._consume_active))
        for topic, consume in feeds:
            sub = await plane.subscribe(ns, comp, topic)
            self._subscriptions.append(sub)
            self._tasks.append(asyncio.create_task(consume(sub), name=f"kv-router-{topic}"))
        if self._share_active:
            self._tasks.append(asyncio.create_task(self._announce(), name="kv-router-presence"))
        self._known_workers = self.client.announced_ids()
        self.client.add_listener(self._on_instances_changed)

    async def close(self) -> None:
        self.client.remove_listener(self._on_instances_changed)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for sub in self._subscriptions:
            await sub.close()
        self._subscriptions.clear()
        if self._publisher is not None:
            if self.peers.listening:
                self._flush_active()
            await self._publisher.close()
            self._publisher = None

    # --- the decision ------------------------------------------------------------------------

    def candidates(
        self, excluded: Sequence[int] = (), allowed: Collection[int] | None = None
    ) -> Sequence[WorkerKey]:
        """Every rank of the live workers, less ``excluded``; only ``allowed`` ones if given
        (a LoRA adapter's holders). The full list is built once per change of the live set,
        not per request: at a thousand workers building it costs more than the decision."""
        live = self.client.instance_ids()
        if live is not self._candidates_source:
            ranks = range(self.dp_size)
            self._all_candidates = tuple(WorkerKey(w, rank) for w in live for rank in ranks)
            self._candidates_source = live
        if not excluded and allowed is None:
            return self._all_candidates
        return [
            key
            for key in self._all_candidates
            if key.worker_id not in excluded and (allowed is None or key.worker_id in allowed)
        ]

    def route(
        self,
        request_id: str,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
        excluded: Sequence[int] = (),
        book: bool = True,
        allowed: Collection[int] | None = None,
        explain: bool = True,
        seq_hashes: Sequence[SequenceHash] | None = None,
    ) -> Selection:
        """Choose a worker; with ``book`` (the default) the request is counted on it until
        ``on_finished``. ``book=False`` only answers the question (``turnout router``).
        ``allowed``: only these workers may be chosen (a LoRA adapter's holders).
        ``explain``: list every candidate's cost terms in the selection (the frontend asks
        only for a client that wants them); ``seq_hashes``: the prompt's, computed once by
        the caller (``core.seq_hashes``). The decision's time goes to ``decision_seconds``."""
        start = perf_counter()
        candidates = self.candidates(excluded, allowed)
        selection = self.core.route(
            request_id,
            token_ids,
            candidates,
            lora_name=lora_name,
            cache_salt=cache_salt,
            session_id=session_id,
            book=book,
            explain=explain,
            seq_hashes=seq_hashes,
        )
        self.decision_seconds.observe(perf_counter() - start)
        if book and selection.ok and selection.worker_id is not None:
            worker = selection.worker_id
            self.predicted_cached_tokens += selection.overlap_blocks * self.config.block_size
            # Only a request with a full prompt block the worker lacks must make it store
            # one: a prompt shorter than a block, or cached whole, is no sign of silence.
            stores = len(token_ids) // self.config.block_size > selection.overlap_blocks
            if stores and self.config.use_kv_events:
                self._routed_since_event[worker] = self._routed_since_event.get(worker, 0) + 1
                self._check_silence(worker)
        return selection

    def book(
        self,
        request_id: str,
        token_ids: Sequence[int],
        worker_id: int,
        *,
        dp_rank: int = 0,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
        seq_hashes: Sequence[SequenceHash] | None = None,
    ) -> None:
        """Count a pinned request on ``worker_id`` (see ``KvRouterCore.book``) until
        ``on_finished``."""
        overlap = self.core.book(
            request_id,
            token_ids,
            WorkerKey(worker_id, dp_rank),
            lora_name=lora_name,
            cache_salt=cache_salt,
            session_id=session_id,
            seq_hashes=seq_hashes,
        )
        self.predicted_cached_tokens += overlap * self.config.block_size

    def on_first_token(self, request_id: str) -> None:
        self.core.on_first_token(request_id)

    def on_finished(
        self, request_id: str, *, prompt_tokens: int = 0, cached_tokens: int | None = None
    ) -> None:
        active = self.core.active
        if cached_tokens is not None and prompt_tokens:
            key = active.get_worker_key(request_id)
            computed = active.get_prefill_tokens(request_id)
            if key is not None and computed is not None:
                hits = self.worker_hits.get(key.worker_id)
                if hits is None:
                    hits = self.worker_hits[key.worker_id] = WorkerHits()
                hits.add(prompt_tokens, prompt_tokens - computed, cached_tokens)
                self.hits.add(prompt_tokens, prompt_tokens - computed, cached_tokens)
        self.core.on_finished(request_id)
        if cached_tokens is not None:
            self.reported_cached_tokens += cached_tokens
            self.reported_prompt_tokens += prompt_tokens

    # --- feeds -------------------------------------------------------------------------------

    async def _consume_kv(self, sub: EventSubscription) -> None:
        core = self.core
        last_event = self._last_event
        routed = self._routed_since_event
        departed = self._departed
        async for batch in sub.messages(KvEventBatch):
            now = self._clock()
            for event in batch.events:
                worker = event.worker_id
                if worker in departed:
                    continue  # a leaving worker's last events: its cache is already forgotten
                core.on_kv_event(event)
                last_event[worker] = now
                routed.pop(worker, None)
                self._silent_warned.discard(worker)

    async def _consume_load(self, sub: EventSubscription) -> None:
        """Apply load reports a batch at a time (see ``load_feed``): the busy view from each
        worker's latest, the step-time fits from the backlog's due workers. Only reports of
        workers in discovery count: one that left (or has not registered yet, or another
        endpoint's sharing the topic) would otherwise be kept for good."""
        loads, step_models = self.core.loads, self.core.step_models
        backlog, decoder, clock = self._step_backlog, self._load_decoder, self._clock
        while (batch := await take_ready(sub)) is not None:
            known = self._known_workers
            reports = [r for r in decoder.decode(batch) if r.worker_id in known]
            now = clock()
            for report in reports:
                backlog.add(report)
            for report in latest_per_worker(reports):
                loads.on_load(report, now)
            for report in backlog.take_due(now):
                step_models.on_load(report)

    async def _consume_active(self, sub: EventSubscription) -> None:
        """Other replicas' change batches, applied in order, and their presences."""
        own = self.router_id
        core = self.core
        async for message in sub:
            payload = message.payload
            try:
                if is_presence(payload):
                    self._on_presence(_presence_decoder.decode(payload))
                    continue
                batch = _batch_decoder.decode(payload)
            except msgspec.DecodeError as exc:
                self.num_invalid_active += 1
                if self.num_invalid_active == 1:
                    log.warning(
                        "kv router %s: skipping an undecodable replica-sync message (%s); "
                        "later ones are only counted",
                        own,
                        exc,
                    )
                continue
            events = batch.events
            if events and events[0].router_id != own:
                sender = events[0].router_id
                if self.peers.on_batch(sender, self._clock()):
                    log.info(
                        "kv router %s: replica %s sends changes without presences (an older "
                        "version); publishing to it",
                        own, sender,
                    )  # fmt: skip
            for event in events:  # in the order the replica made them
                if event.router_id != own:
                    core.on_active_event(event)

    async def _announce(self) -> None:
        """Say this replica is here every ``peers.interval_s``; forget silent peers."""
        peers = self.peers
        while True:
            for router_id in peers.expire(self._clock()):
                dropped = self.core.active.remove_router(router_id)
                log.info(
                    "kv router %s: replica %s went silent; its %d requests are forgotten",
                    self.router_id, router_id, dropped,
                )  # fmt: skip
            self._send_presence()
            await asyncio.sleep(peers.interval_s)

    def _on_presence(self, presence: ReplicaPresence) -> None:
        if presence.router_id == self.router_id:
            return
        if presence.to == self.router_id:  # a peer's requests, for this replica
            for event in presence.events:
                self.core.on_active_event(event)
        new, snapshot_due = self.peers.on_presence(presence, self._clock())
        if new:
            log.info("kv router %s: replica %s is here", self.router_id, presence.router_id)
            self._send_presence()  # at once: it need not wait a beat to hear of this one
        if snapshot_due:
            self._flush_active()  # what was collected goes first, in order
            events = self.core.active.snapshot_events()
            for i in range(0, len(events), SNAPSHOT_CHUNK):
                self._send_presence(presence.router_id, events[i : i + SNAPSHOT_CHUNK])

    def _send_presence(
        self, to: str | None = None, events: list[ActiveSequenceEvent] | None = None
    ) -> None:
        if self._publisher is not None:
            presence = ReplicaPresence(
                router_id=self.router_id, hears=self.peers.ids(), to=to, events=events or []
            )
            self._publisher.publish_nowait(ACTIVE_TOPIC, _encode(presence))

    def _publish_active(self, event: ActiveSequenceEvent) -> None:
        # Alone (no replica hears this one), changes are not sent: a replica that starts to
        # listen gets a snapshot instead.
        if self._publisher is not None and self.peers.listening:
            pending = self._pending_active
            pending.append(event)
            if len(pending) >= ACTIVE_BATCH_MAX:
                self._flush_active()
            elif len(pending) == 1:
                try:
                    asyncio.get_running_loop().call_soon(self._flush_active)
                except RuntimeError:  # no loop to flush on later: send at once
                    self._flush_active()

    def _flush_active(self) -> None:
        """Publish the changes collected since the last flush as one ``ActiveSequenceBatch``:
        one send per loop iteration instead of one per add / first token / free."""
        pending = self._pending_active
        if not pending:
            return
        self._pending_active = []
        if self._publisher is not None:
            self._publisher.publish_nowait(ACTIVE_TOPIC, _encode(ActiveSequenceBatch(pending)))

    # --- membership and resync ---------------------------------------------------------------

    def _on_instances_changed(self) -> None:
        # Only discovery's view matters here: an instance set aside (unreachable) keeps its
        # cache; one that left discovery is forgotten.
        live = self.client.announced_ids()
        for back in live - self._known_workers:
            self._departed.pop(back, None)
        for gone in self._known_workers - live:
            self._departed[gone] = None
            if len(self._departed) > DEPARTED_MEMORY:
                del self._departed[next(iter(self._departed))]
            self.core.on_worker_removed(gone)
            self._step_backlog.remove_worker(gone)
            self._last_event.pop(gone, None)
            self._routed_since_event.pop(gone, None)
            self.worker_hits.pop(gone, None)
            log.info("kv router %s: worker %x left; its cache is forgotten", self.router_id, gone)
        self._known_workers = live

    def _on_gap(self, worker_key: WorkerKey, expected: int, got: int) -> None:
        if worker_key in self._resyncing:
            return
        log.warning(
            "kv router %s: worker %x rank %d skipped KV events %d..%d; resynchronising",
            self.router_id, worker_key.worker_id, worker_key.dp_rank, expected, got - 1,
        )  # fmt: skip
        self._resyncing.add(worker_key)
        self._tasks.append(asyncio.create_task(self._resync(worker_key), name="kv-resync"))

    async def _resync(self, worker_key: WorkerKey) -> None:
        ctx = RequestContext()
        payload = _encode(KvSnapshotRequest(dp_rank=worker_key.dp_rank))
        try:
            async for raw in self.client.call(
                worker_key.worker_id, KV_SNAPSHOT_HANDLER, payload, ctx
            ):
                snapshot = _snapshot_decoder.decode(raw)
                self.core.on_kv_snapshot(
                    worker_key, snapshot.events, next_event_id=snapshot.next_event_id
                )
                self.num_resyncs += 1
                log.info(
                    "kv router %s: worker %x rank %d resynchronised (%d blocks)",
                    self.router_id, worker_key.worker_id, worker_key.dp_rank,
                    len(snapshot.events),
                )  # fmt: skip
        except Exception as exc:  # a worker without snapshots, or gone: keep going
            self.num_resync_failures += 1
            log.warning(
                "kv router %s: resync of worker %x failed: %s",
                self.router_id, worker_key.worker_id, exc,
            )  # fmt: skip
        finally:
            self._resyncing.discard(worker_key)
            self._tasks = [t for t in self._tasks if not t.done()]

    def _check_silence(self, worker: int) -> None:
        if worker in self._silent_warned or self._routed_since_event.get(worker, 0) < 3:
            return
        last = self._last_event.get(worker)
        now = self._clock()
        if last is None:
            self._last_event[worker] = last = now  # silence is counted from first sight
        if now - last >= self._silence_warn_s:
            self._silent_warned.add(worker)
            self.num_silent_warnings += 1
            log.warning(
                "kv router %s: worker %x got %d requests but sent no KV event for %.0f s; "
                "is KV event publishing enabled on it? Routing for it runs blind (consider "
                "--no-kv-events)",
                self.router_id, worker, self._routed_since_event[worker], now - last,
            )  # fmt: skip
