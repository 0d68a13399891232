"""Disaggregated serving's first stage: send the prompt to a prefill worker, then the rest of
the request to a decode worker that takes the prompt's KV instead of computing it.

Dynamo's ``PrefillRouter`` re-designed for turnout's pipeline, where it sits between
migration and the decode router::

    migration -> prefill router -> (session affinity) -> router -> decode worker
                      |
                      +-> prefill pool's router -> prefill worker

Each model has a ``PrefillSlot`` (``router.prefill_slots``); the frontend's model watcher
*activates* it with a ``PrefillPool`` when the model's first prefill instance appears and
deactivates it with the last. While it is inactive the prefill router is not in the way at
all (``generate`` hands the request straight to the decode router, no extra stage per token),
except for a model whose workers run as ``decode`` with ``--no-decode-fallback``: its requests
wait for a prefill worker, bounded, then fail with a 503 that names the missing role.

While active, per request:

1. Choose the decode worker first (KV router: by its load and its own cached prefix of the
   prompt, booked), so that a push-mode prefill worker knows where to send the KV, and so
   that a prompt the decode worker mostly holds already can skip the prefill stage.
2. *Conditional disaggregation* (``router.prefill_policy.BypassPolicy``): the request may run
   whole on the decode worker (short or decode-cached prompt, one token, LoRA, pinned,
   structured output, mismatched cards).
3. Prefill stage: the prompt goes to a prefill worker (KV overlap and load among prefill
   workers) with ``max_tokens`` 1. Its first token goes to the client at once; its answer
   carries a ``KvHandle``. A prefill worker that dies mid-prefill is set aside and the
   prefill re-run on another (at most ``MAX_PREFILL_ATTEMPTS`` tries); one that stalls past
   migration's TTFT limit is set aside too (on the prefill client, never on the decode
   side), and migration starts the request again. One that refuses it as
   ``overloaded`` is left out for this request and the prefill sent to another; when every
   prefill worker refused, the refusal goes to the client (a 503).
4. Decode stage: prompt + first token, with the handle, to the chosen decode worker. A decode
   worker that cannot get the KV (prefill worker gone mid-transfer, handle expired) answers
   ``KV_TRANSFER_FAILED`` before any token; the prefill is re-run (at most
   ``MAX_KV_RETRIES`` times, then the decode worker computes the prompt itself). A decode
   worker that dies later is migration's business, as for any request: the continuation
   comes back through here and may be prefilled again.

Each stage's result is a typed outcome (``Prefilled``/``PrefillFailed``/``PrefillRefused``
for one prefill attempt, ``DecodeStarted``/``KvTransferFailed`` for the start of a decode
attempt); only what the layers above act on is raised (``StreamBroken`` when every prefill
attempt failed, ``NoInstanceAvailable`` when a decode-only model has no prefill worker).

A handle the decode side never took (client gone, first token ended the request, decode
worker died before the pull) is released on the prefill worker at once rather than left to
its TTL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from turnout.errors import NoInstanceAvailable, StreamBroken
from turnout.protocols.disagg import (
    KV_TRANSFER_HANDLER,
    DisaggParams,
    KvHandle,
    KvTransferOp,
    KvTransferRequest,
    PrefillParams,
)
from turnout.protocols.llm import ErrorKind, FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import EndpointId, WorkerRole
from turnout.router.kv.push import KvPushRouter
from turnout.router.kv.selector import Selection
from turnout.router.prefill_policy import BypassPolicy, LocalReason
from turnout.router.prefill_slots import EngineFn, PrefillPool, PrefillSlot
from turnout.runtime import tracing
from turnout.runtime.context import (
    AVOID_METADATA,
    DEADLINE_METADATA,
    STALLED_METADATA,
    RequestContext,
)

log = logging.getLogger(__name__)

#: How long a request of a decode-only model waits for a prefill worker with
#: ``--no-decode-fallback`` (its own deadline, when sooner, ends the wait first).
PREFILL_WAIT_S = 30.0
#: Prefill re-runs after decode workers failed to get the KV; then the decode worker
#: computes the prompt itself.
MAX_KV_RETRIES = 2
#: Prefill attempts before a request whose prefill workers keep dying fails.
MAX_PREFILL_ATTEMPTS = 3
#: Prefill workers one request is sent away from after ``overloaded`` answers.
MAX_PREFILL_REFUSALS = 64
#: Releases of unclaimed handles in flight at once (more are left to the handles' TTL).
MAX_PENDING_RELEASES = 256
RELEASE_TIMEOUT_S = 5.0

_ERROR = FinishReason.ERROR
_KV_FAILED = ErrorKind.KV_TRANSFER_FAILED.value
_ENGINE_FAILED = ErrorKind.ENGINE_FAILED.value
_OVERLOADED = ErrorKind.OVERLOADED.value
_encode = msgspec.msgpack.Encoder().encode


class Stage(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    LOCAL = "local"


class DisaggObserver(Protocol):
    """Where the prefill router reports what it did (the frontend's metrics)."""

    def stage(self, stage: Stage, seconds: float) -> None: ...

    def local(self, reason: LocalReason) -> None: ...

    def transferred(self, num_bytes: int) -> None: ...

    def retry(self, reason: str) -> None: ...


# -- typed outcomes -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A prefill attempt that answered: its first token(s) and KV handle, or the output that
    ends the request here (``ending``: an error, or a first token that stops it)."""

    tokens: list[int]
    #: The first token's log probability, when the request asked for them.
    log_probs: list[float]
    #: Its alternatives, when the request asked for some.
    top_logprobs: list[list[tuple[int, float]]]
    handle: KvHandle | None
    ending: LLMEngineOutput | None
    cached_tokens: int | None
    #: The prefill half of the request's routing record.
    record: dict[str, Any]


@dataclass(frozen=True, slots=True)
class PrefillFailed:
    """A prefill attempt whose worker died (its stream broke, or its engine failed)."""

    reason: str
    worker: int | None
    #: A handle it announced before failing (released at once).
    handle: KvHandle | None


@dataclass(frozen=True, slots=True)
class PrefillRefused:
    """A prefill attempt whose worker refused the request as ``overloaded``."""

    output: LLMEngineOutput
    worker: int | None
    handle: KvHandle | None


@dataclass(frozen=True, slots=True)
class DecodeStarted:
    """A decode attempt that got past its start: its first output (None: none at all)."""

    first: LLMEngineOutput | None


@dataclass(frozen=True, slots=True)
class KvTransferFailed:
    """A decode worker that could not get the prompt's KV (before any token)."""

    reason: str


# -- the router -----------------------------------------------------------------------------


class PrefillRouter:
    """See the module docstring. ``decode`` is the decode router's ``generate`` (what the
    pipeline would call without disaggregation); ``decode_kv`` the decode KV router when the
    decode worker may be chosen up front (KV mode without session affinity)."""

    def __init__(
        self,
        slot: PrefillSlot,
        decode: EngineFn,
        *,
        checksum: str,
        role: WorkerRole,
        decode_endpoint: EndpointId,
        block_size: int,
        min_tokens: int,
        fallback: bool = True,
        decode_kv: KvPushRouter | None = None,
        observer: DisaggObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait_s: float = PREFILL_WAIT_S,
    ) -> None:
        self.slot = slot
        self._decode = decode
        self._role = role
        self._decode_endpoint = decode_endpoint
        self._fallback = fallback
        self._decode_kv = decode_kv
        self._observer = observer
        self._clock = clock
        self._wait_s = wait_s
        self._policy = BypassPolicy(
            model=slot.name, checksum=checksum, block_size=block_size, min_tokens=min_tokens
        )
        self._releases: set[asyncio.Task[None]] = set()

    @property
    def waits_for_prefill(self) -> bool:
        """Requests need a prefill worker (decode-only model, no fallback)."""
        return self._role is WorkerRole.DECODE and not self._fallback

    def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        pool = self.slot.pool
        if pool is None and not self.waits_for_prefill:
            if self._role is WorkerRole.DECODE and self._observer is not None:
                self._observer.local(LocalReason.NO_PREFILL_WORKER)
            return self._decode(request, ctx)
        return self._disaggregated(request, ctx, pool)

    # -- the request --------------------------------------------------------------------------

    async def _disaggregated(
        self, request: PreprocessedRequest, ctx: RequestContext, pool: PrefillPool | None
    ) -> AsyncIterator[LLMEngineOutput]:
        if pool is None:
            pool = await self._wait_for_pool(ctx)
        selection: Selection | None = None
        #: The handle the decode side has not taken yet, and the pool it came from.
        handle: KvHandle | None = None
        handle_pool = pool
        try:
            reason = self._policy.before_routing(request, pool.checksum)
            if reason is None and self._decode_kv is not None:
                selection = self._decode_kv.select(request, ctx)
            if reason is None:
                overlap = selection.overlap_blocks if selection is not None else 0
                reason = self._policy.after_routing(request, overlap)
            if reason is not None:
                stream, selection = self._send_decode(request, ctx, selection), None
                async for output in self._local(stream, ctx, reason):
                    yield output
                return

            push_to = selection.worker_id if selection is not None else None
            prefilled = await self._prefill(request, ctx, pool, push_to)
            handle = prefilled.handle
            if prefilled.ending is not None:
                yield prefilled.ending
                return
            yield LLMEngineOutput(
                token_ids=prefilled.tokens,
                log_probs=prefilled.log_probs or None,
                top_logprobs=prefilled.top_logprobs or None,
            )
            decode_request = request.continued(prefilled.tokens)
            if handle is None:
                self._count_local(LocalReason.NO_HANDLE)
            retries = 0
            while True:
                attempt = msgspec.structs.replace(
                    decode_request, disagg=DisaggParams(handle=handle) if handle else None
                )
                stream, selection = self._send_decode(attempt, ctx, selection), None
                try:
                    start = self._clock()
                    started = await self._start_decode(stream)
                    if isinstance(started, DecodeStarted):
                        if started.first is not None:
                            handle = None  # the decode worker took it
                        decoded = self._decoded(
                            stream, started, ctx, prefilled, attempt.disagg, start
                        )
                        try:
                            async for output in decoded:
                                yield output
                        finally:
                            await decoded.aclose()  # type: ignore[attr-defined]
                        return
                finally:
                    await stream.aclose()  # type: ignore[attr-defined]
                # The decode worker could not get the KV: prefill again (another handle).
                retries += 1
                self._count_retry("kv_transfer")
                log.warning(
                    "request %s: decode worker could not get the KV (%s); %s",
                    ctx.request_id,
                    started.reason,
                    "prefilling again" if retries <= MAX_KV_RETRIES else "computing it there",
                )
                handle = None
                current = self.slot.pool
                if retries > MAX_KV_RETRIES or current is None:
                    self._count_local(LocalReason.KV_RETRIES_EXHAUSTED)
                    continue
                if self._decode_kv is not None:
                    selection = self._decode_kv.select(decode_request, ctx)
                push_to = selection.worker_id if selection is not None else None
                again = await self._prefill(request, ctx, current, push_to)
                handle, handle_pool = again.handle, current
                if again.ending is not None and again.ending.finish_reason is _ERROR:
                    yield again.ending
                    return
                # Its first token is dropped (the client has one already); its worker and
                # handle are the ones the next decode attempt uses.
                prefilled = dataclasses.replace(
                    prefilled,
                    handle=again.handle,
                    record=again.record,
                    cached_tokens=again.cached_tokens,
                )
        finally:
            if selection is not None and self._decode_kv is not None:
                self._decode_kv.router.on_finished(ctx.request_id)
            if handle is not None:
                self._release(handle_pool, handle)

    async def _wait_for_pool(self, ctx: RequestContext) -> PrefillPool:
        """A decode-only model without fallback: wait for a prefill worker, bounded by
        ``wait_s`` and a little less than the request's deadline (a 503 that names the
        missing role says more than a timeout)."""
        wait = self._wait_s
        deadline = ctx.metadata.get(DEADLINE_METADATA)
        if isinstance(deadline, float):
            left = deadline - asyncio.get_running_loop().time()
            wait = max(0.0, min(wait, left * 0.9))
        pool = await self.slot.wait_active(wait)
        if pool is None:
            raise NoInstanceAvailable(
                f"model {self.slot.name!r} has decode workers but no prefill worker "
                f"(role prefill) after {wait:g}s, and --no-decode-fallback is set"
            )
        return pool

    def _send_decode(
        self, request: PreprocessedRequest, ctx: RequestContext, selection: Selection | None
    ) -> AsyncIterator[LLMEngineOutput]:
        if selection is not None:
            assert self._decode_kv is not None
            return self._decode_kv.generate(request, ctx, selection)
        return self._decode(request, ctx)

    async def _local(
        self, stream: AsyncIterator[LLMEngineOutput], ctx: RequestContext, reason: LocalReason
    ) -> AsyncIterator[LLMEngineOutput]:
        self._count_local(reason)
        start = self._clock()
        first = True
        try:
            async for output in stream:
                if first and output.token_ids:
                    first = False
                    self._observe(Stage.LOCAL, self._clock() - start)
                    routing = ctx.metadata.get("routing")
                    ctx.metadata["routing"] = {
                        "disaggregated": False,
                        "reason": reason.value,
                        "decode": routing,
                    }
                yield output
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    # -- the prefill stage --------------------------------------------------------------------

    async def _prefill(
        self,
        request: PreprocessedRequest,
        ctx: RequestContext,
        pool: PrefillPool,
        push_to: int | None,
    ) -> Prefilled:
        """Run the prompt on a prefill worker; re-run it elsewhere if that worker dies.
        ``StreamBroken`` when ``MAX_PREFILL_ATTEMPTS`` attempts failed."""
        stop = request.stop_conditions
        prefill_request = msgspec.structs.replace(
            request,
            stop_conditions=msgspec.structs.replace(
                stop, max_tokens=1, min_tokens=1 if stop.min_tokens else None
            ),
            disagg=DisaggParams(
                prefill=PrefillParams(
                    push_to=push_to,
                    push_endpoint=self._decode_endpoint if push_to is not None else None,
                )
            ),
        )
        # The prefill workers that refused this request: the prefill pool's router leaves
        # them out (the request's own list, of decode instances, is put back after).
        refused: set[int] = set()
        avoided = ctx.metadata.get(AVOID_METADATA)
        ctx.metadata[AVOID_METADATA] = refused
        # The prefill stage's span: the prefill workers' attempts are its children.
        parent = ctx.trace
        span = tracing.start_span(
            ctx, "prefill", {"turnout.push_to": f"{push_to:x}" if push_to is not None else ""}
        )
        if span is not None:
            ctx.trace = span
        error: BaseException | None = None
        try:
            return await self._prefill_attempts(prefill_request, ctx, pool, refused)
        except BaseException as exc:
            error = exc
            raise
        finally:
            if span is not None:
                ctx.trace = parent
                tracing.end_span(span, error)
            if avoided is None:
                ctx.metadata.pop(AVOID_METADATA, None)
            else:
                ctx.metadata[AVOID_METADATA] = avoided

    async def _prefill_attempts(
        self,
        prefill_request: PreprocessedRequest,
        ctx: RequestContext,
        pool: PrefillPool,
        refused: set[int],
    ) -> Prefilled:
        attempts = 0
        refusal: PrefillRefused | None = None
        while True:
            try:
                outcome = await self._prefill_once(prefill_request, ctx, pool)
            except NoInstanceAvailable:
                if refusal is None:
                    raise
                return _ending(refusal.output)  # every prefill worker left refused it
            if isinstance(outcome, Prefilled):
                return outcome
            if outcome.handle is not None:
                self._release(pool, outcome.handle)
            if isinstance(outcome, PrefillRefused):
                worker = outcome.worker
                if (
                    worker is None
                    or worker in refused
                    or len(refused) >= MAX_PREFILL_REFUSALS
                    or ctx.is_cancelled
                ):
                    return _ending(outcome.output)
                refused.add(worker)
                refusal = outcome
                self._count_retry("prefill_overloaded")
                log.warning(
                    "request %s: prefill worker %x answered overloaded; prefilling elsewhere",
                    ctx.request_id,
                    worker,
                )
                continue
            attempts += 1
            if outcome.worker is not None:
                pool.client.report_instance_down(outcome.worker)
            self._count_retry("prefill_worker_failed")
            if attempts >= MAX_PREFILL_ATTEMPTS or ctx.is_cancelled:
                raise StreamBroken(f"prefill failed {attempts} times; last: {outcome.reason}")
            log.warning(
                "request %s: prefill worker %s failed (%s); prefilling elsewhere",
                ctx.request_id,
                f"{outcome.worker:x}" if outcome.worker is not None else "?",
                outcome.reason,
            )

    async def _prefill_once(
        self, prefill_request: PreprocessedRequest, ctx: RequestContext, pool: PrefillPool
    ) -> Prefilled | PrefillFailed | PrefillRefused:
        start = self._clock()
        tokens: list[int] = []
        log_probs: list[float] = []
        top_logprobs: list[list[tuple[int, float]]] = []
        handle: KvHandle | None = None
        cached: int | None = None
        final: LLMEngineOutput | None = None
        broken: str | None = None
        stream = pool.generate(prefill_request, ctx)
        try:
            async for output in stream:
                tokens.extend(output.token_ids)
                if output.log_probs:
                    log_probs.extend(output.log_probs)
                if output.top_logprobs:
                    top_logprobs.extend(output.top_logprobs)
                if output.kv_handle is not None:
                    handle = output.kv_handle
                if output.usage is not None and output.usage.cached_tokens is not None:
                    cached = output.usage.cached_tokens
                if output.finish_reason is not None:
                    final = output
                    break
        except StreamBroken as exc:
            broken = str(exc)
        except asyncio.CancelledError:
            # Migration's watchdog cancels a stalled attempt: here the prefill worker is the
            # one that stalled, set aside on its own client (the decode side never saw it).
            stalled = ctx.metadata.get("worker_instance_id")
            if ctx.metadata.get(STALLED_METADATA) and isinstance(stalled, int):
                pool.client.report_instance_down(stalled)
            raise
        finally:
            try:
                await stream.aclose()  # type: ignore[attr-defined]
            finally:
                # The prefill worker's id is never left for the layers above, which take
                # ``worker_instance_id`` for the decode worker's.
                worker = ctx.metadata.pop("worker_instance_id", None)
                routing = ctx.metadata.pop("routing", None)
        worker = worker if isinstance(worker, int) else None
        if (
            broken is None
            and final is not None
            and final.finish_reason is _ERROR
            and final.error_kind == _ENGINE_FAILED
        ):
            broken = final.error or "engine failed"
        if broken is not None:
            return PrefillFailed(broken, worker, handle)
        if final is not None and final.finish_reason is _ERROR and final.error_kind == _OVERLOADED:
            return PrefillRefused(final, worker, handle)
        seconds = self._clock() - start
        self._observe(Stage.PREFILL, seconds)
        ending: LLMEngineOutput | None
        if final is None:
            ending = LLMEngineOutput(
                finish_reason=_ERROR,
                error="prefill worker ended its stream without a finish reason",
            )
        elif final.finish_reason is _ERROR or not tokens:
            ending = final
        elif final.finish_reason is FinishReason.LENGTH:
            ending = None  # ended by our max_tokens 1: decoding goes on
        else:  # the first token ended the request (EOS, a stop token)
            ending = msgspec.structs.replace(final, token_ids=tokens)
        return Prefilled(
            tokens=tokens,
            log_probs=log_probs,
            top_logprobs=top_logprobs,
            handle=handle,
            ending=ending,
            cached_tokens=cached,
            record={
                "worker_id": f"{worker:x}" if worker is not None else None,
                "seconds": seconds,
                "routing": routing,
            },
        )

    # -- the decode stage ---------------------------------------------------------------------

    @staticmethod
    async def _start_decode(
        stream: AsyncIterator[LLMEngineOutput],
    ) -> DecodeStarted | KvTransferFailed:
        """Read the decode attempt's first output: a KV transfer failure, or the start."""
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return DecodeStarted(None)
        if first.finish_reason is _ERROR and first.error_kind == _KV_FAILED:
            return KvTransferFailed(first.error or "KV transfer failed")
        return DecodeStarted(first)

    async def _decoded(
        self,
        stream: AsyncIterator[LLMEngineOutput],
        started: DecodeStarted,
        ctx: RequestContext,
        prefilled: Prefilled,
        disagg: DisaggParams | None,
        start: float,
    ) -> AsyncIterator[LLMEngineOutput]:
        """The decode worker's outputs from ``started.first`` on, with the client's cached
        tokens those of the prefill (where the prompt was computed)."""
        if started.first is None:
            return
        handle = disagg.handle if disagg is not None else None
        cached = prefilled.cached_tokens
        waiting = True
        output = started.first
        while True:
            if waiting and (output.token_ids or output.finish_reason is not None):
                waiting = False
                self._on_decode_started(ctx, prefilled, handle, output, start)
            if output.usage is not None and cached is not None:
                usage = msgspec.structs.replace(output.usage, cached_tokens=cached)
                output = msgspec.structs.replace(output, usage=usage)
            yield output
            try:
                output = await anext(stream)
            except StopAsyncIteration:
                return

    def _on_decode_started(
        self,
        ctx: RequestContext,
        prefilled: Prefilled,
        handle: KvHandle | None,
        output: LLMEngineOutput,
        start: float,
    ) -> None:
        seconds = self._clock() - start
        self._observe(Stage.DECODE, seconds)
        transfer: dict[str, Any] | None = None
        if handle is not None:
            if self._observer is not None:
                self._observer.transferred(handle.num_bytes)
            waited = (output.extra or {}).get("kv_transfer_s")
            transfer = {
                "mode": handle.mode.value,
                "bytes": handle.num_bytes,
                "tokens": handle.num_tokens,
                "from_worker_id": f"{handle.instance_id:x}",
                "seconds": waited if isinstance(waited, (int, float)) else None,
            }
        ctx.metadata["routing"] = {
            "disaggregated": True,
            "prefill": prefilled.record,
            "decode": {"seconds_to_first_token": seconds, "routing": ctx.metadata.get("routing")},
            "kv_transfer": transfer,
        }

    # -- bookkeeping --------------------------------------------------------------------------

    def _release(self, pool: PrefillPool, handle: KvHandle) -> None:
        """Free an unclaimed handle's blocks on its prefill worker (best effort, bounded)."""
        if len(self._releases) >= MAX_PENDING_RELEASES:
            return  # its TTL frees it
        task = asyncio.get_running_loop().create_task(_release(pool, handle))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def _observe(self, stage: Stage, seconds: float) -> None:
        if self._observer is not None and math.isfinite(seconds):
            self._observer.stage(stage, seconds)

    def _count_local(self, reason: LocalReason) -> None:
        if self._observer is not None:
            self._observer.local(reason)

    def _count_retry(self, reason: str) -> None:
        if self._observer is not None:
            self._observer.retry(reason)


def _ending(output: LLMEngineOutput) -> Prefilled:
    """A prefill stage that ends the request with ``output`` (no token, no handle)."""
    return Prefilled(
        tokens=[],
        log_probs=[],
        top_logprobs=[],
        handle=None,
        ending=output,
        cached_tokens=None,
        record={},
    )


async def _release(pool: PrefillPool, handle: KvHandle) -> None:
    payload = _encode(KvTransferRequest(op=KvTransferOp.RELEASE, handle_id=handle.handle_id))
    ctx = RequestContext()
    try:
        async with asyncio.timeout(RELEASE_TIMEOUT_S):
            async for _ in pool.client.call(handle.instance_id, KV_TRANSFER_HANDLER, payload, ctx):
                pass
    except Exception as exc:  # the handle's TTL frees it anyway
        log.debug("release of KV handle %s failed: %s", handle.handle_id, exc)


__all__ = [
    "MAX_KV_RETRIES",
    "DecodeStarted",
    "DisaggObserver",
    "KvTransferFailed",
    "PrefillFailed",
    "PrefillRefused",
    "PrefillRouter",
    "Prefilled",
    "Stage",
]
