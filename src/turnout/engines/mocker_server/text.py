"""Output ids to text for one choice: incremental detokenization and stop strings.

The engine gives ids; a real server gives text too, and ends a choice at the first of its
``stop`` strings, which never reaches the client. Text that may still turn out to begin a
stop string is held back (the *jail*) until the next characters settle it, so a client never
sees half a stop string; the automaton of ``llm.stop_strings`` tracks that in O(1) a
character. Token ids are not held: ``token_ids`` report every id the engine produced, as
vLLM's do.
"""

from __future__ import annotations

from collections.abc import Sequence

from turnout.llm.detokenizer import Detokenizer
from turnout.llm.stop_strings import StopMatcher, stop_matcher
from turnout.llm.tokenizer import Tokenizer

#: Most stop strings per request, and characters per stop string (turnout's frontend limits).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class TextStream:
    """One choice's text as its ids arrive. Not thread-safe; one per choice."""

    __slots__ = ("_detok", "_held", "_matcher", "_state", "stopped_by")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        self._detok = Detokenizer(
            tokenizer, skip_special_tokens=skip_special_tokens, context_ids=prompt_ids
        )
        self._matcher: StopMatcher | None = stop_matcher(tuple(stop)) if stop else None
        self._state = 0
        self._held = ""
        #: The stop string that ended the choice, once one did.
        self.stopped_by: str | None = None

    def feed(self, ids: Sequence[int]) -> str:
        """The text to send for ``ids`` (may be "" while a character or a stop is pending).
        Once a stop string matched (``stopped_by``), the choice is over: feed no more."""
        return self._jail(self._detok.step_many(ids))

    def finish(self) -> str:
        """The text still held when the choice ends (its last ids completed nothing)."""
        text = self._jail(self._detok.flush())
        if self.stopped_by is None:
            text += self._held
            self._held = ""
        return text

    def _jail(self, delta: str) -> str:
        matcher = self._matcher
        if matcher is None or self.stopped_by is not None:
            return delta if self.stopped_by is None else ""
        if not delta:
            return ""
        held = self._held
        self._state, start, index = matcher.scan(self._state, delta, len(held), True)
        text = held + delta
        if start >= 0:
            self.stopped_by = matcher.stops[index]
            self._held = ""
            return text[:start]
        keep = matcher.hold(self._state)
        cut = len(text) - keep
        self._held = text[cut:]
        return text[:cut]
