"""The backend operator: stop ids, stop strings (the jail), min/max tokens, pass-through."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnout.llm.backend import Backend, DecodedDelta, StreamDecoder
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.llm import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    OutputOptions,
    PreprocessedRequest,
    StopConditions,
)

EOS = 2  # <|im_end|> in SmolLM2


def char_ids(tok: Tokenizer, text: str) -> list[int]:
    """Token ids with every character tokenized on its own: every multi-character stop
    string then spans several tokens."""
    return [i for ch in text for i in tok.encode(ch)]


def make_decoder(
    tok: Tokenizer,
    *,
    stop: list[str] | None = None,
    stop_ids: list[int] | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    ignore_eos: bool = False,
    skip_special_tokens: bool = True,
) -> StreamDecoder:
    req = PreprocessedRequest(
        model="m",
        token_ids=tok.encode("prompt"),
        stop_conditions=StopConditions(
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids_hidden=stop_ids,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
        ),
        output_options=OutputOptions(skip_special_tokens=skip_special_tokens),
        eos_token_ids=[EOS],
    )
    return Backend(tok).decoder(req)


def run(
    dec: StreamDecoder, ids: list[int], chunk: int = 1, engine_finish: FinishReason | None = None
) -> tuple[str, FinishReason | None, list[DecodedDelta]]:
    """Feed ids ``chunk`` at a time, as an engine would, until a finish comes back."""
    deltas: list[DecodedDelta] = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        out = LLMEngineOutput(
            token_ids=ids[i : i + chunk], finish_reason=engine_finish if last else None
        )
        deltas.append(dec.step(out))
        if deltas[-1].finish_reason is not None:
            break
    text = "".join(d.text for d in deltas)
    return text, deltas[-1].finish_reason if deltas else None, deltas


# ------------------------------------------------------------------ plain text


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_multibyte_text_streams_cleanly(smol_tokenizer: Tokenizer, chunk: int) -> None:
    text = "emoji 😀👍🏽 and 你好，世界 done"  # noqa: RUF001
    ids = smol_tokenizer.encode(text)
    dec = make_decoder(smol_tokenizer)
    out, finish, deltas = run(dec, ids, chunk, engine_finish=FinishReason.STOP)
    assert all("\ufffd" not in d.text for d in deltas)
    assert out == text == smol_tokenizer.decode(ids)
    assert finish is FinishReason.STOP
    assert dec.num_output_tokens == len(ids)
    assert [t for d in deltas for t in d.token_ids] == ids


# ------------------------------------------------------------------ stop strings


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello STOP world", ["STOP"], "hello "),  # spans tokens, text before it visible
        ("STOP at the start", ["STOP"], ""),
        ("xx abcd yy", ["abc", "ab"], "xx "),  # overlapping: the earliest wins
        ("xx abd abc yy", ["abc"], "xx abd "),  # a false start "ab" is released
        ("tail ab", ["abc"], "tail ab"),  # flushed at the end: it never completed
        ("a b c", ["b c", "c"], "a "),
        ("no match here", ["zzz"], "no match here"),
        ("emoji 😀 stop 😀 here", ["😀 here"], "emoji 😀 stop "),
    ],
)
@pytest.mark.parametrize("split", ["chars", "natural"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_strings(
    smol_tokenizer: Tokenizer, text: str, stops: list[str], expected: str, split: str, chunk: int
) -> None:
    ids = char_ids(smol_tokenizer, text) if split == "chars" else smol_tokenizer.encode(text)
    dec = make_decoder(smol_tokenizer, stop=stops)
    out, finish, deltas = run(dec, ids, chunk, engine_finish=FinishReason.LENGTH)
    assert out == expected
    matched = any(s in text for s in stops)
    assert finish is (FinishReason.STOP if matched else FinishReason.LENGTH)
    assert all("\ufffd" not in d.text for d in deltas)


def reference_stop(text: str, stops: list[str]) -> str:
    """OpenAI semantics, one character at a time: cut at the first stop string to
    complete (the longest, if several complete at once)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if s and text[:end].endswith(s)]
        if starts:
            return text[: min(starts)]
    return text


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab c😀你", max_size=24),
    stops=st.lists(st.text(alphabet="ab c😀你", min_size=1, max_size=4), min_size=1, max_size=3),
    chunk=st.integers(1, 4),
)
def test_stop_strings_match_reference(
    smol_tokenizer: Tokenizer, text: str, stops: list[str], chunk: int
) -> None:
    ids = char_ids(smol_tokenizer, text)
    out, _, deltas = run(make_decoder(smol_tokenizer, stop=stops), ids, 1, FinishReason.LENGTH)
    assert out == reference_stop(text, stops)
    assert all("\ufffd" not in d.text for d in deltas)
    # Any chunking, any tokenization: the output is a prefix of the text holding no stop
    # string, and all of the text when none occurs.
    natural = smol_tokenizer.encode(text)
    out, _, _ = run(make_decoder(smol_tokenizer, stop=stops), natural, chunk, FinishReason.LENGTH)
    assert text.startswith(out)
    assert not any(s in out for s in stops)
    if not any(s in text for s in stops):
        assert out == text


