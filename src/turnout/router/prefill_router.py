"""Disaggregated serving's first stage: send the prompt to a prefill worker, then the rest of
the request to a decode worker that takes the prompt's KV instead of computing it.

Dynamo's ``PrefillRouter`` re-designed for turnout's pipeline, where it sits between
migration and the decode router::

    migration -> prefill router -> (session affinity) -> router -> decode worker
                      |
                      +-> prefill pool's router -> prefill worker

Each model has a ``PrefillSlot``; the frontend's model watcher *activates* it with a
``PrefillPool`` when the model's first prefill instance appears and deactivates it with the
last. While it is inactive the prefill router is not in the way at all (``generate`` hands the
request straight to the decode router, no extra stage per token), except for a model whose
workers run as ``decode`` with ``--no-decode-fallback``: its requests wait for a prefill worker,
bounded, then fail with a 503 that names the missing role.

While active, per request:

1. Choose the decode worker first (KV router: by its load and its own cached prefix of the
   prompt, booked), so that a push-mode prefill worker knows where to send the KV, and so
   that a prompt the decode worker mostly holds already can skip the prefill stage.
2. *Conditional disaggregation*: the request runs whole on the decode worker when its prompt
   tokens not cached there are fewer than ``min_tokens`` (short prompts, or later turns of a
   conversation whose context the decode worker holds), when it asks for one token only,
   names a LoRA adapter (prefill workers serve base models), is pinned to an instance, or
   when the prefill workers' card differs from the model's (a handle would not fit).
3. Prefill stage: the prompt goes to a prefill worker (KV overlap and load among prefill
   workers) with ``max_tokens`` 1. Its first token goes to the client at once; its answer
   carries a ``KvHandle``. A prefill worker that dies mid-prefill is set aside and the
   prefill re-run on another.
4. Decode stage: prompt + first token, with the handle, to the chosen decode worker. A decode
   worker that cannot get the KV (prefill worker gone mid-transfer, handle expired) answers
   ``KV_TRANSFER_FAILED`` before any token; the prefill is re-run (at most
   ``MAX_KV_RETRIES`` times, then the decode worker computes the prompt itself). A decode
   worker that dies later is migration's business, as for any request: the continuation
   comes back through here and may be prefilled again.

A handle the decode side never took (client gone, first token ended the request, decode
worker died before the pull) is released on the prefill worker at once rather than left to
its TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
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
from turnout.protocols.llm import (
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
)
from turnout.protocols.model import EndpointId, WorkerRole
from turnout.router.kv.push import KvPushRouter
from turnout.router.kv.router import KvRouter
from turnout.router.kv.selector import Selection
from turnout.runtime.context import DEADLINE_METADATA, RequestContext

log = logging.getLogger(__name__)

EngineFn = Callable[[PreprocessedRequest, RequestContext], AsyncIterator[LLMEngineOutput]]

#: How long a request of a decode-only model waits for a prefill worker with
#: ``--no-decode-fallback`` (its own deadline, when sooner, ends the wait first).
PREFILL_WAIT_S = 30.0
#: Prefill re-runs after decode workers failed to get the KV; then the decode worker
#: computes the prompt itself.
MAX_KV_RETRIES = 2
#: Prefill re-runs after prefill workers died mid-prefill; then the request fails.
MAX_PREFILL_ATTEMPTS = 3
#: Releases of unclaimed handles in flight at once (more are left to the handles' TTL).
MAX_PENDING_RELEASES = 256
RELEASE_TIMEOUT_S = 5.0

_ERROR = FinishReason.ERROR
_KV_FAILED = ErrorKind.KV_TRANSFER_FAILED.value
_ENGINE_FAILED = ErrorKind.ENGINE_FAILED.value
_encode = msgspec.msgpack.Encoder().encode


class LocalReason(enum.StrEnum):
    """Why an active prefill router let a request run whole on its decode worker."""

    SHORT = "short_prompt"
    CACHED = "cached_on_decode"
    ONE_TOKEN = "max_tokens_1"
    LORA = "lora"
    PINNED = "pinned"
    #: A structured output: its grammar must see every token it constrains on one engine (a
    #: decode worker would start it afresh after the prefill worker's first token).
    STRUCTURED = "structured_output"
    CARD_MISMATCH = "card_mismatch"
    NO_PREFILL_WORKER = "no_prefill_worker"
    NO_HANDLE = "no_handle"
    KV_RETRIES_EXHAUSTED = "kv_retries_exhausted"


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


@dataclass(slots=True, eq=False)
class PrefillPool:
    """The prefill side of one model while it has prefill instances."""

    endpoint: EndpointId
    #: The prefill endpoint's client (live instances, side-handler calls).
    client: Any
    #: Routes a prefill-stage request to a prefill worker and streams its answer.
    generate: EngineFn
    #: ``card.checksum()`` of the prefill instances: must match the model's.
    checksum: str
    #: The KV router of the prefill endpoint (KV mode), closed on deactivation.
    kv_router: KvRouter | None = None

    async def close(self) -> None:
        if self.kv_router is not None:
            await self.kv_router.close()


class PrefillSlot:
    """One model's prefill side: a ``PrefillPool`` while prefill instances exist, else None.
    Pipelines hold the slot; the model watcher activates and deactivates it."""

    __slots__ = ("_changed", "name", "pool")

    def __init__(self, name: str) -> None:
        self.name = name
        self.pool: PrefillPool | None = None
        self._changed = asyncio.Event()

    def activate(self, pool: PrefillPool) -> None:
        self.pool = pool
        self._changed.set()
        self._changed = asyncio.Event()

    def deactivate(self) -> PrefillPool | None:
        pool, self.pool = self.pool, None
        return pool

    async def wait_active(self, timeout: float) -> PrefillPool | None:
        """The pool, waiting up to ``timeout`` seconds for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.pool is None:
            left = deadline - loop.time()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return self.pool


