"""The stop-string automaton and the jail built on it, against the prefix-table jail it
replaced (kept here as the reference of the semantics): same text released, same text held,
same match, for any stop strings and any cut of the text into pieces."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnout.llm.backend import Backend, StreamDecoder
from turnout.llm.stop_strings import StopMatcher, stop_matcher
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.llm import (
    FinishReason,
    LLMEngineOutput,
    OutputOptions,
    PreprocessedRequest,
    StopConditions,
)


@dataclass
class PrefixTableJail:
    """The jail as it was: every proper prefix of every stop string, longest first."""

    stops: list[str]
    held: str = ""
    matched_stop: str | None = None

    def __post_init__(self) -> None:
        self.stops = [s for s in self.stops if s]
        prefixes = {s[:k] for s in self.stops for k in range(1, len(s))}
        self.prefixes = sorted(prefixes, key=len, reverse=True)

    def feed(self, text: str, may_stop: bool = True) -> tuple[str, bool]:
        buf = self.held + text
        if may_stop:
            cut = -1
            for s in self.stops:
                i = buf.find(s)
                if i >= 0 and (cut < 0 or i < cut):
                    cut = i
                    self.matched_stop = s
            if cut >= 0:
                self.held = ""
                return buf[:cut], True
        for prefix in self.prefixes:
            if buf.endswith(prefix):
                self.held = prefix
                return buf[: len(buf) - len(prefix)], False
        self.held = ""
        return buf, False


def text_decoder(tok: Tokenizer, stops: list[str], min_tokens: int | None = None) -> StreamDecoder:
    req = PreprocessedRequest(
        model="m",
        token_ids=tok.encode("prompt"),
        stop_conditions=StopConditions(stop=stops, ignore_eos=True, min_tokens=min_tokens),
        output_options=OutputOptions(),
    )
    return Backend(tok).decoder(req)


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


ALPHABET = "ab c😀\n"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=30),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=6), min_size=1, max_size=5),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_jail_matches_the_prefix_table(
    smol_tokenizer: Tokenizer, text: str, stops: list[str], cuts: list[int]
) -> None:
    """Piece by piece (an engine that sends text), the released text, the match and the
    held text are the reference's."""
    ref = PrefixTableJail(stops)
    dec = text_decoder(smol_tokenizer, stops)
    for piece in pieces_of(text, cuts):
        want_text, want_match = ref.feed(piece)
        delta = dec.step(LLMEngineOutput(text=piece))
        assert delta.text == want_text
        assert (delta.finish_reason is FinishReason.STOP) == want_match
        if want_match:
            assert dec.matched_stop == ref.matched_stop
            break
    else:
        # What is held comes out, and only it, when the stream ends otherwise.
        assert dec.end(FinishReason.LENGTH).text == ref.held


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=20),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=5), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 25), max_size=8),
    armed_at=st.integers(0, 6),
)
def test_min_tokens_arming_matches_the_prefix_table(
    text: str, stops: list[str], cuts: list[int], armed_at: int
) -> None:
    """The jail while stops may not stop yet, then once they may: a stop string completed
    inside the held text counts from the first step that may stop (as the reference's
    search of held + new text does)."""
    ref = PrefixTableJail(stops)
    matcher = stop_matcher(tuple(s for s in stops if s))
    state, held, armed = 0, "", False
    for i, piece in enumerate(pieces_of(text, cuts)):
        may_stop = i >= armed_at
        want_text, want_match = ref.feed(piece, may_stop)
        # The decoder's jail, spelled out on the automaton.
        if may_stop and not armed:
            armed = True
            piece, held, state = held + piece, "", 0
        state, start, index = matcher.scan(state, piece, len(held), may_stop)
        buf = held + piece
        if start >= 0:
            assert (buf[:start], True) == (want_text, want_match)
            assert matcher.stops[index] == ref.matched_stop
            return
        keep = matcher.hold(state)
        held = buf[len(buf) - keep :] if keep else ""
        assert (buf[: len(buf) - keep], False) == (want_text, want_match)
        assert held == ref.held


def test_min_tokens_counts_a_stop_held_before_it_may_stop(smol_tokenizer: Tokenizer) -> None:
    """Stops "abc" and "b": "ab" arrives while stops may not stop (held: it may become
    "abc"); the next token may stop, and "b" inside the held text ends the stream."""
    ids = [t for ch in "abx" for t in smol_tokenizer.encode(ch)]
    dec = text_decoder(smol_tokenizer, ["abc", "b"], min_tokens=2)
    texts = [dec.step(LLMEngineOutput(token_ids=[i])) for i in ids]
    assert [d.text for d in texts] == ["", "", "a"]
    assert texts[-1].finish_reason is FinishReason.STOP
    assert dec.matched_stop == "b"


def test_automaton_is_linear_in_the_stop_length() -> None:
    """One node a character: a stop string of 100,000 characters costs 100,001 nodes, not
    the 5 billion characters of its prefixes."""
    long = "ab" * 50_000
    matcher = StopMatcher((long,))
    assert matcher.num_nodes == len(long) + 1
    state, start, _ = matcher.scan(0, "xx" + long[:-1], 0, True)
    assert start == -1 and matcher.hold(state) == len(long) - 1
    state, start, index = matcher.scan(state, long[-1] + "tail", len(long) - 1, True)
    assert (start, index) == (0, 0)


@pytest.mark.parametrize(
    ("stops", "text", "start", "stop"),
    [
        (("abcd", "c"), "xabcd", 1, "abcd"),  # the earliest start wins, even ending later
        (("ab", "abc"), "abc", 0, "ab"),  # same start: the first listed
        (("abc", "ab"), "abc", 0, "abc"),
        (("b", "ab"), "ab", 0, "ab"),
        (("a", "a"), "a", 0, "a"),
    ],
)
def test_which_match_wins(stops: tuple[str, ...], text: str, start: int, stop: str) -> None:
    matcher = StopMatcher(stops)
    _, got, index = matcher.scan(0, text, 0, True)
    assert (got, matcher.stops[index]) == (start, stop)


def test_cache_shares_and_is_bounded() -> None:
    stops = ("</s>", "Observation:")
    assert stop_matcher(stops) is stop_matcher(stops)
    big = ("x" * 40_000,)  # over a quarter of the cache: built, not kept
    assert stop_matcher(big) is not stop_matcher(big)


def test_refuses_empty_stops() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(("a", ""))