def test_jail_holds_only_possible_prefixes(smol_tokenizer: Tokenizer) -> None:
    dec = make_decoder(smol_tokenizer, stop=["</answer>"])
    seen = []
    for i in char_ids(smol_tokenizer, "x</ans"):
        seen.append(dec.step(LLMEngineOutput(token_ids=[i])).text)
    assert seen == ["x", "", "", "", "", ""]
    # "</anz" cannot become "</answer>" any more: released at once.
    assert dec.step(LLMEngineOutput(token_ids=smol_tokenizer.encode("z"))).text == "</ansz"


def test_stop_match_drops_rest_of_the_output(smol_tokenizer: Tokenizer) -> None:
    dec = make_decoder(smol_tokenizer, stop=["END"])
    ids = smol_tokenizer.encode("done END and more text")
    delta = dec.step(LLMEngineOutput(token_ids=ids))
    assert delta.text == "done "
    assert delta.finish_reason is FinishReason.STOP
    assert len(delta.token_ids) < len(ids)
    assert dec.num_output_tokens == len(delta.token_ids)


# ------------------------------------------------------------------ stop ids, eos


def test_eos_ends_the_stream_and_is_hidden(smol_tokenizer: Tokenizer) -> None:
    ids = [*smol_tokenizer.encode("Hi there"), EOS, *smol_tokenizer.encode(" extra")]
    dec = make_decoder(smol_tokenizer, skip_special_tokens=False)
    out, finish, deltas = run(dec, ids)
    assert (out, finish) == ("Hi there", FinishReason.EOS)
    assert deltas[-1].token_ids == [EOS]
    assert dec.num_output_tokens == len(smol_tokenizer.encode("Hi there")) + 1


def test_ignore_eos_keeps_going(smol_tokenizer: Tokenizer) -> None:
    ids = [*smol_tokenizer.encode("Hi"), EOS, *smol_tokenizer.encode(" more")]
    dec = make_decoder(smol_tokenizer, ignore_eos=True)
    out, finish, _ = run(dec, ids, engine_finish=FinishReason.LENGTH)
    assert (out, finish) == ("Hi more", FinishReason.LENGTH)
    dec = make_decoder(smol_tokenizer, ignore_eos=True, skip_special_tokens=False)
    out, _, _ = run(dec, ids, engine_finish=FinishReason.LENGTH)
    assert out == "Hi<|im_end|> more"


def test_stop_token_ids(smol_tokenizer: Tokenizer) -> None:
    stop_id = smol_tokenizer.encode(" world")[0]
    ids = smol_tokenizer.encode("hello world again")
    dec = make_decoder(smol_tokenizer, stop_ids=[stop_id], ignore_eos=True)
    out, finish, _ = run(dec, ids)
    assert (out, finish) == ("hello", FinishReason.STOP)


def test_stop_id_flushes_jailed_text(smol_tokenizer: Tokenizer) -> None:
    ids = [*smol_tokenizer.encode("value: ab"), EOS]
    dec = make_decoder(smol_tokenizer, stop=["abc"])
    out, finish, _ = run(dec, ids)
    assert (out, finish) == ("value: ab", FinishReason.EOS)


# ------------------------------------------------------------------ min / max tokens


def test_min_tokens_defers_every_stop(smol_tokenizer: Tokenizer) -> None:
    ids = [EOS, *char_ids(smol_tokenizer, "a STOP b"), EOS]
    n = len(ids)
    dec = make_decoder(smol_tokenizer, stop=["STOP"], min_tokens=n - 1)
    out, finish, _ = run(dec, ids)
    # The first EOS and the stop string fall within min_tokens: they do not stop.
    assert (out, finish) == ("a STOP b", FinishReason.EOS)
    assert dec.num_output_tokens == n


def test_min_tokens_boundary(smol_tokenizer: Tokenizer) -> None:
    ids = [*smol_tokenizer.encode("x"), EOS, EOS]
    # Token 2 (the first EOS) is within min_tokens=2; token 3 may stop.
    dec = make_decoder(smol_tokenizer, min_tokens=2)
    _, finish, _ = run(dec, ids)
    assert finish is FinishReason.EOS
    assert dec.num_output_tokens == 3
    dec = make_decoder(smol_tokenizer, min_tokens=1)
    run(dec, ids)
    assert dec.num_output_tokens == 2


