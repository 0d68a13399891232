"""Dispatch with KV-aware routing: route, pin the request to the chosen worker, stream, and
keep the router's books (first token, end of stream, what the worker said it had cached).

A worker that cannot be reached is set aside and the request re-routed among the others,
like the plain push router; a stream that breaks mid-way propagates to migration, which
re-issues the request through here (re-routed, re-booked under the same request id).

A pinned request (a session's binding, a client's ``backend_instance_id``) skips the decision
but is booked on its worker all the same, so the router's view of the load counts it.
Instances a request must avoid (``AVOID_METADATA``: it failed or was refused there before its
first token) are never chosen for it.

The per-request work is the decision alone: the prompt is hashed once per request (shared
through the context with the other stages that route it, ``seq_hashes_of``), and the routing
explanation (every candidate's cost terms) is built only for a client that asked for it
(``EXPLAIN_ROUTING_METADATA``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec

from turnout.errors import NoInstanceAvailable, PeerUnavailable, WorkerProtocolError
from turnout.protocols.kv import SequenceHash
from turnout.protocols.llm import LLMEngineOutput, PreprocessedRequest
from turnout.router.kv.router import KvRouter
from turnout.router.kv.selector import Selection, SelectionStatus
from turnout.runtime import tracing
from turnout.runtime.context import (
    AVOID_METADATA,
    EXPLAIN_ROUTING_METADATA,
    SEQ_HASHES_METADATA,
    RequestContext,
)

log = logging.getLogger("turnout.router.kv")

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(LLMEngineOutput).decode
_to_builtins = msgspec.to_builtins


def explain(selection: Selection, block_size: int) -> dict[str, object]:
    """The routing decision as the client sees it (``nvext.extra_fields: ["routing"]``)."""
    out = _to_builtins(selection)
    out["block_size"] = block_size
    if selection.worker_id is not None:
        out["worker_id"] = f"{selection.worker_id:x}"
    if selection.preferred_worker_id is not None:
        out["preferred_worker_id"] = f"{selection.preferred_worker_id:x}"
    for candidate in out.get("candidates", []):
        candidate["worker_id"] = f"{candidate['worker_id']:x}"
    out["busy"] = [f"{w[0]:x}" for w in out.get("busy", [])]
    return out


def route_attributes(selection: Selection) -> dict[str, Any]:
    """A KV routing decision as span attributes: the choice and, per candidate, its overlap,
    load and predicted TTFT (arrays in one order)."""
    candidates = selection.candidates
    out: dict[str, Any] = {
        "turnout.route.status": selection.status.value,
        "turnout.route.overlap_blocks": selection.overlap_blocks,
        "turnout.route.new_blocks": selection.new_blocks,
        "turnout.route.candidates.instance": [f"{c.worker_id:x}" for c in candidates],
        "turnout.route.candidates.overlap_blocks": [c.overlap_blocks for c in candidates],
        "turnout.route.candidates.active_blocks": [
            c.active_prefill_blocks + c.active_decode_blocks for c in candidates
        ],
        "turnout.route.candidates.cost": [c.cost for c in candidates],
    }
    if all(c.predicted_ttft_s is not None for c in candidates) and candidates:
        out["turnout.route.candidates.predicted_ttft_s"] = [c.predicted_ttft_s for c in candidates]
    if selection.worker_id is not None:
        out["turnout.instance"] = f"{selection.worker_id:x}"
    if selection.predicted_ttft_s is not None:
        out["turnout.route.predicted_ttft_s"] = selection.predicted_ttft_s
    return out


class HashedPrompt:
    """A prompt's sequence hashes and what they were computed from: the very token list (by
    identity: the stages pass one request's ``token_ids`` along unchanged; a continued or
    migrated prompt is another list) and the partition (block size, adapter, salt)."""

    __slots__ = ("block_size", "cache_salt", "lora_name", "seq_hashes", "token_ids")

    def __init__(
        self,
        token_ids: Sequence[int],
        block_size: int,
        lora_name: str | None,
        cache_salt: str | None,
        seq_hashes: list[SequenceHash],
    ) -> None:
        self.token_ids = token_ids
        self.block_size = block_size
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.seq_hashes = seq_hashes


def seq_hashes_of(
    router: KvRouter, request: PreprocessedRequest, ctx: RequestContext
) -> list[SequenceHash]:
    """The request's sequence hashes under ``router``'s block size, computed once per
    request: kept in ``ctx.metadata[SEQ_HASHES_METADATA]`` for the next stage that routes the
    same prompt (the decode side after the prefill pool's router, a re-route)."""
    tokens, block_size = request.token_ids, router.config.block_size
    lora, salt = request.lora_name, request.cache_salt
    kept = ctx.metadata.get(SEQ_HASHES_METADATA)
    if (
        isinstance(kept, HashedPrompt)
        and kept.token_ids is tokens
        and kept.block_size == block_size
        and kept.lora_name == lora
        and kept.cache_salt == salt
    ):
        return kept.seq_hashes
    hashes = router.core.seq_hashes(tokens, lora_name=lora, cache_salt=salt)
    ctx.metadata[SEQ_HASHES_METADATA] = HashedPrompt(tokens, block_size, lora, salt, hashes)
    return hashes


class KvPushRouter:
    def __init__(
        self,
        router: KvRouter,
        *,
        max_attempts: int = 3,
        allow: Callable[[str, Sequence[int]], list[int]] | None = None,
    ) -> None:
        """``allow(adapter, live_ids)``: the workers a LoRA adapter's request may go to
        (``router.lora.LoraRegistry.allowed``); None: LoRA serving off."""
        self.router = router
        self._max_attempts = max_attempts
        self._allow = allow

    def select(
        self, request: PreprocessedRequest, ctx: RequestContext, excluded: Sequence[int] = ()
    ) -> Selection:
        """Choose (and book) the worker for ``request`` without sending it: the caller passes
        the result to ``generate`` (the prefill router decides with it whether the prompt
        needs a prefill stage, and where a prefill worker pushes its KV). A booked selection
        that is never passed on must be released with ``router.on_finished(request_id)``.
        Raises ``NoInstanceAvailable`` when no worker may take it."""
        router = self.router
        avoid = ctx.metadata.get(AVOID_METADATA)
        if avoid:
            excluded = [*excluded, *avoid]
        allowed = None
        if self._allow is not None and request.lora_name:
            live = [i for i in router.client.instance_ids() if i not in excluded]
            allowed = self._allow(request.lora_name, live)
            if not allowed:
                raise NoInstanceAvailable(
                    f"no live instance holds or can load LoRA adapter {request.lora_name!r}"
                )
        span = None if ctx.trace is None else tracing.start_span(ctx, "route")
        asked = bool(ctx.metadata.get(EXPLAIN_ROUTING_METADATA))
        sampled = router.decisions.wants_sample()
        selection = router.route(
            ctx.request_id,
            request.token_ids,
            lora_name=request.lora_name,
            cache_salt=request.cache_salt,
            session_id=request.session_id,
            excluded=excluded,
            allowed=allowed,
            explain=asked or sampled,
            seq_hashes=seq_hashes_of(router, request, ctx),
        )
        if sampled:
            router.decisions.record(
                {
                    "time": time.time(),
                    "request_id": ctx.request_id,
                    "prompt_tokens": len(request.token_ids),
                    **explain(selection, router.config.block_size),
                }
            )
        if span is not None:
            span.set_attribute("turnout.router.mode", "kv")
            span.set_attributes(route_attributes(selection))
        if not selection.ok or selection.worker_id is None:
            error = NoInstanceAvailable(_why(selection, router.endpoint.path()))
            tracing.end_span(span, error)
            raise error
        tracing.end_span(span)
        return selection

    async def generate(
        self,
        request: PreprocessedRequest,
        ctx: RequestContext,
        selection: Selection | None = None,
    ) -> AsyncIterator[LLMEngineOutput]:
        """Route (or take ``selection``, booked by ``select``), send, stream, keep the books."""
        router = self.router
        client = router.client
        request_id = ctx.request_id
        excluded: list[int] = []
        while True:
            if request.backend_instance_id is not None and selection is None:
                target, pinned, pins = request.backend_instance_id, request, True
                rank = (request.extra_args or {}).get("dp_rank")
                # Never book an id the client made up (it would only be refused below).
                booked = target in client.instance_ids()
                if booked:
                    router.book(
                        request_id,
                        request.token_ids,
                        target,
                        dp_rank=rank if isinstance(rank, int) else 0,
                        lora_name=request.lora_name,
                        cache_salt=request.cache_salt,
                        session_id=request.session_id,
                        seq_hashes=seq_hashes_of(router, request, ctx),
                    )
            else:
                if selection is None:
                    selection = self.select(request, ctx, excluded)
                assert selection.worker_id is not None
                target, dp_rank = selection.worker_id, selection.dp_rank or 0
                if ctx.metadata.get(EXPLAIN_ROUTING_METADATA):
                    ctx.metadata["routing"] = explain(selection, router.config.block_size)
                selection = None
                extra = dict(request.extra_args or {})
                extra["dp_rank"] = dp_rank
                pinned = msgspec.structs.replace(
                    request, backend_instance_id=target, extra_args=extra
                )
                pins, booked = False, True
            ctx.metadata["worker_instance_id"] = target
            stream = client.stream(target, _encode(pinned), ctx)
            first = True
            cached: int | None = None
            try:
                async for raw in stream:
                    try:
                        output = _decode(raw)
                    except msgspec.DecodeError as exc:  # ValidationError included
                        raise WorkerProtocolError(
                            f"worker {target:x} of {router.endpoint.path()} sent an output "
                            f"that does not decode: {exc}"
                        ) from exc
                    if first and output.token_ids:
                        first = False
                        if booked:
                            router.on_first_token(request_id)
                    if output.usage is not None and output.usage.cached_tokens is not None:
                        cached = output.usage.cached_tokens
                    yield output
                return
            except PeerUnavailable as exc:
                excluded.append(target)
                log.warning(
                    "request %s: worker %x unreachable (%s); re-routing", request_id, target, exc
                )
                if pins or len(excluded) >= self._max_attempts:
                    raise NoInstanceAvailable(
                        f"worker {target:x} of {router.endpoint.path()} is unreachable: {exc}"
                    ) from exc
            finally:
                try:
                    await stream.aclose()  # type: ignore[attr-defined]
                finally:
                    if booked:
                        router.on_finished(
                            request_id, prompt_tokens=len(request.token_ids), cached_tokens=cached
                        )


def _why(selection: Selection, endpoint: str) -> str:
    if selection.status is SelectionStatus.ALL_BUSY:
        return f"every worker of {endpoint} is busy ({len(selection.busy)} over threshold)"
    return f"no live instance of {endpoint}"
