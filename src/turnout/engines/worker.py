"""A worker: one engine behind a ``generate`` endpoint, registered in discovery.

The worker publishes, under the instance's lease, its ``Instance`` record (written by the
runtime) and its model deployment card at ``v1/mdc/{endpoint}/{instance_id:x}``, so the
frontend's model watcher sees the model appear and, when the lease ends, disappear.

Engines that take part in disaggregated serving (``serve_kv_transfer``) also serve the
``kv_transfer`` side handler, and get a ``RequestPlaneKvTransport`` to reach other workers.

The card names its artifacts (the tokenizer) by content only; the worker serves their bytes
through the ``artifact`` side handler, in chunks, to any frontend that asks by sha256.

Embedding and tensor engines (``UnaryEngine``) answer each request with one reply: the worker
decodes the request as the engine's ``request_type`` and sends its reply, or an error reply
(a refusal, a failure, a request that does not decode).

Requests are decoded strictly (their structs forbid unknown fields): a request carrying a
field this worker does not know, from a newer frontend, is answered with a ``bad_request``
error naming the field, never served as if the field were absent. Side-handler requests
(artifacts, KV snapshots) that do not decode end their stream with an error frame.

Engine failure: when the engine reports that it broke (``Engine.report_failure``) or its
``health()`` probe, run every ``health_interval`` seconds, returns a reason, the worker
(1) ends every in-flight stream with an ``ERROR`` output of kind ``engine_failed`` (the
frontend migrates those requests), (2) revokes the instance's lease at once (frontends stop
routing to it) and (3) sets ``failed``; ``turnout worker`` then exits non-zero, so a
supervisor (``turnout serve``, systemd, Kubernetes) restarts it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import msgspec

from turnout.engines.base import Engine, EngineBase, UnaryEngine, UnaryFailure
from turnout.engines.events import EventPlaneSink
from turnout.engines.kv_transfer import RequestPlaneKvTransport
from turnout.engines.lora_cards import LoraCardPublisher
from turnout.errors import ConfigError
from turnout.llm.artifacts import LOCAL_ARTIFACTS, ArtifactError, ArtifactRegistry, iter_chunks
from turnout.llm.parsers import check_parser_names
from turnout.protocols.disagg import KV_TRANSFER_HANDLER, KvTransferReply, KvTransferRequest
from turnout.protocols.kv import KV_SNAPSHOT_HANDLER, KvSnapshot, KvSnapshotRequest
from turnout.protocols.llm import ErrorKind, FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import (
    ARTIFACT_HANDLER,
    DEVICE_CPU,
    DEVICE_GPU,
    ArtifactRef,
    ArtifactRequest,
    EndpointId,
    ModelDeploymentCard,
    mdc_key,
)
from turnout.runtime import tracing
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.event_plane import EventPublisher
from turnout.runtime.log_context import INSTANCE_METADATA, MODEL_METADATA
from turnout.runtime.redact import log_prompt
from turnout.runtime.request_plane.base import Handler
from turnout.runtime.serving import ServingInstance

log = logging.getLogger("turnout.worker")

_request_decoder = msgspec.msgpack.Decoder(PreprocessedRequest)
_encode = msgspec.msgpack.Encoder().encode
_json = msgspec.json.Encoder()
_snapshot_request_decoder = msgspec.msgpack.Decoder(KvSnapshotRequest)
_artifact_request_decoder = msgspec.msgpack.Decoder(ArtifactRequest)
_kv_transfer_decoder = msgspec.msgpack.Decoder(KvTransferRequest)

#: Seconds between two ``Engine.health()`` probes.
HEALTH_INTERVAL_SECONDS = 5.0
#: How long in-flight streams get to deliver their final output after an engine failure.
FAILURE_DRAIN_SECONDS = 1.0


class Worker:
    def __init__(
        self,
        runtime: DistributedRuntime,
        engine: EngineBase,
        endpoint: EndpointId,
        *,
        model_name: str | None = None,
        migration_limit: int | None = None,
        artifacts: ArtifactRegistry = LOCAL_ARTIFACTS,
        health_interval: float = HEALTH_INTERVAL_SECONDS,
        device_type: str | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        """``tool_call_parser`` / ``reasoning_parser``: how the model writes tool calls and
        reasoning, announced in the card's capabilities for the frontend to parse (None:
        keep the engine's)."""
        if device_type not in (None, DEVICE_CPU, DEVICE_GPU):
            raise ConfigError(f"--device-type must be cpu or gpu, got {device_type!r}")
        try:
            check_parser_names(tool_call_parser, reasoning_parser)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if (tool_call_parser or reasoning_parser) and not isinstance(engine, Engine):
            raise ConfigError(
                "--tool-call-parser and --reasoning-parser read generated text; this engine "
                "generates none"
            )
        self.parsers = {
            name: value
            for name, value in (
                ("tool_call_parser", tool_call_parser),
                ("reasoning_parser", reasoning_parser),
            )
            if value is not None
        }
        #: Overrides the engine's ``runtime_config.device_type`` in the card (None: keep).
        self.device_type = device_type
        self.runtime = runtime
        #: Where the bytes of the card's artifacts are (the process's registry; tests give
        #: each simulated worker its own).
        self.artifacts = artifacts
        self.engine = engine
        self.endpoint = endpoint
        self.model_name = model_name
        self.migration_limit = migration_limit
        self.card: ModelDeploymentCard | None = None
        self.serving: ServingInstance | None = None
        self._publisher: EventPublisher | None = None
        self._health_interval = health_interval
        #: Set once the engine failed (``failure`` says why) and the instance left discovery.
        self.failed = asyncio.Event()
        self.failure: str | None = None
        #: Set with ``failure``, at once (``failed`` waits until the instance has left):
        #: unary requests in flight answer ``engine_failed`` when it is set.
        self._failing = asyncio.Event()
        #: The output buffers of the streams in flight (failed at once if the engine breaks).
        self._buffers: set[_OutputBuffer] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._lora_cards: LoraCardPublisher | None = None
        self._kv_transport: RequestPlaneKvTransport | None = None

    async def start(self) -> ServingInstance:
        set_sink = getattr(self.engine, "set_event_sink", None)
        if set_sink is not None:
            # Engines that publish KV events and load reports get the event plane, on the
            # namespace/component the routers of this endpoint subscribe to.
            publisher = await self.runtime.event_plane.publisher(
                self.endpoint.namespace, self.endpoint.component
            )
            self._publisher = publisher
            set_sink(EventPlaneSink(publisher))
        await self.engine.start()
        template = self.engine.model_card_template()
        overrides: dict[str, object] = {"endpoint": self.endpoint}
        if self.model_name:
            overrides["display_name"] = self.model_name
        if self.migration_limit is not None:
            overrides["migration_limit"] = self.migration_limit
        if self.device_type is not None:
            overrides["runtime_config"] = msgspec.structs.replace(
                template.runtime_config, device_type=self.device_type
            )
        if self.parsers:
            overrides["capabilities"] = msgspec.structs.replace(
                template.capabilities, **self.parsers
            )
        base = msgspec.structs.replace(template, **overrides)
        artifacts = base.artifacts()
        missing = [ref.name for ref in artifacts if ref.sha256 not in self.artifacts]
        if missing:
            # Fail here, not at every frontend: nobody could ever fetch these.
            raise ConfigError(
                f"model {base.display_name!r}: the card names artifacts this process does not "
                f"hold ({', '.join(missing)}); build cards with load_model_card"
            )

        # Engines with LoRA adapters report loads and evictions; each loaded adapter gets a
        # card of its own under the lease (see ``lora_cards``).
        loaded_loras = getattr(self.engine, "loaded_loras", None)
        if loaded_loras is not None and base.lora_adapters:
            self._lora_cards = LoraCardPublisher(self.runtime.store, loaded_loras)
            self.engine.set_lora_listener(self._lora_cards.on_lora)  # type: ignore[attr-defined]

        def records(instance_id: int) -> list[tuple[str, bytes]]:
            self.engine.bind_instance(instance_id)
            self.card = msgspec.structs.replace(base, instance_id=instance_id)
            out = [(mdc_key(self.endpoint, instance_id), _json.encode(self.card))]
            if self._lora_cards is not None:
                out += self._lora_cards.records(self.card)
            return out

        # Side handlers go up before the card is published: a frontend that sees the card
        # can fetch its artifacts at once.
        handlers = {ARTIFACT_HANDLER: artifact_handler(artifacts, self.artifacts)}
        snapshot = getattr(self.engine, "kv_snapshot", None)
        if snapshot is not None:
            handlers[KV_SNAPSHOT_HANDLER] = self._snapshot_handler(snapshot)
        serve_kv_transfer = getattr(self.engine, "serve_kv_transfer", None)
        if serve_kv_transfer is not None:
            self._kv_transport = RequestPlaneKvTransport(self.runtime)
            self.engine.bind_kv_transport(self._kv_transport, self.endpoint)  # type: ignore[attr-defined]
            handlers[KV_TRANSFER_HANDLER] = self._kv_transfer_handler(serve_kv_transfer)
        handle = self._handle if isinstance(self.engine, Engine) else self._unary_handler()
        self.serving = await self.runtime.endpoint(self.endpoint).serve(
            handle, records=records, handlers=handlers
        )
        log.info(
            "worker %x serving model %r at %s",
            self.serving.instance_id,
            base.display_name,
            self.endpoint.path(),
        )
        self.engine.on_failure(self.engine_failed)
        if self._health_interval > 0:
            self._spawn(self._probe_loop())
        return self.serving

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _probe_loop(self) -> None:
        while self.failure is None:
            await asyncio.sleep(self._health_interval)
            self.probe()

    def probe(self) -> str | None:
        """Ask the engine whether it is healthy; act on the answer. Returns the reason it
        is not (None: healthy)."""
        try:
            reason = self.engine.health()
        except Exception as exc:  # a probe that raises is a failed probe
            reason = f"health probe raised {exc!r}"
        if reason is not None:
            self.engine_failed(f"health probe failed: {reason}")
        return reason

    def engine_failed(self, reason: str) -> None:
        """The engine broke: fail the streams in flight as ``engine_failed`` (they migrate),
        leave discovery at once, then set ``failed``. Idempotent."""
        if self.failure is not None:
            return
        self.failure = reason
        self._failing.set()
        instance = self.serving.instance_id if self.serving is not None else 0
        log.error("worker %x: engine failed (%s); leaving discovery", instance, reason)
        final = LLMEngineOutput(
            finish_reason=FinishReason.ERROR,
            error=f"engine failed: {reason}",
            error_kind=ErrorKind.ENGINE_FAILED.value,
        )
        for buffer in list(self._buffers):
            buffer.fail(final)
        self._spawn(self._leave())

    async def _leave(self) -> None:
        try:
            if self.serving is not None:
                await self.serving.stop(FAILURE_DRAIN_SECONDS)
        finally:
            self.failed.set()

    def _unary_handler(self) -> Handler:
        engine = self.engine
        assert isinstance(engine, UnaryEngine)
        decoder = msgspec.msgpack.Decoder(engine.request_type)
        reply_type = engine.reply_type

        async def handle(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
            if self.failure is not None:
                yield _encode(
                    reply_type(
                        error=f"engine failed: {self.failure}",
                        error_kind=ErrorKind.ENGINE_FAILED.value,
                    )
                )
                return
            try:
                request = decoder.decode(payload)
            except msgspec.DecodeError as exc:
                yield _encode(
                    reply_type(error=f"invalid request: {exc}", error_kind=ErrorKind.BAD_REQUEST)
                )
                return
            log_prompt("worker request", ctx.request_id, request)
            yield _encode(await self._run_unary(engine, request, ctx))

        return handle

    async def _run_unary(
        self, engine: UnaryEngine[Any, Any], request: object, ctx: RequestContext
    ) -> object:
        """The engine's reply, or an error reply; ``engine_failed`` as soon as the engine
        breaks, even if its call never returns. Cancelled (client gone): the call is too."""
        task = asyncio.ensure_future(engine.run(request, ctx))
        failing = asyncio.ensure_future(self._failing.wait())
        try:
            await asyncio.wait({task, failing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failing.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait([task])
        if task.cancelled():
            return engine.reply_type(
                error=f"engine failed: {self.failure}", error_kind=ErrorKind.ENGINE_FAILED.value
            )
        exc = task.exception()
        if exc is None:
            return task.result()
        if isinstance(exc, UnaryFailure):
            return engine.reply_type(error=str(exc), error_kind=exc.kind.value)
        # A failure of this request, not of the engine: a 500, not retried elsewhere.
        log.error("request %s: engine raised", ctx.request_id, exc_info=exc)
        return engine.reply_type(error=f"engine raised {type(exc).__name__}: {exc}")

    async def _handle(self, payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        """Run one request on the engine and stream its outputs, merging bursts.

        The engine runs in its own task, filling an ``_OutputBuffer``; this generator sends
        whatever accumulated since it last ran, with consecutive token-only outputs folded
        into one (``merge_outputs``). An engine faster than the frontend (echo, or a burst
        of speculative tokens) thus costs the request plane and the frontend one item per
        burst instead of one per token; an engine slower than the event loop still gets one
        output, so one SSE event, per token. Cancelling this generator cancels the engine.
        """
        try:
            request = _request_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            # Among others: a field this worker does not know (a frontend newer than the
            # worker), which msgspec names ("Object contains unknown field `x`").
            yield _encode(
                LLMEngineOutput(
                    finish_reason=FinishReason.ERROR,
                    error=f"this worker cannot read the request: {exc}",
                    error_kind=ErrorKind.BAD_REQUEST.value,
                )
            )
            return
        card = self.card
        if card is not None:  # for the request's log lines (``runtime.log_context``)
            ctx.metadata[MODEL_METADATA] = card.display_name
            ctx.metadata[INSTANCE_METADATA] = card.instance_id
        log_prompt("worker request", ctx.request_id, request)
        refusal = self._refusal(request)
        if refusal is not None:
            yield _encode(
                LLMEngineOutput(
                    finish_reason=FinishReason.ERROR,
                    error=refusal,
                    error_kind=ErrorKind.BAD_REQUEST.value,
                )
            )
            return
        if self.failure is not None:
            yield _encode(
                LLMEngineOutput(
                    finish_reason=FinishReason.ERROR,
                    error=f"engine failed: {self.failure}",
                    error_kind=ErrorKind.ENGINE_FAILED.value,
                )
            )
            return
        span = None
        if ctx.traceparent and tracing.enabled():
            span = tracing.start_worker_span(
                ctx,
                "generate",
                {
                    "turnout.request_id": ctx.request_id,
                    "turnout.instance": f"{card.instance_id:x}" if card is not None else "",
                    "turnout.prompt_tokens": len(request.token_ids),
                },
            )
        tokens_out = 0
        error: BaseException | None = None
        buffer = _OutputBuffer()
        producer = buffer.producer = asyncio.get_running_loop().create_task(
            buffer.fill(self.engine.generate(request, ctx))  # type: ignore[attr-defined]
        )
        self._buffers.add(buffer)
        try:
            while outputs := await buffer.take():
                for output in merge_outputs(outputs):
                    if span is not None:
                        if not tokens_out and output.token_ids:
                            span.add_event("first_token")
                        tokens_out += len(output.token_ids)
                        if output.finish_reason is not None:
                            span.set_attribute("turnout.finish_reason", str(output.finish_reason))
                    yield _encode(output)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._buffers.discard(buffer)
            if not producer.done():
                producer.cancel()
                await asyncio.wait([producer])
            if span is not None:
                span.set_attribute("turnout.output_tokens", tokens_out)
                span.set_attribute("turnout.cancelled", ctx.is_cancelled)
                cancelled = isinstance(error, GeneratorExit | asyncio.CancelledError)
                tracing.end_span(span, None if cancelled else error)
            log.debug(
                "request %s: %d prompt tokens; stream %s",
                ctx.request_id,
                len(request.token_ids),
                "cancelled" if ctx.is_cancelled else "ended",
            )

    def _refusal(self, request: PreprocessedRequest) -> str | None:
        """Why ``request`` asks for more than this instance's card says its engine does (None:
        it does not). The frontend refuses such requests before they are sent; this catches
        the ones that arrive anyway (a frontend that read another instance's card, a client
        of the request plane), which an engine would otherwise serve ignoring what it cannot
        do: free text for a grammar, no alternatives for ``top_logprobs``, one prefix cache
        shared by every ``cache_salt`` (tenants' among them)."""
        caps = self.card.capabilities if self.card is not None else None
        if caps is None:
            return None
        if not caps.cache_salt and request.cache_salt:
            # The salt is not quoted: a tenant's names its tenant.
            return (
                "this worker cannot honour cache_salt (its engine cannot partition its prefix "
                "cache)"
            )
        structured = request.structured
        if structured is not None and structured.kind not in caps.structured_outputs:
            return (
                f"this worker cannot enforce {structured.kind} output (its engine enforces: "
                f"{', '.join(caps.structured_outputs) or 'none'})"
            )
        logprobs = request.output_options.logprobs
        if logprobs is not None and not caps.logprobs:
            return "this worker cannot return log probabilities (its engine does not report them)"
        if logprobs is not None and logprobs > caps.max_top_logprobs:
            return (
                f"this worker returns at most {caps.max_top_logprobs} alternatives per token, "
                f"not {logprobs}"
            )
        return None

    @staticmethod
    def _snapshot_handler(snapshot: Callable[[int], KvSnapshot]) -> Handler:
        async def handle(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
            request = _snapshot_request_decoder.decode(payload)
            yield _encode(snapshot(request.dp_rank))

        return handle

    @staticmethod
    def _kv_transfer_handler(
        serve: Callable[[KvTransferRequest], Coroutine[Any, Any, KvTransferReply]],
    ) -> Handler:
        async def handle(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
            try:
                request = _kv_transfer_decoder.decode(payload)
            except msgspec.DecodeError as exc:
                yield _encode(KvTransferReply(ok=False, error=f"unreadable request: {exc}"))
                return
            yield _encode(await serve(request))

        return handle

    async def stop(self, drain_timeout: float = 5.0) -> None:
        """Leave discovery, drain in-flight streams, stop the engine and its publisher."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        if self._lora_cards is not None:
            await self._lora_cards.close()
        if self.serving is not None:
            await self.serving.stop(drain_timeout)
            self.serving = None
        await self.engine.stop()
        if self._kv_transport is not None:
            await self._kv_transport.close()
            self._kv_transport = None
        if self._publisher is not None:
            await self._publisher.close()
            self._publisher = None


def artifact_handler(
    refs: list[ArtifactRef], registry: ArtifactRegistry = LOCAL_ARTIFACTS
) -> Handler:
    """The ``artifact`` side handler: streams the bytes of one of ``refs`` (asked for by
    sha256) in ``CHUNK_SIZE`` pieces. Only the artifacts the instance's card names are
    served; anything else is an error the caller sees (and tries another instance)."""
    offered = {ref.sha256: ref for ref in refs}

    async def handle(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        request = _artifact_request_decoder.decode(payload)
        ref = offered.get(request.sha256)
        data = registry.get(request.sha256) if ref is not None else None
        if ref is None or data is None:
            raise ArtifactError(f"this instance does not serve artifact {request.sha256[:16]}")
        for chunk in iter_chunks(data):
            if ctx.is_cancelled:
                return
            yield chunk

    return handle


#: Outputs the engine may run ahead of the handler before it is paused (back-pressure: the
#: request plane's credit window stops the handler, this stops the engine behind it).
_MAX_BUFFERED = 64


class _OutputBuffer:
    """Outputs handed from the engine task (``fill``) to the handler (``take``).

    ``items`` is appended by ``fill`` and swapped out whole by ``take``; ``done`` and
    ``error`` are set once, by ``fill``, when the engine stream ends. Each side parks on its
    own future (``_taker`` / ``_filler``) only when it cannot proceed.
    """

    __slots__ = ("_filler", "_taker", "done", "error", "items", "producer")

    def __init__(self) -> None:
        self.items: list[LLMEngineOutput] = []
        self.done = False
        self.error: BaseException | None = None
        self._taker: asyncio.Future[None] | None = None
        self._filler: asyncio.Future[None] | None = None
        #: The task running ``fill`` (cancelled by ``fail``).
        self.producer: asyncio.Task[None] | None = None

    def fail(self, final: LLMEngineOutput) -> None:
        """End the stream now with ``final`` after what is buffered; stop the engine side."""
        if self.done:
            return
        self.items.append(final)
        self.done = True
        _wake(self._taker)
        if self.producer is not None:
            self.producer.cancel()

    async def fill(self, stream: AsyncIterator[LLMEngineOutput]) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for output in stream:
                if self.done:
                    break  # failed meanwhile (``fail``): the final output is queued
                self.items.append(output)
                _wake(self._taker)
                if len(self.items) >= _MAX_BUFFERED:
                    self._filler = loop.create_future()
                    await self._filler
        except Exception as exc:  # handed to the handler, which raises it (ERROR frame)
            self.error = exc
        finally:
            self.done = True
            _wake(self._taker)
            await stream.aclose()  # type: ignore[attr-defined]

    async def take(self) -> list[LLMEngineOutput]:
        """Everything buffered (waiting for at least one); ``[]`` at the end of the stream."""
        while not self.items:
            if self.done:
                if self.error is not None:
                    raise self.error
                return []
            self._taker = asyncio.get_running_loop().create_future()
            await self._taker
        items = self.items
        self.items = []
        _wake(self._filler)
        return items


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def _is_plain(output: LLMEngineOutput) -> bool:
    """Only new token ids: nothing that a merge could misplace or lose."""
    return (
        bool(output.token_ids)
        and output.finish_reason is None
        and output.usage is None
        and output.text is None
        and output.log_probs is None
        and output.top_logprobs is None
        and output.cum_log_probs is None
        and output.error is None
        and output.extra is None
    )


def merge_outputs(outputs: list[LLMEngineOutput]) -> list[LLMEngineOutput]:
    """Fold runs of token-only outputs into one output (outputs are deltas, so their ids
    concatenate); such a run also joins the next output when that one carries no text or
    log probs (e.g. the last output's finish reason and usage). Order is kept."""
    if len(outputs) == 1:
        return outputs
    merged: list[LLMEngineOutput] = []
    held: list[int] = []
    for output in outputs:
        if _is_plain(output):
            held.extend(output.token_ids)
            continue
        if held:
            if output.text is None and output.log_probs is None:
                output = msgspec.structs.replace(output, token_ids=held + output.token_ids)
            else:
                merged.append(LLMEngineOutput(token_ids=held))
            held = []
        merged.append(output)
    if held:
        merged.append(LLMEngineOutput(token_ids=held))
    return merged
