"""One request of the llama.cpp engine, from its native call on a pool thread to the outputs
the event loop reads.

``run_native`` takes a slot for the request (``slots``) and drives llama.cpp's blocking
``handle_completions`` on it, on a pool thread; every streamed chunk reaches
``RequestStream.on_chunk`` there, which turns it into an ``LLMEngineOutput`` (token ids,
recovered held-back ids, log probabilities, stop ids, usage) and hands it to the loop's queue;
its return value tells llama.cpp to stop. The stream also turns llama.cpp's running timings
into step samples for the load tracker (``load``).

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
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any, Final

import msgspec

from turnout.protocols.llm import (
    CompletionUsage,
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
)

from .completion import Timings, alternatives, decode_chunk, pin_slot
from .load import WAITING, LoadTracker
from .slots import Claim, SlotTable
from .vocab import VocabBytes

#: A decoding request offers one decode sample per this much of its ``predicted_ms``.
DECODE_SAMPLE_MS: Final = 100.0


class End:
    """Queue marker: the native call returned (after a final output, or without one)."""


END: Final = End()


class RequestStream:
    """One request's state. ``on_chunk`` runs on a pool thread; ``aborted`` is written by the
    event loop thread (a plain attribute store: atomic under the GIL, read at every chunk)."""

    __slots__ = (
        "aborted",
        "cache_salt",
        "cached_tokens",
        "claim",
        "decoding",
        "eos_ids",
        "finished",
        "load",
        "loop",
        "max_tokens",
        "num_tokens",
        "phase",
        "prompt_tokens",
        "queue",
        "slots",
        "stop_ids",
        "timed_ms",
        "timed_n",
        "token_ids",
        "vocab",
        "want_logprobs",
        "want_top",
    )

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue[LLMEngineOutput | End],
        request: PreprocessedRequest,
        vocab: VocabBytes,
        load: LoadTracker,
        slots: SlotTable,
    ) -> None:
        sc = request.stop_conditions
        self.loop = loop
        self.queue = queue
        self.vocab = vocab
        self.load = load
        self.slots = slots
        #: Pool thread: the slot the request holds (None before it takes one, and once given
        #: back).
        self.claim: Claim | None = None
        self.cache_salt = request.cache_salt
        self.token_ids = request.token_ids
        self.prompt_tokens = len(request.token_ids)
        self.max_tokens = sc.max_tokens
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
        #: Loop thread: ``WAITING`` / ``RUNNING`` / ``DONE``, and whether its first token
        #: came (the load tracker's view).
        self.phase = WAITING
        self.decoding = False
        #: Pool thread: ``predicted_n``/``predicted_ms`` at the last decode sample (-1: no
        #: chunk with timings yet).
        self.timed_n = -1
        self.timed_ms = 0.0

    @property
    def prompt_processed(self) -> bool:
        """Whether llama.cpp processed the prompt: a chunk with timings came (the first token's
        chunk carries them; a refusal or an error does not)."""
        return self.cached_tokens is not None

    def take_slot(self) -> Claim:
        """Take a slot for the request (pool thread): ``slots.choose_slot`` over the free ones."""
        self.claim = self.slots.acquire(self.cache_salt, self.token_ids)
        return self.claim

    def give_slot_back(self) -> None:
        """Give the request's slot back, once (pool thread). Called as soon as the stream's
        last output is decided, before it is queued, so that the request that follows it (a
        conversation's next turn) finds the slot free, its prompt cached; llama.cpp frees
        the slot itself right after it sends the last chunk, and a task pinned to a slot it
        has not freed yet waits in llama.cpp for that."""
        claim, self.claim = self.claim, None
        if claim is not None:
            self.slots.release(claim, self.token_ids, prompt_processed=self.prompt_processed)

    def usage(self) -> CompletionUsage:
        return CompletionUsage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.num_tokens,
            cached_tokens=self.cached_tokens,
        )

    def _put(self, item: LLMEngineOutput | End) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def fail(self, message: str, kind: ErrorKind | None = None) -> None:
        """End the stream with an error (pool thread)."""
        self.finished = True
        self.give_slot_back()
        self._put(
            LLMEngineOutput(
                finish_reason=FinishReason.ERROR,
                error=message,
                error_kind=kind.value if kind is not None else None,
                usage=self.usage(),
            )
        )

    def end(self) -> None:
        self._put(END)

    def on_chunk(self, data: bytes) -> bool:
        """Turn one chunk into an output on the queue. Returns True to stop llama.cpp."""
        if self.aborted or self.finished:
            return True
        try:
            chunk = decode_chunk(data)
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
                tops.extend(alternatives(e, self.want_top) for e in entries)
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
        max_tokens = self.max_tokens
        if finish is None and ids and max_tokens is not None and self.num_tokens >= max_tokens:
            # The last token llama.cpp decodes: end here, with the usage. Its own last chunk
            # (no token) follows, but a consumer that counts tokens stops first, and would
            # never see the usage (the cached prompt tokens).
            finish = FinishReason.LENGTH
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
        if self.finished:
            self.give_slot_back()
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

    def _sample(self, timings: Timings) -> None:
        """Turn llama.cpp's running timings into step samples, handed to the loop: the
        prefill at the first chunk, then one decode sample per ``DECODE_SAMPLE_MS`` of
        generation (the mean seconds per token over that span)."""
        n, ms = timings.predicted_n, timings.predicted_ms
        if n is None or ms is None:
            return
        if self.timed_n < 0:
            self.timed_n, self.timed_ms = n, ms
            prompt_n = timings.prompt_n or 0
            seconds = (timings.prompt_ms or 0.0) / 1000.0
            self.loop.call_soon_threadsafe(self.load.first_token, self, prompt_n, seconds)
        elif n > self.timed_n and ms - self.timed_ms >= DECODE_SAMPLE_MS:
            per_token = (ms - self.timed_ms) / 1000.0 / (n - self.timed_n)
            self.timed_n, self.timed_ms = n, ms
            self.loop.call_soon_threadsafe(self.load.decoded, per_token)


def run_native(
    server: Any, body: bytes, stream: RequestStream, on_failure: Callable[[str], None]
) -> None:
    """The blocking part, on a pool thread: take a slot for the request (``slots``), drive
    the request to its end on it, give the slot back (on every path: at the stream's last
    output, or when the native call returns). A native exception is the engine's failure:
    the stream ends as ``engine_failed`` and ``on_failure`` is called on the event loop. The
    load tracker hears, on the loop, when the request takes its slot and when it gives it
    back."""
    loop = stream.loop
    started = False
    try:
        if not stream.aborted:
            claim = stream.take_slot()
            started = True
            loop.call_soon_threadsafe(stream.load.started, stream)
            server.handle_completions(pin_slot(body, claim.slot, claim.reuse), stream.on_chunk)
    except Exception as e:
        message = f"llama.cpp failed: {e!r}"
        if not stream.finished:
            stream.fail(message, ErrorKind.ENGINE_FAILED)
        loop.call_soon_threadsafe(on_failure, message)
    finally:
        stream.give_slot_back()
        if started:
            loop.call_soon_threadsafe(stream.load.ended, stream)
        stream.end()