@pytest.mark.parametrize("chunk", [1, 4, 50])
def test_max_tokens_cuts_engine_overshoot(smol_tokenizer: Tokenizer, chunk: int) -> None:
    ids = char_ids(smol_tokenizer, "abcdefghijklmnop")
    dec = make_decoder(smol_tokenizer, max_tokens=5)
    out, finish, deltas = run(dec, ids, chunk)
    assert (out, finish) == ("abcde", FinishReason.LENGTH)
    assert dec.num_output_tokens == 5
    assert sum(len(d.token_ids) for d in deltas) == 5


def test_max_tokens_flushes_jail(smol_tokenizer: Tokenizer) -> None:
    dec = make_decoder(smol_tokenizer, stop=["STOP"], max_tokens=4)
    out, finish, _ = run(dec, char_ids(smol_tokenizer, "abST"))
    assert (out, finish) == ("abST", FinishReason.LENGTH)


# ------------------------------------------------------------------ engine pass-through


def test_engine_error_passes_through(smol_tokenizer: Tokenizer) -> None:
    dec = make_decoder(smol_tokenizer, stop=["zz"])
    assert dec.step(LLMEngineOutput(token_ids=smol_tokenizer.encode("partial z"))).text == (
        "partial "
    )
    delta = dec.step(LLMEngineOutput(finish_reason=FinishReason.ERROR, error="out of memory"))
    assert delta.finish_reason is FinishReason.ERROR
    assert delta.error == "out of memory"
    assert delta.text == "z"  # the jail is released on any finish


def test_after_finish_steps_are_empty(smol_tokenizer: Tokenizer) -> None:
    dec = make_decoder(smol_tokenizer)
    dec.step(LLMEngineOutput(token_ids=[EOS]))
    assert dec.finished
    after = dec.step(LLMEngineOutput(token_ids=smol_tokenizer.encode("late")))
    assert after == DecodedDelta()
    assert dec.num_output_tokens == 1


def test_end_flushes_and_finishes(smol_tokenizer: Tokenizer) -> None:
    dec = make_decoder(smol_tokenizer, stop=["STOP"])
    assert dec.step(LLMEngineOutput(token_ids=char_ids(smol_tokenizer, "ok ST"))).text == "ok "
    delta = dec.end(FinishReason.CANCELLED)
    assert (delta.text, delta.finish_reason) == ("ST", FinishReason.CANCELLED)
    assert dec.end(FinishReason.ERROR) == DecodedDelta()


def test_usage_cached_tokens(smol_tokenizer: Tokenizer) -> None:
    dec = make_decoder(smol_tokenizer)
    assert dec.cached_tokens is None
    assert dec.num_prompt_tokens == len(smol_tokenizer.encode("prompt"))
    dec.step(
        LLMEngineOutput(
            token_ids=smol_tokenizer.encode("a"),
            finish_reason=FinishReason.LENGTH,
            usage=CompletionUsage(prompt_tokens=1, completion_tokens=1, cached_tokens=16),
        )
    )
    assert dec.cached_tokens == 16


def test_text_only_output(smol_tokenizer: Tokenizer) -> None:
    dec = make_decoder(smol_tokenizer, stop=["!"])
    assert dec.step(LLMEngineOutput(text="hi")).text == "hi"
    delta = dec.step(LLMEngineOutput(text=" you! more"))
    assert (delta.text, delta.finish_reason) == (" you", FinishReason.STOP)


def test_step_is_cheap(smol_tokenizer: Tokenizer) -> None:
    """A loose bound (shared CI machine): a step with stop strings stays well under 50 µs."""
    ids = smol_tokenizer.encode("The quick brown fox jumps over the lazy dog. 😀 " * 100)
    dec = make_decoder(smol_tokenizer, stop=["</s>", "Observation:"], ignore_eos=True)
    outs = [LLMEngineOutput(token_ids=[i]) for i in ids]
    start = time.perf_counter()
    for o in outs:
        dec.step(o)
    per_step = (time.perf_counter() - start) / len(outs)
    assert per_step < 50e-6, f"{per_step * 1e6:.1f} µs per step"


# ------------------------------------------------------------------ log probabilities


@pytest.mark.parametrize("chunk", [1, 3, 10])
def test_log_probs_follow_the_accepted_ids(smol_tokenizer: Tokenizer, chunk: int) -> None:
    """Each delta carries the log probs of exactly the ids it accepted: a burst cut by
    max_tokens keeps only the accepted ones."""
    ids = char_ids(smol_tokenizer, "abcdefghij")
    dec = make_decoder(smol_tokenizer, max_tokens=7)
    deltas = []
    for i in range(0, len(ids), chunk):
        part = ids[i : i + chunk]
        out = LLMEngineOutput(token_ids=part, log_probs=[-float(i + k) for k in range(len(part))])
        deltas.append(dec.step(out))
        if deltas[-1].finish_reason is not None:
            break
    accepted = [t for d in deltas for t in d.token_ids]
    values = [v for d in deltas for v in (d.log_probs or [])]
    assert len(accepted) == 7 and values == [-float(k) for k in range(7)]
