"""The backend operator: engine token stream -> text deltas with OpenAI stop semantics.

It sits between the router's stream of ``LLMEngineOutput`` and the OpenAI response builder.
For each request, :meth:`Backend.decoder` makes a :class:`StreamDecoder`; the caller feeds it
every engine output in order and forwards the :class:`DecodedDelta` it returns.

Mental model: a token goes through three gates, in this order::

    token id ──▶ [stop id / eos?] ──▶ detokenizer ──▶ [stop-string jail] ──▶ visible text
                  ends: STOP/EOS        holds split       holds a tail that may
                  (its text hidden)     characters        still become a stop string

* **Stop ids**: ``stop_token_ids_hidden`` end the stream with ``STOP``; ``eos_token_ids`` with
  ``EOS`` unless ``ignore_eos``. The stopping token counts as generated but its text is not
  emitted.
* **Stop strings** are hidden and may span tokens. The *jail* holds the longest suffix of the
  text that is a proper prefix of some stop string; it is released as soon as it can no longer
  match, and flushed when the stream ends any other way. A full match ends the stream with
  ``STOP`` and drops the match and everything after it (of several matches in one step's
  text, the one that starts first; on a tie, the first listed). The matching is an
  Aho-Corasick automaton (``stop_strings``): O(1) per generated character whatever the
  number and length of the stop strings, O(their total length) to build, once per distinct
  list (cached).
* **min_tokens**: while the output has ``<= min_tokens`` tokens, nothing of the above stops it
  (the text of such a would-be stop is emitted like any other).
* **max_tokens**: the ``max_tokens``-th token ends the stream with ``LENGTH``; tokens an engine
  sends beyond it are cut.
* An engine ``finish_reason`` passes through (``ERROR`` with its message) if we have not
  already finished.

After a finish, every further ``step`` returns an empty delta. **The caller must stop reading
and close the upstream (``aclose()`` the engine stream) as soon as a delta carries a
finish_reason**: the engine may keep generating past a stop string or ``max_tokens``.

``step`` runs once per token for every stream, so it avoids work on the common path: a dict
lookup for stop ids, one Rust call to detokenize, and the jail only when stop strings exist
(skipped, while nothing is held, for text that holds no stop string's first character).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from turnout.protocols.llm import FinishReason, LLMEngineOutput, PreprocessedRequest

from .detokenizer import Detokenizer
from .stop_strings import StopMatcher, stop_matcher
from .tokenizer import Tokenizer


@dataclass(slots=True)
class DecodedDelta:
    """What one engine output became: new visible text, the ids it covers, maybe a finish."""

    text: str = ""
    #: Token ids accepted from this output (a stopping id included; ids past a finish cut).
    #: May be the engine output's own list: treat it as read-only.
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    #: Why, when ``finish_reason`` is ``ERROR``.
    error: str | None = None
    #: The log probability of each of ``token_ids``, when the request asked and the engine
    #: reported them.
    log_probs: list[float] | None = None
    #: Each of ``token_ids``' most likely alternatives, ``(id, log prob)`` most likely first,
    #: when the request asked for some (``top_logprobs``).
    top_logprobs: list[list[tuple[int, float]]] | None = None


class Backend:
    """Post-processing for one model: makes a decoder per request."""

    __slots__ = ("tokenizer",)

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def decoder(self, request: PreprocessedRequest) -> StreamDecoder:
        return StreamDecoder(self.tokenizer, request)


class StreamDecoder:
    """Turns one request's engine outputs into text deltas. See the module docstring.

    Fields written only by ``step``: ``num_output_tokens`` (ids accepted so far),
    ``cached_tokens`` (from the engine's usage, when it reports it), ``finish_reason``.
    """

    __slots__ = (
        "_armed",
        "_detok",
        "_held",
        "_max_tokens",
        "_min_tokens",
        "_state",
        "_stop_ids",
        "_stops",
        "cached_tokens",
        "finish_reason",
        "matched_stop",
        "num_output_tokens",
        "num_prompt_tokens",
        "step",
    )

    def __init__(self, tokenizer: Tokenizer, request: PreprocessedRequest) -> None:
        sc = request.stop_conditions
        self._detok = Detokenizer(
            tokenizer,
            skip_special_tokens=request.output_options.skip_special_tokens,
            context_ids=request.token_ids,
        )
        stop_ids: dict[int, FinishReason] = {}
        if not sc.ignore_eos:
            for tid in request.eos_token_ids:
                stop_ids[tid] = FinishReason.EOS
        for tid in sc.stop_token_ids_hidden or ():
            stop_ids[tid] = FinishReason.STOP
        self._stop_ids = stop_ids
        stops = tuple(s for s in (sc.stop or ()) if s)
        #: The stop strings' automaton (None: no stop strings, no jail).
        self._stops: StopMatcher | None = stop_matcher(stops) if stops else None
        #: The automaton's state after the text so far; ``_held`` is its last
        #: ``_stops.hold(_state)`` characters.
        self._state = 0
        #: Whether a stop may end the stream yet (``min_tokens`` passed): a match completed
        #: before that is text like any other.
        self._armed = False
        self._max_tokens = sc.max_tokens if sc.max_tokens is not None else -1
        self._min_tokens = sc.min_tokens or 0
        #: Text held back because it may be the start of a stop string.
        self._held = ""
        self.num_prompt_tokens = len(request.token_ids)
        self.num_output_tokens = 0
        self.cached_tokens: int | None = None
        self.finish_reason: FinishReason | None = None
        #: The stop string that ended the stream, if one did (Anthropic's ``stop_sequence``).
        self.matched_stop: str | None = None
        #: Process one engine output (the new ids since the previous one). Requests that
        #: asked for alternatives take a wrapper that carries them; the rest pay nothing.
        self.step = self._step_with_alternatives if request.output_options.logprobs else self._step

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _step_with_alternatives(self, output: LLMEngineOutput) -> DecodedDelta:
        delta = self._step(output)
        tops = output.top_logprobs
        if tops is not None and delta.token_ids:
            delta.top_logprobs = tops[: len(delta.token_ids)]
        return delta

    def _step(self, output: LLMEngineOutput) -> DecodedDelta:
        if self.finish_reason is not None:
            return DecodedDelta()
        usage = output.usage
        if usage is not None and usage.cached_tokens is not None:
            self.cached_tokens = usage.cached_tokens

        ids = output.token_ids
        if len(ids) == 1 and output.finish_reason is None:
            # Fast path: one token, no finish from the engine (nearly every step). Same
            # rules as the loop below, fewer branches and no list building.
            tid = ids[0]
            n = self.num_output_tokens + 1
            may_stop = n > self._min_tokens
            if n != self._max_tokens and not (may_stop and tid in self._stop_ids):
                self.num_output_tokens = n
                text = self._detok.step(tid)
                lps = output.log_probs
                if not text or self._stops is None:
                    return DecodedDelta(text, ids, log_probs=lps)
                text, matched = self._jail(text, may_stop)
                if not matched:
                    return DecodedDelta(text, ids, log_probs=lps)
                return self._finish([text], ids, FinishReason.STOP, matched=True, log_probs=lps)
        elif (
            len(ids) > 1
            and self._stops is None
            and self._stop_ids.keys().isdisjoint(ids)
            and (self._max_tokens < 0 or self.num_output_tokens + len(ids) < self._max_tokens)
        ):
            # Fast path for a burst (a worker merges the outputs its engine produced in one
            # event-loop turn): no id can stop it, so the ids go to the detokenizer in one
            # Rust call; it yields the same text as one step per id.
            self.num_output_tokens += len(ids)
            text = self._detok.step_many(ids)
            reason = output.finish_reason
            lps = output.log_probs
            if reason is None:
                return DecodedDelta(text, ids, log_probs=lps)
            error = (
                (output.error or "the engine reported an error")
                if reason is FinishReason.ERROR
                else None
            )
            return self._finish(
                [text] if text else [], ids, reason, matched=False, error=error, log_probs=lps
            )

        accepted: list[int] = []
        pieces: list[str] = []
        reason = None
        matched = False  # ended by a stop string: what follows the match is dropped
        stop_ids = self._stop_ids
        detok = self._detok
        for tid in ids:
            n = self.num_output_tokens = self.num_output_tokens + 1
            accepted.append(tid)
            may_stop = n > self._min_tokens
            if may_stop:
                reason = stop_ids.get(tid)
                if reason is not None:
                    break
            text = detok.step(tid)
            if text:
                if self._stops is not None:
                    text, matched = self._jail(text, may_stop)
                    if text:
                        pieces.append(text)
                    if matched:
                        reason = FinishReason.STOP
                        break
                else:
                    pieces.append(text)
            if n == self._max_tokens:
                reason = FinishReason.LENGTH
                break
        else:
            if not ids and output.text:  # an engine that sends text without ids
                text = output.text
                if self._stops is not None:
                    text, matched = self._jail(text, self.num_output_tokens >= self._min_tokens)
                if text:
                    pieces.append(text)
                if matched:
                    reason = FinishReason.STOP
            if reason is None and output.finish_reason is not None:
                reason = output.finish_reason

        lps = output.log_probs[: len(accepted)] if output.log_probs else None
        if reason is None:
            text = pieces[0] if len(pieces) == 1 else "".join(pieces)
            return DecodedDelta(text, accepted, log_probs=lps)
        error = None
        if reason is FinishReason.ERROR:
            error = output.error or "the engine reported an error"
        return self._finish(pieces, accepted, reason, matched=matched, error=error, log_probs=lps)

    def _finish(
        self,
        pieces: list[str],
        accepted: list[int],
        reason: FinishReason,
        *,
        matched: bool,
        error: str | None = None,
        log_probs: list[float] | None = None,
    ) -> DecodedDelta:
        """The one place a stream's state becomes finished."""
        self.finish_reason = reason
        if not matched:
            # Ending other than by a stop-string match: release what the jail and the
            # detokenizer still hold; no more text can complete a match.
            tail = self._detok.flush()
            if self._held or tail:
                pieces.append(self._held + tail)
        self._held = ""
        return DecodedDelta("".join(pieces), accepted, reason, error, log_probs)

    def end(self, reason: FinishReason, error: str | None = None) -> DecodedDelta:
        """Finish now, as if the engine had reported ``reason``: for an upstream that ended
        without a finish_reason, or a request cancelled from above. Releases held text."""
        return self.step(LLMEngineOutput(finish_reason=reason, error=error))

    def _jail(self, text: str, may_stop: bool) -> tuple[str, bool]:
        """Add ``text`` behind the held text; return (text now safe to emit, matched)."""
        stops = self._stops
        assert stops is not None
        held = self._held
        if may_stop and not self._armed:
            # The first step that may stop: a stop string wholly inside the held text counts
            # from now on, so the held text is scanned again with the new text.
            self._armed = True
            if held:
                text, held = held + text, ""
                self._held, self._state = "", 0
        state = self._state
        if not state and stops.first_chars.isdisjoint(text):
            return text, False  # nothing held, nothing that could start a stop string
        state, start, index = stops.scan(state, text, len(held), may_stop)
        buf = held + text if held else text
        if start >= 0:
            self.matched_stop = stops.stops[index]
            self._held, self._state = "", 0
            return buf[:start], True
        self._state = state
        keep = stops.hold(state)
        if not keep:
            self._held = ""
            return buf, False
        cut = len(buf) - keep
        self._held = buf[cut:]
        return buf[:cut], False


__all__ = ["Backend", "DecodedDelta", "StreamDecoder"]