class PrefillSlots:
    """Every model's slot, by model name (fed by discovery, one per model)."""

    def __init__(self) -> None:
        self._slots: dict[str, PrefillSlot] = {}

    def slot(self, name: str) -> PrefillSlot:
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = PrefillSlot(name)
        return slot

    def active(self, name: str) -> PrefillPool | None:
        slot = self._slots.get(name)
        return slot.pool if slot is not None else None

    def deactivate_all(self) -> list[PrefillPool]:
        """Deactivate every slot (shutdown); the pools, for the caller to close."""
        pools = [slot.deactivate() for slot in self._slots.values()]
        return [pool for pool in pools if pool is not None]


@dataclass(slots=True)
class _Prefilled:
    """What the prefill stage gave: the first token(s), the handle, or a final output."""

    tokens: list[int] = field(default_factory=list)
    #: The first token's log probability, when the request asked for them.
    log_probs: list[float] = field(default_factory=list)
    #: Its alternatives, when the request asked for some.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    handle: KvHandle | None = None
    #: The output that ends the request here (an error, or a first token that stops it).
    final: LLMEngineOutput | None = None
    cached_tokens: int | None = None
    record: dict[str, Any] = field(default_factory=dict)


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
        self._checksum = checksum
        self._role = role
        self._decode_endpoint = decode_endpoint
        self._block_size = block_size
        self._min_tokens = min_tokens
        self._fallback = fallback
        self._decode_kv = decode_kv
        self._observer = observer
        self._clock = clock
        self._wait_s = wait_s
        self._releases: set[asyncio.Task[None]] = set()
        self._warned_mismatch = False

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

    # -- the two stages ---------------------------------------------------------------------

    async def _disaggregated(
        self, request: PreprocessedRequest, ctx: RequestContext, pool: PrefillPool | None
    ) -> AsyncIterator[LLMEngineOutput]:
        if pool is None:
            wait = self._wait_s
            deadline = ctx.metadata.get(DEADLINE_METADATA)
            if isinstance(deadline, float):
                # Give up a little before the request's deadline: a 503 that names the
                # missing role says more than a timeout.
                left = deadline - asyncio.get_running_loop().time()
                wait = max(0.0, min(wait, left * 0.9))
            pool = await self.slot.wait_active(wait)
            if pool is None:
                raise NoInstanceAvailable(
                    f"model {self.slot.name!r} has decode workers but no prefill worker "
                    f"(role prefill) after {wait:g}s, and --no-decode-fallback is set"
                )
        selection: Selection | None = None
        handle: KvHandle | None = None
        claimed = False
        try:
            reason = self._local_reason(request, pool)
            overlap = 0
            if reason is None and self._decode_kv is not None:
                selection = self._decode_kv.select(request, ctx)
                overlap = selection.overlap_blocks * self._block_size
            if reason is None and len(request.token_ids) - overlap < self._min_tokens:
                short = len(request.token_ids) < self._min_tokens
                reason = LocalReason.SHORT if short else LocalReason.CACHED
            if reason is not None:
                stream, selection = self._send_decode(request, ctx, selection), None
                async for output in self._local(stream, ctx, reason):
                    yield output
                return

            push_to = selection.worker_id if selection is not None else None
            prefilled = await self._prefill(request, ctx, pool, push_to)
            handle = prefilled.handle
            if prefilled.final is not None:
                yield prefilled.final
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
                failed = None
                async for output in self._decode_stage(stream, ctx, prefilled, handle):
                    if isinstance(output, str):
                        failed = output
                        break
                    claimed = True
                    yield output
                if failed is None:
                    return
                # The decode worker could not get the KV: prefill again (another handle).
                retries += 1
                self._count_retry("kv_transfer")
                log.warning(
                    "request %s: decode worker could not get the KV (%s); %s",
                    ctx.request_id,
                    failed,
                    "prefilling again" if retries <= MAX_KV_RETRIES else "computing it there",
                )
                handle = None
                pool = self.slot.pool
                if retries > MAX_KV_RETRIES or pool is None:
                    self._count_local(LocalReason.KV_RETRIES_EXHAUSTED)
                    continue
                if self._decode_kv is not None:
                    selection = self._decode_kv.select(decode_request, ctx)
                push_to = selection.worker_id if selection is not None else None
                again = await self._prefill(request, ctx, pool, push_to)
                if again.final is not None and again.final.finish_reason is _ERROR:
                    yield again.final
                    return
                # Its first token is dropped (the client has one already); its worker and
                # handle are the ones the decode stage now uses.
                handle = again.handle
                prefilled.record = again.record
                prefilled.cached_tokens = again.cached_tokens
        finally:
            if selection is not None and self._decode_kv is not None:
                self._decode_kv.router.on_finished(ctx.request_id)
            if handle is not None and not claimed:
                self._release(pool, handle)

    def _local_reason(self, request: PreprocessedRequest, pool: PrefillPool) -> LocalReason | None:
        if request.stop_conditions.max_tokens == 1:
            return LocalReason.ONE_TOKEN
        if request.lora_name:
            return LocalReason.LORA
        if request.backend_instance_id is not None:
            return LocalReason.PINNED
        if request.structured is not None:
            return LocalReason.STRUCTURED
        if pool.checksum != self._checksum:
            if not self._warned_mismatch:
                self._warned_mismatch = True
                log.warning(
                    "model %s: its prefill workers publish card checksum %s, its decode workers "
                    "%s (tokenizer, template or block size differ): requests run on the "
                    "decode workers alone",
                    self.slot.name,
                    pool.checksum,
                    self._checksum,
                )
            return LocalReason.CARD_MISMATCH
        return None

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

    async def _prefill(
        self,
        request: PreprocessedRequest,
        ctx: RequestContext,
        pool: PrefillPool,
        push_to: int | None,
    ) -> _Prefilled:
        """Run the prompt on a prefill worker; re-run it elsewhere if that worker dies."""
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
        attempts = 0
        while True:
            attempts += 1
            start = self._clock()
            result = _Prefilled()
            stream = pool.generate(prefill_request, ctx)
            try:
                async for output in stream:
                    result.tokens.extend(output.token_ids)
                    if output.log_probs:
                        result.log_probs.extend(output.log_probs)
                    if output.top_logprobs:
                        result.top_logprobs.extend(output.top_logprobs)
                    if output.kv_handle is not None:
                        result.handle = output.kv_handle
                    if output.usage is not None and output.usage.cached_tokens is not None:
                        result.cached_tokens = output.usage.cached_tokens
                    if output.finish_reason is not None:
                        result.final = output
                        break
            except StreamBroken as exc:
                broken: str | None = str(exc)
            else:
                broken = None
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
            worker = ctx.metadata.pop("worker_instance_id", None)
            routing = ctx.metadata.pop("routing", None)
            final = result.final
            if (
                broken is None
                and final is not None
                and final.finish_reason is _ERROR
                and final.error_kind == _ENGINE_FAILED
            ):
                broken = final.error or "engine failed"
            if broken is not None:
                if isinstance(worker, int):
                    report_down = getattr(pool.client, "report_instance_down", None)
                    if report_down is not None:
                        report_down(worker)
                self._count_retry("prefill_worker_failed")
                if result.handle is not None:
                    self._release(pool, result.handle)
                if attempts >= MAX_PREFILL_ATTEMPTS or ctx.is_cancelled:
                    raise StreamBroken(f"prefill failed {attempts} times; last: {broken}")
                log.warning(
                    "request %s: prefill worker %s failed (%s); prefilling elsewhere",
                    ctx.request_id,
                    f"{worker:x}" if isinstance(worker, int) else "?",
                    broken,
                )
                continue
            seconds = self._clock() - start
            self._observe(Stage.PREFILL, seconds)
            result.record = {
                "worker_id": f"{worker:x}" if isinstance(worker, int) else None,
                "seconds": seconds,
                "routing": routing,
            }
            if final is None:
                result.final = LLMEngineOutput(
                    finish_reason=_ERROR,
                    error="prefill worker ended its stream without a finish reason",
                )
            elif final.finish_reason is not _ERROR and result.tokens:
                if final.finish_reason is FinishReason.LENGTH:
                    result.final = None  # ended by our max_tokens 1: decoding goes on
                else:  # the first token ended the request (EOS, a stop token)
                    result.final = msgspec.structs.replace(final, token_ids=result.tokens)
            return result

    async def _decode_stage(
        self,
        stream: AsyncIterator[LLMEngineOutput],
        ctx: RequestContext,
        prefilled: _Prefilled,
        handle: KvHandle | None,
    ) -> AsyncIterator[LLMEngineOutput | str]:
        """The decode worker's outputs; a ``str`` (the reason) when it could not get the KV."""
        start = self._clock()
        first = True
        cached = prefilled.cached_tokens
        try:
            async for output in stream:
                if first:
                    if output.finish_reason is _ERROR and output.error_kind == _KV_FAILED:
                        yield output.error or "KV transfer failed"
                        return
                    if output.token_ids or output.finish_reason is not None:
                        first = False
                        self._on_decode_started(ctx, prefilled, handle, output, start)
                if output.usage is not None and cached is not None:
                    # The client's cached tokens are the prompt's hits where it was computed.
                    usage = msgspec.structs.replace(output.usage, cached_tokens=cached)
                    output = msgspec.structs.replace(output, usage=usage)
                yield output
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def _on_decode_started(
        self,
        ctx: RequestContext,
        prefilled: _Prefilled,
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

    # -- bookkeeping ------------------------------------------------------------------------

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
    "DisaggObserver",
    "LocalReason",
    "PrefillPool",
    "PrefillRouter",
    "PrefillSlot",
    "PrefillSlots",
    "Stage",
]
