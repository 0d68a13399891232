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
  The vocabulary side of this lives in ``llamacpp_vocab`` (``VocabBytes``).
* ``timings_per_token``: every chunk reports ``cache_n`` (prompt tokens served from the
  slot's prompt cache), so usage is right even when we stop the stream ourselves.
* ``kv_unified``: one KV pool shared by the slots, so any request may use the whole
  ``n_ctx``; ``ctx_shift`` off: a full context ends the stream instead of silently dropping
  the prompt's start.

Stop token ids (``stop_token_ids_hidden``, and ``eos_token_ids`` unless ``ignore_eos``) are
checked on the pool thread; llama.cpp itself stops at the model's end-of-generation tokens.
Errors (prompt longer than ``n_ctx``, invalid token ids, a native exception) end the stream
with ``finish_reason=ERROR`` and llama.cpp's message. A native exception means the engine
broke: its stream ends as ``engine_failed`` (the frontend migrates it) and the engine reports
the failure (the worker leaves discovery and exits). Requests past ``n_parallel`` running
plus ``max_waiting`` queued are refused as ``overloaded``. ``min_tokens`` is not supported by
llama.cpp's server: the card's capabilities say so, and the frontend refuses such requests.

Back-pressure: what a stalled consumer costs, and what bounds it. llama.cpp cannot pause a
slot: its loop decodes every active slot at each step and queues each result for the
completion call, whose callback only reads that queue. Blocking the callback (a bounded
queue here) would not stop generation, only move the backlog into llama.cpp's own queue
and hold a pool thread past the slot's end, starving a waiting request of a thread while
its slot is free (measured, SmolLM2 on CPU: with the callback blocked 3 s at token 10 of
400, 186 of the remaining tokens arrived within 50 ms after it, and the whole request took
7.1 s against 7.0 s unblocked). Stopping it (the callback's True) frees the slot, but
resuming would be a new task that re-prefills prompt + output with a fresh sampler state
(other tokens than the unpaused run), restarts any grammar from its first symbol, and loses
the tokens llama.cpp holds back mid-character. So a request whose reader stalls runs to its
end, and its outputs wait in its ``asyncio.Queue`` (unbounded in type, bounded in fact):
at most ``max_tokens`` outputs, or ``n_ctx`` minus the prompt when unset (``ctx_shift`` is
off, so a full context ends the stream); its slot is freed at its end as for any request,
so a stalled client holds no slot longer than its own generation. What the worker keeps
beyond that is bounded by its output buffer and the request plane's window.

Load reports. Given a sink (``set_event_sink``; the worker wires the event plane) and its
worker id (``bind_instance``: the instance id, known only once the worker registered; nothing
is published before), the engine publishes a ``LoadReport`` on every change (a request
admitted, taking a slot, producing its first token, ending) and at least every
``load_report_interval_s`` (a task started by ``start``), so the KV router's TTFT cost
calibrates on the real model rather than running on its prior:

* ``num_running``: requests whose native call holds a slot; ``num_waiting``: admitted
  requests waiting in Python for a slot; ``busy`` at the bound where new requests are
  refused as ``overloaded``; ``active_prefill_tokens``: prompt tokens of requests without a
  first token yet (whole prompts: what the slot's prompt cache will save is known only at
  the first token); ``kv_usage``: the tokens of the running requests over ``n_ctx`` (an
  estimate: llama.cpp also keeps idle slots' prompts for reuse, evictable);
  ``max_num_batched_tokens``: llama.cpp's ``n_batch`` (its server loop fills one batch with
  at most that many tokens, capped at ``n_ctx``).
* ``steps`` (at most 32 per report, a uniform sample of those since the previous report)
  come from llama.cpp's per-request timings (``timings_per_token``: ``prompt_n``,
  ``prompt_ms``, ``predicted_n``, ``predicted_ms``, ``cache_n``). A request's first chunk
  gives one prefill sample: ``prompt_n`` tokens computed (cached ones excluded) in
  ``prompt_ms``, beside the requests decoding at that moment (split in ``n_batch`` pieces
  when longer). While it decodes, every ~100 ms of ``predicted_ms`` gives one decode sample,
  the seconds per token over that span, beside the requests decoding then.

  Caveat: these are per-request times, not step times. llama.cpp batches all slots into
  each step, so a prompt's time includes the decode tokens of other slots, and prompts of
  two slots in one batch are each charged the shared batch. With one slot busy at a time
  they are step times; under concurrency they are an approximation the fit averages over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final, Protocol

import msgspec

from turnout.llm.model_card import default_gguf_path, load_model_card
from turnout.llm.structured import grammar_problem
from turnout.protocols.kv import LoadReport, StepSample
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
from turnout.runtime.context import RequestContext

from .base import Engine
from .echo import PLACEHOLDER_ENDPOINT
from .llamacpp_vocab import VocabBytes

log = logging.getLogger(__name__)

#: Most alternatives per token a request may ask for (OpenAI's limit for chat).
MAX_TOP_LOGPROBS: Final = 20

#: Structured outputs llama.cpp enforces (every kind: they all arrive as one grammar).
STRUCTURED_OUTPUTS: Final = ("json_object", "json_schema", "regex", "choice", "grammar")

#: ``SamplingOptions`` field -> llama.cpp completion parameter.
_SAMPLING_KEYS: Final = (
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("seed", "seed"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("repetition_penalty", "repeat_penalty"),
)

#: Step samples sent with one load report at most (a uniform sample of those since the
#: previous report): reports go out on every change, so this bounds a report, not the data.
_STEP_SAMPLES_PER_REPORT: Final = 32
#: A decoding request offers one decode sample per this much of its ``predicted_ms``.
_DECODE_SAMPLE_MS: Final = 100.0

# A stream's place, as the event loop sees it (``_Stream.phase``).
_WAITING: Final = 0  # admitted, waiting in Python for a slot
_RUNNING: Final = 1  # its native call holds a slot
_DONE: Final = 2  # its native call returned, or it left before it got a slot


class LoadReportSink(Protocol):
    """Where load reports go (the worker's ``EventPlaneSink``, a test's recorder). Called on
    the event loop; must not block."""

    def publish_load(self, report: LoadReport) -> None: ...


# ----------------------------------------------------------------- llama.cpp's chunks
# Only the fields we read; msgspec skips the rest without building them.


class _Alternative(msgspec.Struct):
    id: int
    logprob: float | None = None


class _TokenLogprob(msgspec.Struct):
    id: int
    bytes: list[int] = []
    logprob: float | None = None
    top_logprobs: list[_Alternative] = []


class _Logprobs(msgspec.Struct):
    content: list[_TokenLogprob] = []


class _Choice(msgspec.Struct):
    text: str = ""
    finish_reason: str | None = None
    logprobs: _Logprobs | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _PromptDetails | None = None


class _Timings(msgspec.Struct):
    #: Prompt tokens served from the slot's prompt cache.
    cache_n: int | None = None
    #: Prompt tokens computed, and the milliseconds from the start of prompt processing to
    #: the first token.
    prompt_n: int | None = None
    prompt_ms: float | None = None
    #: Tokens generated so far (1 at the first token) and the milliseconds since the first.
    predicted_n: int | None = None
    predicted_ms: float | None = None


class _ErrorBody(msgspec.Struct):
    message: str = "unknown llama.cpp error"
    type: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    timings: _Timings | None = None
    #: A refused request: ``{"error": {...}}``.
    error: _ErrorBody | None = None
    #: A failure mid-stream arrives as a bare ``{"code", "message", "type"}``.
    message: str | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_encode = msgspec.json.Encoder().encode


# ----------------------------------------------------------------- one stream


class _End:
    """Queue marker: the native call returned (after a final output, or without one)."""


_END: Final = _End()


class _Stream:
    """One request's state. ``on_chunk`` runs on a pool thread; ``aborted`` is written by the
    event loop thread (a plain attribute store: atomic under the GIL, read at every chunk)."""

    __slots__ = (
        "aborted",
        "cached_tokens",
        "decoding",
        "eos_ids",
        "finished",
        "load",
        "loop",
        "num_tokens",
        "phase",
        "prompt_tokens",
        "queue",
        "stop_ids",
        "timed_ms",
        "timed_n",
        "vocab",
        "want_logprobs",
        "want_top",
    )

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue[LLMEngineOutput | _End],
        request: PreprocessedRequest,
        vocab: VocabBytes,
        load: _LoadTracker,
    ) -> None:
        sc = request.stop_conditions
        self.loop = loop
        self.queue = queue
        self.vocab = vocab
        self.load = load
        self.prompt_tokens = len(request.token_ids)
        self.eos_ids = frozenset(() if sc.ignore_eos else request.eos_token_ids)
        self.stop_ids = self.eos_ids | frozenset(sc.stop_token_ids_hidden or ())
        self.want_logprobs = request.output_options.logprobs is not None
        #: Alternatives per token the request asked for (0: none).
        self.want_top = request.output_options.logprobs or 0
        #: Set by the loop thread when the consumer is gone; the next chunk stops llama.cpp.
        self.aborted = False
        #: Set once the output that ends the stream is queued: by the pool thread (final
        #: chunk, stop id, error), or by the loop thread (cancellation, ``stop``).
        self.finished = False
        self.num_tokens = 0
        self.cached_tokens: int | None = None
        #: Loop thread: ``_WAITING`` / ``_RUNNING`` / ``_DONE``, and whether its first token
        #: came (the load tracker's view).
        self.phase = _WAITING
        self.decoding = False
        #: Pool thread: ``predicted_n``/``predicted_ms`` at the last decode sample (-1: no
        #: chunk with timings yet).
        self.timed_n = -1
        self.timed_ms = 0.0

    def usage(self) -> CompletionUsage:
        return CompletionUsage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.num_tokens,
            cached_tokens=self.cached_tokens,
        )

    def _put(self, item: LLMEngineOutput | _End) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def fail(self, message: str, kind: ErrorKind | None = None) -> None:
        self.finished = True
        self._put(
            LLMEngineOutput(
                finish_reason=FinishReason.ERROR,
                error=message,
                error_kind=kind.value if kind is not None else None,
                usage=self.usage(),
            )
        )

    def end(self) -> None:
        self._put(_END)

    def on_chunk(self, data: bytes) -> bool:
        """Turn one chunk into an output on the queue. Returns True to stop llama.cpp."""
        if self.aborted or self.finished:
            return True
        try:
            chunk = _decode_chunk(data)
        except msgspec.DecodeError as e:
            self.fail(f"llama.cpp sent an unreadable chunk: {e}")
            return True
        if chunk.error is not None or chunk.message is not None or not chunk.choices:
            message = chunk.error.message if chunk.error is not None else chunk.message
            self.fail(message or f"llama.cpp sent a chunk without choices: {data[:200]!r}")
            return True
        timings = chunk.timings
        if timings is not None:
            if timings.cache_n is not None:
                self.cached_tokens = timings.cache_n
            self._sample(timings)
        choice = chunk.choices[0]
        entries = choice.logprobs.content if choice.logprobs is not None else None
        ids: list[int] = []
        logprobs: list[float] | None = None
        tops: list[list[tuple[int, float]]] | None = None
        if entries:
            text = choice.text
            if len(entries) == 1 and text and not text.isascii():
                # The entry's own "bytes" are the chunk's text, not the token's: compare the
                # text with the token's piece to find bytes of held-back tokens before it.
                raw = text.encode()
                piece = self.vocab.piece(entries[0].id)
                if piece is not None and len(raw) > len(piece) and raw.endswith(piece):
                    ids = self.vocab.fill(raw[: len(raw) - len(piece)])
            if self.want_logprobs:
                logprobs = [math.nan] * len(ids)
                logprobs.extend(math.nan if e.logprob is None else e.logprob for e in entries)
            if self.want_top:
                # Held-back tokens (recovered above) have no entry, so no alternatives.
                tops = [[] for _ in ids]
                tops.extend(_alternatives(e, self.want_top) for e in entries)
            ids.extend(e.id for e in entries)

        finish: FinishReason | None = None
        if self.stop_ids:
            for i, token_id in enumerate(ids):
                if token_id in self.stop_ids:
                    finish = FinishReason.EOS if token_id in self.eos_ids else FinishReason.STOP
                    del ids[i + 1 :]
                    if logprobs is not None:
                        del logprobs[i + 1 :]
                    if tops is not None:
                        del tops[i + 1 :]
                    break
        self.num_tokens += len(ids)
        usage: CompletionUsage | None = None
        if finish is not None:
            usage = self.usage()
        elif choice.finish_reason is not None:
            finish = FinishReason.LENGTH if choice.finish_reason == "length" else FinishReason.EOS
            usage = self.usage()
            if chunk.usage is not None:
                details = chunk.usage.prompt_tokens_details
                usage = CompletionUsage(
                    prompt_tokens=chunk.usage.prompt_tokens,
                    completion_tokens=chunk.usage.completion_tokens,
                    cached_tokens=details.cached_tokens if details else self.cached_tokens,
                )
        elif not ids:
            return False  # nothing new (e.g. an empty keep-alive chunk)
        self.finished = finish is not None
        self._put(
            LLMEngineOutput(
                token_ids=ids,
                finish_reason=finish,
                log_probs=logprobs,
                top_logprobs=tops,
                usage=usage,
            )
        )
        return self.finished

    def _sample(self, timings: _Timings) -> None:
        """Turn llama.cpp's running timings into step samples, handed to the loop: the
        prefill at the first chunk, then one decode sample per ``_DECODE_SAMPLE_MS`` of
        generation (the mean seconds per token over that span)."""
        n, ms = timings.predicted_n, timings.predicted_ms
        if n is None or ms is None:
            return
        if self.timed_n < 0:
            self.timed_n, self.timed_ms = n, ms
            prompt_n = timings.prompt_n or 0
            seconds = (timings.prompt_ms or 0.0) / 1000.0
            self.loop.call_soon_threadsafe(self.load.first_token, self, prompt_n, seconds)
        elif n > self.timed_n and ms - self.timed_ms >= _DECODE_SAMPLE_MS:
            per_token = (ms - self.timed_ms) / 1000.0 / (n - self.timed_n)
            self.timed_n, self.timed_ms = n, ms
            self.loop.call_soon_threadsafe(self.load.decoded, per_token)


