"""``MockerEngine``: the async edge around the synchronous scheduler.

One asyncio task per data-parallel rank loops::

    step (sync)  ->  sleep(step time / speedup)  ->  deliver tokens, publish KV events/load

and parks on an ``asyncio.Event`` when it has nothing to do (no busy loop). At speedup 0 it
does not sleep, but yields to the event loop after every step so many workers share one
process fairly. Sleeping aims at a deadline that advances by each step's duration, so the
event loop's own overhead does not accumulate into simulated time.

Tokens of a step are delivered at the *end* of its simulated duration, as a GPU's are.
Each request has a small stream (a deque and a waiter future: cheaper than an
``asyncio.Queue`` per token). A cancelled ``ctx`` is noticed after the current step, and a
closed generator aborts its request at once; either way the request's blocks go back.

Back-pressure: a stream that nobody reads would otherwise take one output per step for as
long as its request runs. Once it holds ``STREAM_HIGH_WATER`` outputs the request is paused
in the scheduler (``Scheduler.pause``: no more steps for it, its blocks kept); the consumer,
when it has taken the stream down to ``STREAM_LOW_WATER``, resumes it and wakes the loop.
When every request of a rank is paused the loop parks as when idle; a cancelled ``ctx`` of a
paused request wakes it (a watcher task per paused stream), so its blocks go back at once.

Disaggregated serving (``engines.mocker.disagg``): a prefill-stage request's blocks are
parked under a ``KvHandle`` attached to its last output; a decode-stage request first obtains
its handle's KV (pull, or wait for the push), then runs with those tokens already computed.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec

from turnout.engines.base import Engine
from turnout.engines.kv_transfer import KvTransport
from turnout.engines.mocker.config import MockerConfig
from turnout.engines.mocker.disagg import KvArrivals, KvHandles
from turnout.engines.mocker.kv_pool import KvBlockPool
from turnout.engines.mocker.lora import LoraListener, LoraManager
from turnout.engines.mocker.rank import (
    KvEventSink,
    MockerStats,
    NullEventSink,
    Rank,
    Stream,
)
from turnout.engines.mocker.scheduler import Scheduler, StepResult
from turnout.engines.mocker.spans import MockerSpans
from turnout.engines.mocker.timing import Clock, Sleep, TimingModel
from turnout.engines.mocker.tokens import TokenSampler
from turnout.protocols.disagg import KvTransferOp, KvTransferReply, KvTransferRequest
from turnout.protocols.kv import KvEventBatch, KvSnapshot, LoadReport
from turnout.protocols.llm import ErrorKind, FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import (
    EndpointId,
    ModelCapabilities,
    ModelDeploymentCard,
    ModelType,
    RuntimeConfig,
    WorkerRole,
)
from turnout.runtime import tracing
from turnout.runtime.context import RequestContext

log = logging.getLogger(__name__)


#: How far (wall seconds) a loop may run behind its schedule before it stops catching up.
_MAX_LAG_S = 0.05
#: Seconds between two sweeps for expired KV handles (while any are parked), at most.
_HANDLE_SWEEP_S = 1.0


class MockerEngine(Engine):
    """A simulated vLLM-style worker (``dp_size`` ranks) behind the ``Engine`` contract."""

    def __init__(
        self,
        config: MockerConfig,
        *,
        worker_id: int = 0,
        sink: KvEventSink | None = None,
        timing: TimingModel | None = None,
        sampler: TokenSampler | None = None,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        model_path: str | Path | None = None,
        served_model_name: str | None = None,
        context_length: int | None = None,
        validate: bool = True,
    ) -> None:
        if validate:
            config.validate()
        self._config = config
        self._sink: KvEventSink = sink or NullEventSink()
        self._clock = clock
        self._sleep = sleep
        self._model_path = model_path
        self._served_model_name = served_model_name
        self._context_length = context_length
        self._worker_id = worker_id
        self._ids = itertools.count()
        self._sample_rng = random.Random(config.seed ^ worker_id)
        self._ranks = [
            Rank(
                Scheduler(
                    config,
                    pool=KvBlockPool(
                        config.num_gpu_blocks,
                        config.block_size,
                        worker_id=worker_id,
                        dp_rank=rank,
                    ),
                    timing=timing,
                    sampler=sampler,
                ),
                rank,
            )
            for rank in range(config.dp_size)
        ]
        self._started = False
        self._closed = False
        self._endpoint: EndpointId | None = None
        self._handles = KvHandles(config, self._release_parked, clock=clock, sleep=sleep)
        self._arrivals = KvArrivals(config, clock=clock)
        self._sweeper: asyncio.Task[None] | None = None
        #: The LoRA adapters this worker can load (None: it serves the base model only).
        self.loras: LoraManager | None = None
        if config.lora_adapters:
            speedup = config.speedup_ratio
            self.loras = LoraManager(
                config.lora_adapters,
                max_loras=config.max_loras,
                load_seconds=config.lora_load_ms / 1000 / speedup if speedup > 0 else 0.0,
                clock=clock,
                sleep=sleep,
            )

    # ---- identity -------------------------------------------------------------------------

    @property
    def worker_id(self) -> int:
        return self._worker_id

    def kv_snapshot(self, dp_rank: int = 0) -> KvSnapshot:
        """The resident cache of one rank, for a router's resync."""
        pool = self._ranks[dp_rank].scheduler.pool
        events, next_event_id = pool.snapshot()
        return KvSnapshot(
            worker_id=self._worker_id, dp_rank=dp_rank, next_event_id=next_event_id,
            events=events,
        )  # fmt: skip

    def set_lora_listener(self, listener: LoraListener) -> None:
        """Who hears of adapters loaded and evicted (the worker publishes their cards)."""
        if self.loras is not None:
            self.loras.set_listener(listener)

    def loaded_loras(self) -> list[str]:
        """The LoRA adapters loaded now, sorted (each has a model card while loaded)."""
        return self.loras.slots.loaded() if self.loras is not None else []

    def bind_kv_transport(self, transport: KvTransport, endpoint: EndpointId) -> None:
        """How this worker reaches others to move KV, and the endpoint its handles name
        (the worker wires both before requests flow)."""
        self._handles.transport = transport
        self._arrivals.transport = transport
        self._endpoint = endpoint

    @property
    def kv_handles(self) -> KvHandles:
        """The KV handles parked on this worker (prefill side)."""
        return self._handles

    @property
    def kv_arrivals(self) -> KvArrivals:
        """KV obtained from prefill workers (decode side)."""
        return self._arrivals

    async def serve_kv_transfer(self, request: KvTransferRequest) -> KvTransferReply:
        """The ``KV_TRANSFER_HANDLER``: a pull or release of a handle parked here, or a push
        of one arriving here."""
        if request.op is KvTransferOp.PUSH:
            if request.handle is None:
                return KvTransferReply(ok=False, error="a push must carry its handle")
            return self._arrivals.deliver(request.handle)
        return await self._handles.serve(request)

    def set_event_sink(self, sink: KvEventSink) -> None:
        """Where KV events and load reports go from now on (the worker wires the plane)."""
        self._sink = sink

    def bind_instance(self, instance_id: int) -> None:
        self.set_worker_id(instance_id)

    def set_worker_id(self, worker_id: int) -> None:
        """Set the id stamped on KV events and load reports (the instance id, known only
        after the worker registered). Set it before requests flow."""
        self._worker_id = worker_id
        for rank in self._ranks:
            rank.scheduler.pool.worker_id = worker_id

    @property
    def config(self) -> MockerConfig:
        return self._config

    def get_stats(self) -> MockerStats:
        """Loop counters summed over the ranks."""
        total = MockerStats()
        for rank in self._ranks:
            total = total.add(rank.stats)
        return total

    def get_schedulers(self) -> list[Scheduler]:
        """The per-rank schedulers (read-mostly: tests and benchmarks inspect pools)."""
        return [rank.scheduler for rank in self._ranks]

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        if self._closed:
            raise RuntimeError("this MockerEngine was stopped; make a new one")
        if self._started:
            return
        self._started = True
        for rank in self._ranks:
            rank.task = asyncio.create_task(
                self._run(rank), name=f"mocker-w{self._worker_id}-r{rank.dp_rank}"
            )

    async def stop(self) -> None:
        """Stop the loops; every in-flight stream ends with an ERROR output. Final."""
        self._closed = True
        if self.loras is not None:
            await self.loras.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.wait([self._sweeper])
            self._sweeper = None
        await self._handles.close()
        tasks = [rank.task for rank in self._ranks if rank.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rank in self._ranks:
            rank.task = None
            self._fail_streams(rank, "engine stopped")
            self._publish_events(rank)

    # ---- the Engine contract --------------------------------------------------------------

    def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        """Run ``request``; one that names a LoRA adapter first holds it (loading it, and
        waiting the simulated load time, on first use) until its stream ends."""
        if not request.lora_name:
            return self._generate(request, ctx)
        return self._generate_lora(request.lora_name, request, ctx)

    async def _generate_lora(
        self, name: str, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        loras = self.loras
        if loras is None or not await loras.acquire(name):
            yield LLMEngineOutput(
                finish_reason=FinishReason.ERROR,
                error=f"this worker cannot load LoRA adapter {name!r}",
                error_kind=ErrorKind.BAD_REQUEST.value,
            )
            return
        stream = self._generate(request, ctx)
        try:
            async for out in stream:
                yield out
        finally:
            try:
                await stream.aclose()  # type: ignore[attr-defined]  # abort it now, not at GC
            finally:
                loras.release(name)

    async def _generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        if self._closed:
            yield LLMEngineOutput(
                finish_reason=FinishReason.ERROR,
                error=self.failure or "engine stopped",
                error_kind=ErrorKind.ENGINE_FAILED.value,
            )
            return
        if ctx.is_cancelled:
            yield LLMEngineOutput(finish_reason=FinishReason.CANCELLED)
            return
        if not self._started:
            await self.start()
        disagg = request.disagg
        prefill = disagg.prefill if disagg is not None else None
        handle = disagg.handle if disagg is not None else None
        transfer_s: float | None = None
        if handle is not None:
            # Decode stage: the prompt's KV comes from the prefill worker, not the model.
            start = self._clock()
            reason = await self._arrivals.obtain(handle, self._worker_id)
            if reason is not None:
                yield LLMEngineOutput(
                    finish_reason=FinishReason.ERROR,
                    error=reason,
                    error_kind=ErrorKind.KV_TRANSFER_FAILED.value,
                )
                return
            transfer_s = self._clock() - start
            if ctx.is_cancelled:
                yield LLMEngineOutput(finish_reason=FinishReason.CANCELLED)
                return
        rank = self._pick_rank(request)
        # Internal ids: a migrated request may come back with the same ctx.request_id.
        rid = f"{ctx.request_id}#{next(self._ids)}"
        refused = rank.scheduler.add_request(
            rid,
            request,
            hold_kv=prefill is not None,
            imported_tokens=handle.num_tokens if handle is not None else 0,
        )
        if refused is not None:
            yield refused
            return
        stream = Stream(ctx, prefill, len(request.token_ids))
        rank.streams[rid] = stream
        rank.wake.set()
        spans: MockerSpans | None = None
        if ctx.trace is not None:
            tracing.add_event(ctx, "mocker.scheduled")  # in its rank's queue from here
            mock_request = rank.scheduler.get_request(rid)
            if mock_request is not None:
                spans = MockerSpans(ctx, mock_request)
        loop = asyncio.get_running_loop()
        finished = False
        try:
            while True:
                if not stream.items:
                    stream.waiter = loop.create_future()
                    await stream.waiter
                    stream.waiter = None
                out = stream.items.popleft()
                if stream.paused and stream.has_drained:
                    self._resume_stream(rank, rid, stream)
                if out.finish_reason is not None:
                    finished = True
                if transfer_s is not None and (out.token_ids or finished):
                    extra = dict(out.extra or {})
                    extra["kv_transfer_s"] = transfer_s
                    out = msgspec.structs.replace(out, extra=extra)
                    transfer_s = None
                if spans is not None:
                    spans.output(out)
                yield out
                if finished:
                    return
        finally:
            if spans is not None:
                spans.end(finished)
            stream.stop_watching()
            if not finished:
                # A handle its consumer never saw: nobody will claim its blocks.
                for out in stream.items:
                    if out.kv_handle is not None:
                        self._handles.drop(out.kv_handle.handle_id)
            if (
                rank.streams.pop(rid, None) is not None
                and not finished
                and rank.scheduler.abort(rid)
            ):
                self._publish_events(rank)
                self._maybe_publish_load(rank, force=False)

    def model_card_template(self) -> ModelDeploymentCard:
        """The real model's card (tokenizer, template) with the mocker's KV geometry, so the
        frontend runs its real pipeline in front of simulated workers."""
        cfg = self._config
        base = _load_base_card(
            str(self._model_path) if self._model_path else None, self._context_length
        )
        role = WorkerRole(cfg.role)
        return msgspec.structs.replace(
            base,
            display_name=self._served_model_name or base.display_name,
            # A prefill worker serves no client request: its card says so, and which model
            # it prefills for (the same display name).
            model_type=ModelType.Prefill if role is WorkerRole.PREFILL else base.model_type,
            worker_role=role,
            # The scheduler holds back stops before min_tokens, reports (simulated) log
            # probabilities of its tokens, and partitions its prefix cache by cache_salt
            # (the salt seeds the first block's hash).
            capabilities=ModelCapabilities(
                min_tokens=True, logprobs=True, max_top_logprobs=20, cache_salt=True
            ),
            # A prompt must fit in the pool: saying so in the card lets the frontend refuse a
            # longer one with a 400 before it reaches a worker.
            context_length=min(base.context_length, cfg.max_context_tokens),
            kv_cache_block_size=cfg.block_size,
            lora_adapters=sorted(cfg.lora_adapters),
            runtime_config=RuntimeConfig(
                total_kv_blocks=cfg.num_gpu_blocks,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                data_parallel_size=cfg.dp_size,
                enable_kv_events=cfg.enable_prefix_caching,
                kv_transfer=cfg.kv_transfer if role is WorkerRole.PREFILL else None,
            ),
        )

    # ---- the loop -------------------------------------------------------------------------

    def _pick_rank(self, request: PreprocessedRequest) -> Rank:
        ranks = self._ranks
        if len(ranks) == 1:
            return ranks[0]
        wanted = (request.extra_args or {}).get("dp_rank")
        if isinstance(wanted, int) and 0 <= wanted < len(ranks):
            return ranks[wanted]
        return min(ranks, key=lambda r: r.scheduler.num_waiting + r.scheduler.num_running)

    async def _run(self, rank: Rank) -> None:
        """The rank's loop; a bug inside it ends every stream with ERROR, never a hang."""
        try:
            await self._loop(rank)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # One line for the operator; the traceback at debug level.
            log.debug("mocker worker %s rank %s loop failed", self._worker_id, rank.dp_rank,
                      exc_info=True)  # fmt: skip
            reason = f"mocker worker {self._worker_id:x} rank {rank.dp_rank} loop failed: {exc!r}"
            self._closed = True
            for other in self._ranks:  # the whole engine is out of service
                self._fail_streams(other, reason)
            self.report_failure(reason)

    def health(self) -> str | None:
        """None while every rank's loop runs and steps when it has work."""
        if self.failure is not None:
            return self.failure
        if not self._started or self._closed:
            return None
        now = self._clock()
        for rank in self._ranks:
            task = rank.task
            if task is not None and task.done():
                return f"rank {rank.dp_rank}: step loop ended"
            scheduler = rank.scheduler
            idle = now - rank.last_beat
            if scheduler.has_work() and idle > self._config.health_timeout_s:
                return (
                    f"rank {rank.dp_rank}: step loop has not stepped for {idle:.1f}s with "
                    f"{scheduler.num_waiting + scheduler.num_running} requests"
                )
        return None

    async def _loop(self, rank: Rank) -> None:
        scheduler = rank.scheduler
        speedup = self._config.speedup_ratio
        clock = self._clock
        sleep = self._sleep
        stats = rank.stats
        deadline = clock()
        fail_after = self._config.fail_after_steps
        self._maybe_publish_load(rank, force=True)
        while True:
            rank.last_beat = clock()
            if not scheduler.has_work():
                rank.wake.clear()
                timeout = max(0.0, rank.next_report - clock())
                try:
                    async with asyncio.timeout(timeout):
                        await rank.wake.wait()
                except TimeoutError:
                    self._maybe_publish_load(rank, force=True)
                # Parked with paused requests: the wake may be a paused request's cancel.
                if self._reap_cancelled(rank):
                    self._maybe_publish_load(rank, force=False)
                deadline = clock()
                continue
            # Simulated time: the sum of step durations so far.
            result = scheduler.step(stats.simulated_s)
            stats.num_steps += 1
            if fail_after and stats.num_steps >= fail_after:
                raise RuntimeError(
                    f"injected failure after {fail_after} steps (--fail-after-steps)"
                )
            stats.simulated_s += result.duration_s
            if result.num_scheduled:
                rank.sample_step(result, speedup, self._sample_rng)
            if speedup > 0 and result.duration_s > 0:
                # Aim at a deadline so loop overhead does not add up; a debt of more than
                # _MAX_LAG_S is written off (and counted) rather than repaid in a burst.
                deadline += result.duration_s / speedup
                now = clock()
                if now - deadline > _MAX_LAG_S:
                    stats.late_s += now - _MAX_LAG_S - deadline
                    deadline = now - _MAX_LAG_S
                delay = deadline - now
                await sleep(delay if delay > 0 else 0)
            elif result.num_scheduled == 0:
                # Cannot happen (a lone request always fits); never spin if it does.
                await sleep(0.001)
            else:
                await sleep(0)
            self._deliver(rank, result)
            self._publish_events(rank)
            self._reap_cancelled(rank)
            self._maybe_publish_load(rank, force=clock() >= rank.next_report)
            if speedup == 0:
                deadline = clock()

    def _fail_streams(self, rank: Rank, message: str) -> None:
        """End every stream of ``rank`` with an ERROR output and drop its requests."""
        for rid, stream in list(rank.streams.items()):
            rank.scheduler.abort(rid)
            stream.stop_watching()
            stream.push(
                LLMEngineOutput(
                    finish_reason=FinishReason.ERROR,
                    error=message,
                    error_kind=ErrorKind.ENGINE_FAILED.value,
                )
            )
        rank.streams.clear()

    def _deliver(self, rank: Rank, result: StepResult) -> None:
        streams = rank.streams
        parked = rank.scheduler.is_parked
        for rid, out in result.outputs:
            stream = streams.get(rid)
            if out.finish_reason is not None and parked(rid):
                out = self._park(rank, rid, stream, out)
            if stream is not None:
                stream.push(out)
                if out.finish_reason is None and stream.is_full and not stream.paused:
                    self._pause_stream(rank, rid, stream)

    def _pause_stream(self, rank: Rank, rid: str, stream: Stream) -> None:
        """Nobody reads ``stream``: stop stepping its request until the consumer catches up
        (``_resume_stream``), so it holds at most ``STREAM_HIGH_WATER`` outputs."""
        if not rank.scheduler.pause(rid):
            return
        stream.paused = True
        stream.watcher = asyncio.get_running_loop().create_task(
            _wake_on_cancel(rank, stream.ctx), name=f"mocker-paused-{rid}"
        )

    def _resume_stream(self, rank: Rank, rid: str, stream: Stream) -> None:
        """The consumer took ``stream`` down to ``STREAM_LOW_WATER``: step its request again."""
        stream.paused = False
        stream.stop_watching()
        if rank.scheduler.resume(rid):
            rank.wake.set()

    def _park(
        self, rank: Rank, rid: str, stream: Stream | None, out: LLMEngineOutput
    ) -> LLMEngineOutput:
        """A prefill stage ended: name its parked blocks with a handle on its last output
        (or free them at once when nobody is there to take the handle)."""
        prefill = stream.prefill if stream is not None else None
        if stream is None or prefill is None or stream.ctx.is_cancelled or self._endpoint is None:
            self._release_parked(rank.dp_rank, rid)
            return out
        handle = self._handles.park(
            dp_rank=rank.dp_rank,
            request_id=rid,
            num_tokens=stream.num_prompt_tokens,
            endpoint=self._endpoint,
            instance_id=self._worker_id,
            push_to=prefill.push_to,
            push_endpoint=prefill.push_endpoint,
        )
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_handles())
        return msgspec.structs.replace(out, kv_handle=handle)

    def _release_parked(self, dp_rank: int, rid: str) -> None:
        rank = self._ranks[dp_rank]
        if rank.scheduler.release_parked(rid):
            self._publish_events(rank)
            self._maybe_publish_load(rank, force=False)

    async def _sweep_handles(self) -> None:
        """Free handles whose TTL passed, while any are parked."""
        interval = min(_HANDLE_SWEEP_S, self._config.kv_handle_ttl_s)
        while len(self._handles):
            await self._sleep(interval)
            self._handles.expire()

    def _reap_cancelled(self, rank: Rank) -> bool:
        """Abort the requests whose ``ctx`` was cancelled; whether there were any."""
        cancelled = [rid for rid, s in rank.streams.items() if s.ctx.is_cancelled]
        for rid in cancelled:
            stream = rank.streams.pop(rid)
            stream.stop_watching()
            if rank.scheduler.abort(rid):
                stream.push(LLMEngineOutput(finish_reason=FinishReason.CANCELLED))
        if cancelled:
            self._publish_events(rank)
        return bool(cancelled)

    def _publish_events(self, rank: Rank) -> None:
        events = rank.scheduler.pool.take_events()
        if events:
            try:
                self._sink.publish_kv(KvEventBatch(events=events))
            except Exception:  # a sink's failure must not stop the engine
                log.exception("publishing KV events failed (worker %s)", self._worker_id)

    def _maybe_publish_load(self, rank: Rank, *, force: bool) -> None:
        """Publish a load report when it changed, or when ``force`` (the steady beat)."""
        load = rank.scheduler.get_load()
        key = (
            load.num_waiting,
            load.num_running,
            load.active_decode_blocks,
            load.active_prefill_tokens,
            rank.scheduler.is_full,
        )
        if not force and key == rank.last_load_key:
            return
        rank.last_load_key = key
        rank.next_report = self._clock() + self._config.load_report_interval_s
        report = LoadReport(
            worker_id=self._worker_id,
            dp_rank=rank.dp_rank,
            active_prefill_tokens=load.active_prefill_tokens,
            active_decode_blocks=load.active_decode_blocks,
            kv_usage=load.kv_usage,
            num_waiting=load.num_waiting,
            num_running=load.num_running,
            total_kv_blocks=load.total_kv_blocks,
            busy=rank.scheduler.is_full,
            steps=rank.step_samples,
            max_num_batched_tokens=self._config.max_num_batched_tokens,
        )
        rank.step_samples = []
        rank.steps_since_report = 0
        try:
            self._sink.publish_load(report)
        except Exception:  # a sink's failure must not stop the engine
            log.exception("publishing a load report failed (worker %s)", self._worker_id)


async def _wake_on_cancel(rank: Rank, ctx: RequestContext) -> None:
    """Wake ``rank``'s loop when ``ctx`` is cancelled (a paused request's watcher)."""
    await ctx.wait_cancelled()
    rank.wake.set()


def make_mocker_engines(
    config: MockerConfig,
    num_workers: int,
    *,
    sink: KvEventSink | None = None,
    timing: TimingModel | None = None,
    first_worker_id: int = 0,
    **kwargs: object,
) -> list[MockerEngine]:
    """N independent simulated workers for one process (ids ``first_worker_id`` + i).

    The config is validated once, counting all N workers' bookkeeping against memory.
    """
    config.validate(num_workers=num_workers)
    return [
        MockerEngine(
            config,
            worker_id=first_worker_id + i,
            sink=sink,
            timing=timing,
            validate=False,
            **kwargs,  # type: ignore[arg-type]
        )
        for i in range(num_workers)
    ]


@functools.lru_cache(maxsize=8)
def _load_base_card(model_path: str | None, context_length: int | None) -> ModelDeploymentCard:
    """The model's card, read once per process: 64 simulated workers share one model, and
    reading a GGUF's metadata costs a noticeable fraction of a second."""
    # Imported here: it pulls in gguf and tokenizers, which only a worker's card needs.
    from turnout.llm import model_card

    return model_card.load_model_card(
        model_path or model_card.default_gguf_path(),
        endpoint=EndpointId(namespace="placeholder", component="placeholder", name="generate"),
        context_length=context_length,
    )
