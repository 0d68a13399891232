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
* ``n_probs: 1``: the OpenAI-style chunks carry text only; the token ids come from the
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
llama.cpp's server and is ignored here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import msgspec

from turnout.llm.model_card import default_gguf_path, load_model_card
from turnout.protocols.llm import (
    CompletionUsage,
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
)
from turnout.protocols.model import ModelDeploymentCard, RuntimeConfig
from turnout.runtime.context import RequestContext

from .base import Engine
from .echo import PLACEHOLDER_ENDPOINT
from .llamacpp_vocab import VocabBytes

log = logging.getLogger(__name__)

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


# ----------------------------------------------------------------- llama.cpp's chunks
# Only the fields we read; msgspec skips the rest without building them.


class _TokenLogprob(msgspec.Struct):
    id: int
    bytes: list[int] = []
    logprob: float | None = None


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
    cache_n: int | None = None


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
        "eos_ids",
        "finished",
        "loop",
        "num_tokens",
        "prompt_tokens",
        "queue",
        "stop_ids",
        "vocab",
        "want_logprobs",
    )

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue[LLMEngineOutput | _End],
        request: PreprocessedRequest,
        vocab: VocabBytes,
    ) -> None:
        sc = request.stop_conditions
        self.loop = loop
        self.queue = queue
        self.vocab = vocab
        self.prompt_tokens = len(request.token_ids)
        self.eos_ids = frozenset(() if sc.ignore_eos else request.eos_token_ids)
        self.stop_ids = self.eos_ids | frozenset(sc.stop_token_ids_hidden or ())
        self.want_logprobs = request.output_options.logprobs is not None
        #: Set by the loop thread when the consumer is gone; the next chunk stops llama.cpp.
        self.aborted = False
        #: Set once the output that ends the stream is queued: by the pool thread (final
        #: chunk, stop id, error), or by the loop thread (cancellation, ``stop``).
        self.finished = False
        self.num_tokens = 0
        self.cached_tokens: int | None = None

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
        if chunk.timings is not None and chunk.timings.cache_n is not None:
            self.cached_tokens = chunk.timings.cache_n
        choice = chunk.choices[0]
        entries = choice.logprobs.content if choice.logprobs is not None else None
        ids: list[int] = []
        logprobs: list[float] | None = None
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
            ids.extend(e.id for e in entries)

        finish: FinishReason | None = None
        if self.stop_ids:
            for i, token_id in enumerate(ids):
                if token_id in self.stop_ids:
                    finish = FinishReason.EOS if token_id in self.eos_ids else FinishReason.STOP
                    del ids[i + 1 :]
                    if logprobs is not None:
                        del logprobs[i + 1 :]
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
            LLMEngineOutput(token_ids=ids, finish_reason=finish, log_probs=logprobs, usage=usage)
        )
        return self.finished


def _run_native(
    server: Any, body: bytes, stream: _Stream, on_failure: Callable[[str], None]
) -> None:
    """The blocking part, on a pool thread: drive one request to its end. A native exception
    is the engine's failure: the stream ends as ``engine_failed`` and ``on_failure`` is
    called on the event loop."""
    try:
        if not stream.aborted:
            server.handle_completions(body, stream.on_chunk)
    except Exception as e:
        message = f"llama.cpp failed: {e!r}"
        if not stream.finished:
            stream.fail(message, ErrorKind.ENGINE_FAILED)
        stream.loop.call_soon_threadsafe(on_failure, message)
    finally:
        stream.end()


# ----------------------------------------------------------------- the engine


class LlamaCppEngine(Engine):
    """A GGUF model served by llama.cpp on CPU (default: SmolLM2-135M-Instruct).

    ``n_ctx`` is the KV pool shared by the ``n_parallel`` slots (any one request may use all
    of it); ``n_threads`` defaults to llama.cpp's choice (the physical cores); ``seed`` is
    the sampling seed of requests that do not set one. ``verbose`` lets llama.cpp log.
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
        self._server: Any = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._vocab = VocabBytes(())
        self._card: ModelDeploymentCard | None = None
        #: Streams in flight, so ``stop`` can end them.
        self._live: dict[_Stream, None] = {}

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
        log.info(
            "llamacpp: loaded %s (n_ctx=%d, n_parallel=%d)",
            self.model_path,
            self.n_ctx,
            self.n_parallel,
        )

    async def stop(self) -> None:
        """End every stream (with an ``ERROR`` output), wait for the native calls to return,
        then free the model."""
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
            "n_probs": 1,
            "timings_per_token": True,
            "cache_prompt": True,
        }
        if sc.ignore_eos:
            body["ignore_eos"] = True
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
        stream = _Stream(loop=loop, queue=queue, request=request, vocab=self._vocab)

        def on_cancel(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and not stream.finished:
                stream.aborted = True
                stream.finished = True
                queue.put_nowait(
                    LLMEngineOutput(finish_reason=FinishReason.CANCELLED, usage=stream.usage())
                )

        self._live[stream] = None
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
            self._live.pop(stream, None)


def _release(holder: list[Any]) -> None:
    """Drop the last reference to the native server on this (worker) thread."""
    holder.clear()


__all__ = ["LlamaCppEngine", "VocabBytes"]
