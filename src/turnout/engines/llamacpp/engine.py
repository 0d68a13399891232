"""A real model on CPU: llama.cpp's server core, in process, through ``xllamacpp``.

Mental model. ``xllamacpp.Server`` runs llama.cpp's HTTP-less server: one native loop thread
owns the model and batches all slots (``n_parallel``) into each decode step. A request is a
*blocking* call, ``server.handle_completions(body, callback)``, that invokes ``callback`` on
the calling thread for every streamed chunk; the callback's return value means "stop": True
makes llama.cpp cancel the task and free its slot at once (verified: the next request on a
one-slot server starts within milliseconds, and the decode counter stops).

So each request runs on a thread of our own pool, sized ``n_parallel`` so that a request
waiting for a slot waits in Python, where cancelling it costs nothing::

    event loop                          pool thread (one per running request)
    ──────────                          ─────────────────────────────────────
    generate() ── run_in_executor ──▶   handle_completions(body, stream.on_chunk)
       ▲                                   │ on_chunk(chunk): parse, build the output
       └── asyncio.Queue ◀── call_soon_threadsafe ──┘  returns stream.aborted

What we ask llama.cpp for, and why:

* ``prompt`` is the request's token ids: the frontend already templated and tokenized.
* ``n_probs`` (at least 1): the OpenAI-style chunks carry text only; the token ids come from the
  per-token ``logprobs`` entries. llama.cpp holds back a token whose bytes end inside a
  UTF-8 character and never streams its entry; its bytes lead the text of the chunk that
  completes the character. We recover those ids from the GGUF vocabulary (greedy longest
  match over token byte strings): exact when one token is missing, as is usual; when several
  are, the ids may be segmented differently from the model's, but they decode to the same
  bytes. Tokens held back when the generation ends mid-character are lost (they are not text).
  The vocabulary side of this lives in ``vocab`` (``VocabBytes``).
* ``timings_per_token``: every chunk reports ``cache_n`` (prompt tokens served from the
  slot's prompt cache), so usage is right even when we stop the stream ourselves.
* ``kv_unified``: one KV pool shared by the slots, so any request may use the whole
  ``n_ctx``; ``ctx_shift`` off: a full context ends the stream instead of silently dropping
  the prompt's start.
* ``id_slot`` and ``cache_prompt``: the engine picks each request's slot itself, so that a
  cache partition (``cache_salt``; unsalted requests are one of their own) reuses only its
  own cached prompts and no request's prefill time depends on another partition's prompts
  (``slots``). Its prompt cache is the ``n_parallel`` slots' last prompts: llama.cpp's RAM
  prompt cache, which would mix partitions, is off.

Stop token ids (``stop_token_ids_hidden``, and ``eos_token_ids`` unless ``ignore_eos``) are
checked on the pool thread; llama.cpp itself stops at the model's end-of-generation tokens.
Errors (prompt longer than ``n_ctx``, invalid token ids, a native exception) end the stream
with ``finish_reason=ERROR`` and llama.cpp's message. A native exception means the engine
broke: its stream ends as ``engine_failed`` (the frontend migrates it) and the engine reports
the failure (the worker leaves discovery and exits). Requests past ``n_parallel`` running
plus ``max_waiting`` queued are refused as ``overloaded``. ``min_tokens`` is not supported by
llama.cpp's server: the card's capabilities say so, and the frontend refuses such requests.

The parts: ``completion`` (the body sent, the chunks read back), ``stream`` (one request on
its pool thread, and what a stalled reader costs), ``slots`` (which slot a request runs on),
``load`` (load reports), ``vocab`` (the token bytes that recover held-back ids).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from turnout.engines.base import Engine
from turnout.engines.echo import PLACEHOLDER_ENDPOINT
from turnout.llm.model_card import default_gguf_path, load_model_card
from turnout.protocols.llm import (
    CompletionUsage,
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
)
from turnout.protocols.model import (
    DEVICE_CPU,
    ModelCapabilities,
    ModelDeploymentCard,
    RuntimeConfig,
)
from turnout.runtime import tracing
from turnout.runtime.context import RequestContext

from .completion import MAX_TOP_LOGPROBS, STRUCTURED_OUTPUTS, make_body, request_grammar_problem
from .load import LoadReportSink, LoadTracker
from .slots import SlotTable
from .stream import End, RequestStream, run_native
from .vocab import VocabBytes

log = logging.getLogger(__name__)


class LlamaCppEngine(Engine):
    """A GGUF model served by llama.cpp on CPU (default: SmolLM2-135M-Instruct).

    ``n_ctx`` is the KV pool shared by the ``n_parallel`` slots (any one request may use all
    of it); ``n_threads`` defaults to llama.cpp's choice (the physical cores); ``seed`` is
    the sampling seed of requests that do not set one. ``verbose`` lets llama.cpp log.
    ``worker_id`` is the id on load reports until ``bind_instance`` sets the instance id;
    reports go out every ``load_report_interval_s`` at least (see ``load``).
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        n_ctx: int = 4096,
        n_parallel: int = 4,
        n_threads: int | None = None,
        seed: int = 0,
        verbose: bool = False,
        max_waiting: int = 1024,
        worker_id: int | None = None,
        load_report_interval_s: float = 1.0,
    ) -> None:
        if n_ctx < 16:
            raise ValueError(f"n_ctx must be >= 16, got {n_ctx}")
        if n_parallel < 1:
            raise ValueError(f"n_parallel must be >= 1, got {n_parallel}")
        if n_threads is not None and n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        self.model_path = str(model_path or default_gguf_path())
        self.n_ctx = n_ctx
        self.n_parallel = n_parallel
        self.n_threads = n_threads
        self.seed = seed
        self.verbose = verbose
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        #: Requests that may wait for a slot; more are refused as ``overloaded``.
        self.max_waiting = max_waiting
        if not load_report_interval_s > 0:
            raise ValueError(f"load_report_interval_s must be > 0, got {load_report_interval_s}")
        self._load = LoadTracker(
            n_ctx=n_ctx,
            bound=n_parallel + max_waiting,
            interval_s=load_report_interval_s,
            seed=seed,
        )
        self._load.worker_id = worker_id
        #: The steady load-report task (only with a sink), on the loop that runs requests.
        self._beat: asyncio.Task[None] | None = None
        #: llama.cpp's ``n_batch`` as configured (set when the server is made).
        self.n_batch = 0
        self._server: Any = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._vocab = VocabBytes(())
        self._card: ModelDeploymentCard | None = None
        #: Streams in flight, so ``stop`` can end them.
        self._live: dict[RequestStream, None] = {}
        #: llama.cpp's slots as the engine assigns them: each request is pinned to one, so
        #: that a cache partition reuses only its own prompts (``slots``).
        self._slots = SlotTable(n_parallel)

    # ------------------------------------------------------------ load reports

    def set_event_sink(self, sink: LoadReportSink) -> None:
        """Where load reports go from now on (the worker wires the event plane before
        ``start``). Only ``publish_load`` is used: llama.cpp's cache emits no KV events."""
        self._load.sink = sink
        if self._server is not None:
            with contextlib.suppress(RuntimeError):  # no running loop: ``generate`` starts it
                self._ensure_beat(asyncio.get_running_loop())

    def bind_instance(self, instance_id: int) -> None:
        """The instance id the worker registered under: routers key load reports by it."""
        self._load.worker_id = instance_id
        self._load.publish(force=True)

    @property
    def worker_id(self) -> int | None:
        """The id on load reports (None until bound: nothing is published)."""
        return self._load.worker_id

    def _ensure_beat(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the steady report task on ``loop`` (the engine may serve from a later loop
        than the one that started it, as tests do)."""
        beat = self._beat
        if self._load.sink is None or (
            beat is not None and not beat.done() and beat.get_loop() is loop
        ):
            return
        self._cancel_beat()
        self._beat = loop.create_task(self._load.beat(), name="llamacpp-load-beat")

    def _cancel_beat(self) -> asyncio.Task[None] | None:
        """Cancel the report task; returns it when it is on the running loop (to await)."""
        beat, self._beat = self._beat, None
        if beat is None or beat.done():
            return None
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if beat.get_loop() is running:
            beat.cancel()
            return beat
        with contextlib.suppress(RuntimeError):  # that loop is closed: the task is dead
            beat.get_loop().call_soon_threadsafe(beat.cancel)
        return None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("LlamaCppEngine.start() called twice")
        self._card = await asyncio.to_thread(self._load_card)
        self._vocab = await asyncio.to_thread(VocabBytes.from_gguf, self.model_path)
        self._server = await asyncio.to_thread(self._make_server)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.n_parallel, thread_name_prefix="llamacpp"
        )
        self._load.step_budget = min(self.n_batch, self.n_ctx) if self.n_batch > 0 else self.n_ctx
        self._load.enabled = True
        self._ensure_beat(asyncio.get_running_loop())
        self._load.publish(force=True)
        log.info(
            "llamacpp: loaded %s (n_ctx=%d, n_parallel=%d)",
            self.model_path,
            self.n_ctx,
            self.n_parallel,
        )

    async def stop(self) -> None:
        """End every stream (with an ``ERROR`` output), wait for the native calls to return,
        then free the model."""
        self._load.enabled = False
        beat = self._cancel_beat()
        if beat is not None:
            await asyncio.gather(beat, return_exceptions=True)
        for stream in list(self._live):
            stream.aborted = True
            if not stream.finished:
                stream.finished = True
                stream.queue.put_nowait(
                    LLMEngineOutput(
                        finish_reason=FinishReason.ERROR,
                        error="the engine is stopping",
                        error_kind=ErrorKind.ENGINE_FAILED.value,
                        usage=stream.usage(),
                    )
                )
        executor, self._executor = self._executor, None
        # Hold the server only in a list, so the last reference dies on a worker thread: its
        # destructor stops llama.cpp's loop thread and joins it (blocking).
        holder = [self._server] if self._server is not None else []
        self._server = None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)
        if holder:
            await asyncio.to_thread(_release, holder)

    def _make_server(self) -> Any:
        import xllamacpp  # optional dependency: only needed once a model is served

        p = xllamacpp.CommonParams()
        p.model.path = self.model_path
        p.n_ctx = self.n_ctx
        p.n_parallel = self.n_parallel
        p.kv_unified = True
        p.ctx_shift = False
        p.cache_prompt = True
        if hasattr(p, "cache_ram_mib"):  # llama.cpp builds older than its RAM cache lack it
            # No RAM prompt cache: it restores any partition's prompt into any slot, and it
            # empties idle slots whenever another starts (the engine pins slots: see ``slots``).
            p.cache_ram_mib = 0
        p.endpoint_metrics = True
        p.sampling.seed = self.seed
        p.verbosity = 3 if self.verbose else -1
        if self.n_threads is not None:
            p.cpuparams.n_threads = self.n_threads
            p.cpuparams_batch.n_threads = self.n_threads
        # The server loop fills one batch with at most n_batch tokens (llama.cpp caps it at
        # n_ctx): the per-step token budget of load reports.
        self.n_batch = int(p.n_batch)
        return xllamacpp.Server(p)

    def _load_card(self) -> ModelDeploymentCard:
        card = load_model_card(self.model_path, endpoint=PLACEHOLDER_ENDPOINT)
        context_length = min(self.n_ctx, card.context_length)
        return msgspec.structs.replace(
            card,
            context_length=context_length,
            runtime_config=RuntimeConfig(
                max_num_seqs=self.n_parallel,
                total_kv_blocks=self.n_ctx // card.kv_cache_block_size,
                # xllamacpp runs on the CPU here; ``--device-type`` overrides it.
                device_type=DEVICE_CPU,
            ),
            # Each token's log probability and up to 20 alternatives; every kind
            # of structured output (grammars); cache partitions by slot (``slots``); not
            # ``min_tokens``, which llama.cpp's server does not have.
            capabilities=ModelCapabilities(
                logprobs=True,
                max_top_logprobs=MAX_TOP_LOGPROBS,
                structured_outputs=list(STRUCTURED_OUTPUTS),
                cache_salt=True,
            ),
        )

    def model_card_template(self) -> ModelDeploymentCard:
        if self._card is None:
            self._card = self._load_card()
        return self._card

    async def get_native_metrics(self) -> dict[str, float]:
        """llama.cpp's own counters (``llamacpp:n_decode_total``, ``requests_processing``,
        ...), from its Prometheus text."""
        server = self._require_server()
        text: str = await asyncio.to_thread(server.handle_metrics)
        metrics: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    metrics[name] = float(value)
                except ValueError:
                    continue
        return metrics

    def _require_server(self) -> Any:
        if self._server is None:
            raise RuntimeError("LlamaCppEngine is not started (await engine.start() first)")
        return self._server

    # ------------------------------------------------------------ requests

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        server = self._require_server()
        executor = self._executor
        assert executor is not None  # set together with _server
        n_prompt = len(request.token_ids)
        max_tokens = request.stop_conditions.max_tokens
        if max_tokens is not None and max_tokens <= 0:
            yield LLMEngineOutput(
                finish_reason=FinishReason.LENGTH,
                usage=CompletionUsage(prompt_tokens=n_prompt, completion_tokens=0),
            )
            return
        problem = request_grammar_problem(request)
        if problem:
            yield LLMEngineOutput(
                finish_reason=FinishReason.ERROR,
                error=problem,
                error_kind=ErrorKind.BAD_REQUEST.value,
                usage=CompletionUsage(prompt_tokens=n_prompt, completion_tokens=0),
            )
            return
        if n_prompt == 0:
            yield LLMEngineOutput(
                finish_reason=FinishReason.ERROR,
                error="the prompt is empty",
                error_kind=ErrorKind.BAD_REQUEST.value,
                usage=CompletionUsage(prompt_tokens=0, completion_tokens=0),
            )
            return
        if self.failure is not None:
            yield LLMEngineOutput(
                finish_reason=FinishReason.ERROR,
                error=self.failure,
                error_kind=ErrorKind.ENGINE_FAILED.value,
            )
            return
        if len(self._live) >= self.n_parallel + self.max_waiting:
            yield LLMEngineOutput(
                finish_reason=FinishReason.ERROR,
                error=f"{len(self._live)} requests in flight ({self.n_parallel} slots + "
                f"max_waiting={self.max_waiting}); try again later",
                error_kind=ErrorKind.OVERLOADED.value,
                usage=CompletionUsage(prompt_tokens=n_prompt, completion_tokens=0),
            )
            return

        if ctx.is_cancelled:
            yield LLMEngineOutput(
                finish_reason=FinishReason.CANCELLED,
                usage=CompletionUsage(prompt_tokens=n_prompt, completion_tokens=0),
            )
            return

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[LLMEngineOutput | End] = asyncio.Queue()
        stream = RequestStream(
            loop=loop,
            queue=queue,
            request=request,
            vocab=self._vocab,
            load=self._load,
            slots=self._slots,
        )

        def on_cancel(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and not stream.finished:
                stream.aborted = True
                stream.finished = True
                queue.put_nowait(
                    LLMEngineOutput(finish_reason=FinishReason.CANCELLED, usage=stream.usage())
                )

        self._live[stream] = None
        self._load.admitted(stream)
        self._ensure_beat(loop)
        watcher = loop.create_task(ctx.wait_cancelled())
        watcher.add_done_callback(on_cancel)
        span = (
            None
            if ctx.trace is None
            else tracing.start_span(ctx, "llamacpp.generate", {"turnout.prompt_tokens": n_prompt})
        )
        finish: FinishReason | None = None
        try:
            # Inside the try: an executor already shut down raises here, and the cleanup
            # below still releases the watcher, the live entry and the load admission.
            loop.run_in_executor(
                executor, run_native, server, make_body(request), stream, self.report_failure
            )
            while True:
                item = await queue.get()
                if isinstance(item, End):
                    if not stream.finished:
                        finish = FinishReason.ERROR
                        yield LLMEngineOutput(
                            finish_reason=FinishReason.ERROR,
                            error="llama.cpp ended the stream without a final chunk",
                            usage=stream.usage(),
                        )
                    return
                finish = item.finish_reason
                yield item
                if finish is not None:
                    return
        finally:
            # Consumer gone, cancelled or done: the next chunk tells llama.cpp to stop.
            stream.aborted = True
            watcher.cancel()
            if span is not None:
                _end_span(span, stream, finish)
            if stream in self._live:
                del self._live[stream]
                self._load.left(stream)


def _end_span(span: Any, stream: RequestStream, finish: FinishReason | None) -> None:
    """End a traced request's ``llamacpp.generate`` span (from its submission to its end):
    the prompt tokens the slot's cache served, tokens out, and how the stream ended (no
    finish reason: the consumer left first)."""
    span.set_attributes(
        {
            "turnout.cached_tokens": stream.cached_tokens or 0,
            "turnout.output_tokens": stream.num_tokens,
        }
    )
    if finish is None:
        span.set_attribute("turnout.cancelled", True)
    else:
        span.set_attribute("turnout.finish_reason", str(finish))
    tracing.end_span(span)


def _release(holder: list[Any]) -> None:
    """Drop the last reference to the native server on this (worker) thread."""
    holder.clear()