def _run_native(
    server: Any, body: bytes, stream: _Stream, on_failure: Callable[[str], None]
) -> None:
    """The blocking part, on a pool thread: drive one request to its end. A native exception
    is the engine's failure: the stream ends as ``engine_failed`` and ``on_failure`` is
    called on the event loop. The load tracker hears, on the loop, when the request takes
    its slot and when it gives it back."""
    loop = stream.loop
    started = False
    try:
        if not stream.aborted:
            started = True
            loop.call_soon_threadsafe(stream.load.started, stream)
            server.handle_completions(body, stream.on_chunk)
    except Exception as e:
        message = f"llama.cpp failed: {e!r}"
        if not stream.finished:
            stream.fail(message, ErrorKind.ENGINE_FAILED)
        loop.call_soon_threadsafe(on_failure, message)
    finally:
        if started:
            loop.call_soon_threadsafe(stream.load.ended, stream)
        stream.end()


# ----------------------------------------------------------------- load reports


class _LoadTracker:
    """The engine's load, as the event loop sees it, and its ``LoadReport``s.

    Runs on the event loop only: pool threads reach it through ``call_soon_threadsafe``, in
    order (a stream's ``started`` comes before its samples and its ``ended``). Reports go
    out on change (``publish()`` after each transition) and on the steady beat
    (``publish(force=True)``); nothing goes out before the worker id is known.
    """

    def __init__(self, *, n_ctx: int, bound: int, interval_s: float, seed: int) -> None:
        self.n_ctx = n_ctx
        #: Requests in flight at which the engine refuses more (``overloaded``).
        self.bound = bound
        self.interval_s = interval_s
        self.sink: LoadReportSink | None = None
        self.worker_id: int | None = None
        #: False while the engine is stopped: state is kept, nothing is published.
        self.enabled = False
        #: llama.cpp's per-step token budget (``n_batch``, at most ``n_ctx``), once started.
        self.step_budget = 0
        #: Admitted streams (``generate``'s), and those holding a slot.
        self.in_flight = 0
        self.running: dict[_Stream, None] = {}
        self.num_waiting = 0
        self.waiting_tokens = 0
        self.samples: list[StepSample] = []
        self.samples_seen = 0
        self._rng = random.Random(seed)
        self._last_key: tuple[int, int, int, bool] | None = None
        #: ``time.monotonic()`` by which the next report is due.
        self.next_report = 0.0

    # ---- transitions

    def admitted(self, stream: _Stream) -> None:
        """``generate`` took the request: it waits for a slot."""
        self.in_flight += 1
        self.num_waiting += 1
        self.waiting_tokens += stream.prompt_tokens
        self.publish()

    def _leave_waiting(self, stream: _Stream) -> None:
        if stream.phase == _WAITING:
            self.num_waiting -= 1
            self.waiting_tokens -= stream.prompt_tokens

    def left(self, stream: _Stream) -> None:
        """``generate`` is done with the stream (finished, cancelled, consumer gone); its
        native call, if any, may still be returning."""
        self.in_flight -= 1
        self._leave_waiting(stream)
        if stream.phase == _WAITING:
            stream.phase = _DONE
        self.publish()

    def started(self, stream: _Stream) -> None:
        """Its native call began: the request holds a slot."""
        self._leave_waiting(stream)
        stream.phase = _RUNNING
        self.running[stream] = None
        self.publish()

    def ended(self, stream: _Stream) -> None:
        """Its native call returned: the slot is free."""
        stream.phase = _DONE
        stream.decoding = False
        if stream in self.running:
            del self.running[stream]
            self.publish()

    def first_token(self, stream: _Stream, prompt_n: int, seconds: float) -> None:
        """The request's prompt is computed (``prompt_n`` tokens in ``seconds``)."""
        if stream.phase != _RUNNING:
            return
        decodes = self.num_decoding()
        usage = self.kv_usage()
        stream.decoding = True
        if prompt_n > 0 and math.isfinite(seconds) and seconds >= 0:
            # A prompt longer than the budget took several server steps: charge each its
            # share (the per-token work dominates a step on a CPU).
            budget = self.step_budget if self.step_budget > 0 else prompt_n
            left = prompt_n
            while left > 0:
                piece = min(left, budget)
                self._offer(StepSample(piece, decodes, seconds * piece / prompt_n, usage))
                left -= piece
        self.publish()

    def decoded(self, seconds_per_token: float) -> None:
        """A decoding request's recent seconds per token: one decode step's time."""
        if math.isfinite(seconds_per_token) and seconds_per_token >= 0:
            decodes = max(self.num_decoding(), 1)
            self._offer(StepSample(0, decodes, seconds_per_token, self.kv_usage()))

    # ---- the report

    def active_prefill_tokens(self) -> int:
        """Prompt tokens of the requests without a first token (waiting or prefilling)."""
        return self.waiting_tokens + sum(s.prompt_tokens for s in self.running if not s.decoding)

    def num_decoding(self) -> int:
        return sum(1 for s in self.running if s.decoding)

    def kv_usage(self) -> float:
        """Tokens of the running requests over the KV pool (an estimate, see the module)."""
        used = sum(s.prompt_tokens + s.num_tokens for s in self.running)
        return min(used / self.n_ctx, 1.0)

    def _offer(self, sample: StepSample) -> None:
        """Keep a uniform sample (reservoir) of the steps since the last report."""
        self.samples_seen += 1
        if len(self.samples) < _STEP_SAMPLES_PER_REPORT:
            self.samples.append(sample)
        else:
            slot = self._rng.randrange(self.samples_seen)
            if slot < _STEP_SAMPLES_PER_REPORT:
                self.samples[slot] = sample

    def report(self) -> LoadReport:
        """The current load (without taking the samples)."""
        return LoadReport(
            worker_id=self.worker_id or 0,
            active_prefill_tokens=self.active_prefill_tokens(),
            kv_usage=self.kv_usage(),
            num_waiting=self.num_waiting,
            num_running=len(self.running),
            busy=self.in_flight >= self.bound,
            steps=list(self.samples),
            max_num_batched_tokens=self.step_budget,
        )

    def publish(self, *, force: bool = False) -> None:
        """Publish a report if the load changed since the last one, or if ``force``."""
        sink, worker_id = self.sink, self.worker_id
        if sink is None or worker_id is None or not self.enabled:
            return
        busy = self.in_flight >= self.bound
        key = (self.num_waiting, len(self.running), self.active_prefill_tokens(), busy)
        if not force and key == self._last_key:
            return
        self._last_key = key
        self.next_report = time.monotonic() + self.interval_s
        report = self.report()
        self.samples = []
        self.samples_seen = 0
        try:
            sink.publish_load(report)
        except Exception:  # a sink's failure must not stop the engine
            log.exception("publishing a load report failed (worker %x)", worker_id)

    async def beat(self) -> None:
        """Publish at least every ``interval_s``: routers drop stale reports, and decode
        samples wait for a report to carry them."""
        while True:
            delay = self.next_report - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            self.next_report = time.monotonic() + self.interval_s
            self.publish(force=True)


# ----------------------------------------------------------------- the engine


class LlamaCppEngine(Engine):
    """A GGUF model served by llama.cpp on CPU (default: SmolLM2-135M-Instruct).

    ``n_ctx`` is the KV pool shared by the ``n_parallel`` slots (any one request may use all
    of it); ``n_threads`` defaults to llama.cpp's choice (the physical cores); ``seed`` is
    the sampling seed of requests that do not set one. ``verbose`` lets llama.cpp log.
    ``worker_id`` is the id on load reports until ``bind_instance`` sets the instance id;
    reports go out every ``load_report_interval_s`` at least (see the module docstring).
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
        self._load = _LoadTracker(
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
        self._live: dict[_Stream, None] = {}

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

    def load_report(self) -> LoadReport:
        """The engine's load now; its ``steps`` are those pending for the next report
        (left there)."""
        return self._load.report()

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
            # of structured output (grammars); not ``min_tokens``, which llama.cpp's server
            # does not have.
            capabilities=ModelCapabilities(
                logprobs=True,
                max_top_logprobs=MAX_TOP_LOGPROBS,
                structured_outputs=list(STRUCTURED_OUTPUTS),
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

    def _make_body(self, request: PreprocessedRequest) -> bytes:
        sc = request.stop_conditions
        body: dict[str, Any] = {
            "prompt": request.token_ids,
            "stream": True,
            "n_predict": -1 if sc.max_tokens is None else sc.max_tokens,
            # Every token's own log probability comes with its entry; alternatives: as many
            # as asked.
            "n_probs": max(1, request.output_options.logprobs or 0),
            "timings_per_token": True,
            "cache_prompt": True,
        }
        if sc.ignore_eos:
            body["ignore_eos"] = True
        if request.structured is not None:
            # llama.cpp compiles llguidance grammars itself (the "%llguidance" header).
            body["grammar"] = request.structured.grammar
        so = request.sampling_options
        for ours, theirs in _SAMPLING_KEYS:
            value = getattr(so, ours)
            if value is not None:
                body[theirs] = value
        return _encode(body)

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
        if request.cache_salt:
            # llama.cpp's slots reuse any earlier prompt's cache: it cannot keep tenants apart,
            # so a salted request is refused rather than served without the isolation it asked.
            yield LLMEngineOutput(
                finish_reason=FinishReason.ERROR,
                error="'cache_salt' is not supported by this worker (llama.cpp cannot "
                "partition its prompt cache)",
                error_kind=ErrorKind.BAD_REQUEST.value,
                usage=CompletionUsage(prompt_tokens=n_prompt, completion_tokens=0),
            )
            return
        problem = _grammar_problem(request)
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
        queue: asyncio.Queue[LLMEngineOutput | _End] = asyncio.Queue()
        stream = _Stream(
            loop=loop, queue=queue, request=request, vocab=self._vocab, load=self._load
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
        loop.run_in_executor(
            executor, _run_native, server, self._make_body(request), stream, self.report_failure
        )
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _End):
                    if not stream.finished:
                        yield LLMEngineOutput(
                            finish_reason=FinishReason.ERROR,
                            error="llama.cpp ended the stream without a final chunk",
                            usage=stream.usage(),
                        )
                    return
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Consumer gone, cancelled or done: the next chunk tells llama.cpp to stop.
            stream.aborted = True
            watcher.cancel()
            if stream in self._live:
                del self._live[stream]
                self._load.left(stream)


def _release(holder: list[Any]) -> None:
    """Drop the last reference to the native server on this (worker) thread."""
    holder.clear()


__all__ = ["LlamaCppEngine", "VocabBytes"]


def _alternatives(entry: _TokenLogprob, k: int) -> list[tuple[int, float]]:
    """An entry's ``k`` most likely alternatives, most likely first (-inf when llama.cpp gave
    no number)."""
    alts = [(a.id, -math.inf if a.logprob is None else a.logprob) for a in entry.top_logprobs]
    alts.sort(key=lambda a: -a[1])
    return alts[:k]


def _grammar_problem(request: PreprocessedRequest) -> str:
    """Why llama.cpp must not run ``request``'s grammar ("" when it may, or has none).

    llama.cpp, given an llguidance grammar it cannot compile, logs it and samples freely: the
    answer would be a 200 with text that matches nothing. The frontend checks grammars before
    sending them; this check, with the same library, covers what reaches the worker another
    way (another frontend's version, a client of the request plane)."""
    structured = request.structured
    if structured is None:
        return ""
    if structured.kind not in STRUCTURED_OUTPUTS:
        return f"llama.cpp cannot enforce {structured.kind} output"
    if not structured.grammar.startswith("%llguidance"):
        # llama.cpp would read it as GBNF, which is not what the protocol carries.
        return "the grammar is not an llguidance grammar (no '%llguidance' header)"
    problem = grammar_problem(structured.grammar)
    return f"the {structured.kind} grammar does not compile: {problem}" if problem else ""
