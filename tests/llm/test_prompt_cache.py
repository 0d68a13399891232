"""The prompt cache: a prompt's ids through the cache are exactly its ids encoded whole, for
every kind of tokenizer, warm or cold, under eviction and across threads; the cache stays
within its bound and counts what it did."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.llm.tokenizer_zoo import CHATML_SPECIALS, HOSTILE_TOKENS, LLAMA3_SPECIALS, ZOO

from turnout.llm.prompt_cache import PromptCache
from turnout.llm.token_boundaries import TokenBoundaries
from turnout.llm.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def zoo(smol_tokenizer: Tokenizer) -> dict[str, Tokenizer]:
    return {"smollm2": smol_tokenizer, **{name: make() for name, make in ZOO.items()}}


_SPECIALS = sorted({*CHATML_SPECIALS, *LLAMA3_SPECIALS, *(t.content for t in HOSTILE_TOKENS)})
#: What prompts are made of: special tokens and pieces of them, whitespace of every kind
#: (at the cuts too), digits, non-ASCII, and words of the tokenizers' corpus.
FRAGMENTS = [
    *_SPECIALS,
    *(s[: len(s) // 2] for s in _SPECIALS),
    *(s[len(s) // 2 :] for s in _SPECIALS),
    " ", "  ", "\n", "\n\n", "\t", " \n", "\r\n",
    "user", "assistant", "system", "hello", " world", "word", " word ", "words",
    "123", "4", "é", "café", "漢字", "🙂", "x", "q", "z", "|", ">", "<", "▁",
    '{"a": 1}', "\uff21\uff22", "\uff1c|im_end|\uff1e",  # fullwidth: NFKC makes ASCII
]  # fmt: skip
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=40).map(
    "".join
)


def check(cache: PromptCache, tok: Tokenizer, text: str) -> None:
    assert cache.encoder(tok).encode(text) == tok.encode(text, add_special_tokens=False), text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(texts, min_size=1, max_size=4), max_bytes=st.sampled_from([600, 1 << 20]))
def test_cached_ids_are_the_whole_encoding(
    zoo: dict[str, Tokenizer], prompts: list[str], max_bytes: int
) -> None:
    """Random texts, then each grown by the next (as a conversation grows), through one cache
    shared by every tokenizer: small enough to evict on every prompt, or large."""
    cache = PromptCache(max_bytes)
    grown = ""
    for text in prompts:
        grown += text
        for tok in zoo.values():
            check(cache, tok, text)
            check(cache, tok, grown)
            check(cache, tok, grown)  # every piece cached now
    assert cache.num_bytes <= max_bytes


def test_conversation_reuses_earlier_turns(smol_tokenizer: Tokenizer) -> None:
    cache = PromptCache()
    encoder = cache.encoder(smol_tokenizer)
    turns = ["<|im_start|>system\nBe brief.<|im_end|>\n"]
    encoded: list[int] = []
    for i in range(10):
        turns.append(f"<|im_start|>user\nQuestion {i}, with some words?<|im_end|>\n")
        prompt = "".join(turns) + "<|im_start|>assistant\n"
        before = cache.stats.tokens_encoded
        assert encoder.encode(prompt) == smol_tokenizer.encode(prompt)
        encoded.append(cache.stats.tokens_encoded - before)
        turns.append(f"<|im_start|>assistant\nAnswer {i}.<|im_end|>\n")
    whole = len(smol_tokenizer.encode(prompt))
    # Each prompt after the first encodes its new turns only, never the history.
    assert max(encoded[1:]) < 30 < whole
    stats = cache.stats
    assert stats.prompts == 10 and stats.uncached_prompts == 0
    assert stats.tokens_reused + stats.tokens_encoded == sum(
        len(smol_tokenizer.encode("".join(turns[: 2 * i + 2]) + "<|im_start|>assistant\n"))
        for i in range(10)
    )
    assert stats.pieces_hit > stats.pieces_missed > 0


def test_pieces_repeated_in_one_prompt_are_encoded_once(smol_tokenizer: Tokenizer) -> None:
    cache = PromptCache()
    prompt = "<|im_start|>user\nok<|im_end|>\n" * 5
    assert cache.encoder(smol_tokenizer).encode(prompt) == smol_tokenizer.encode(prompt)
    # Pieces: "<|im_start|>", "user\nok<|im_end|>", "\n<|im_start|>" and the tail "\n":
    # 1 + 4 + 2 + 1 tokens.
    assert cache.stats.tokens_encoded == 8
    assert cache.stats.tokens_reused == len(smol_tokenizer.encode(prompt)) - 8
    assert cache.num_entries == 4


def test_bound_evicts_least_recently_used(smol_tokenizer: Tokenizer) -> None:
    cache = PromptCache(max_bytes=10_000)
    encoder = cache.encoder(smol_tokenizer)
    kept = "<|im_start|>kept<|im_end|>"
    for i in range(200):
        encoder.encode(f"<|im_start|>w{i} hello<|im_end|>")
        encoder.encode(kept)  # used after every other prompt: never the least recent
        assert cache.num_bytes <= cache.max_bytes
    assert cache.stats.evictions > 0
    assert cache.num_tokens < 10_000 // 4
    before = cache.stats.tokens_encoded
    encoder.encode(kept)
    assert cache.stats.tokens_encoded == before
    encoder.encode("<|im_start|>w0 hello<|im_end|>")  # evicted long ago
    assert cache.stats.tokens_encoded > before


def test_a_piece_too_large_for_the_cache_is_not_kept(smol_tokenizer: Tokenizer) -> None:
    cache = PromptCache(max_bytes=8 * 1024)
    text = "hello world " * 500
    assert cache.encoder(smol_tokenizer).encode(text) == smol_tokenizer.encode(text)
    assert cache.num_entries == 0


@pytest.mark.parametrize(
    ("name", "pieces"),
    [("chatml", 4), ("metaspace_first", 0), ("wordpiece", 2)],  # 0: no clean cuts
)
def test_off_and_refused_tokenizers_encode_whole(
    zoo: dict[str, Tokenizer], name: str, pieces: int
) -> None:
    tok = zoo[name]
    text = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    for cache in (PromptCache(max_bytes=0), PromptCache()):
        for _ in range(2):
            check(cache, tok, text)
        assert cache.stats.prompts == 2
        whole = 2 if not cache.enabled or not pieces else 0
        assert cache.stats.uncached_prompts == whole
        assert cache.num_entries == (0 if whole else pieces)


def test_tokenizers_keep_apart(zoo: dict[str, Tokenizer]) -> None:
    """One text through two tokenizers sharing a cache: each gets its own ids."""
    cache = PromptCache()
    text = "<|im_start|>user\nhello<|im_end|>"
    for tok in (zoo["chatml"], zoo["smollm2"], zoo["chatml"]):
        check(cache, tok, text)
    assert cache.num_entries == 4


def test_threads_share_one_cache(smol_tokenizer: Tokenizer) -> None:
    cache = PromptCache(max_bytes=20_000)
    encoder = cache.encoder(smol_tokenizer)
    prompts = [
        "".join(f"<|im_start|>user\nturn {j} of {i}<|im_end|>\n" for j in range(i % 7 + 1))
        for i in range(40)
    ]
    expected = [smol_tokenizer.encode(p) for p in prompts]
    failures: list[int] = []

    def work(offset: int) -> None:
        for k in range(200):
            i = (k * 7 + offset) % len(prompts)
            if encoder.encode(prompts[i]) != expected[i]:
                failures.append(i)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failures
    assert cache.stats.prompts == 800
    assert cache.num_bytes <= cache.max_bytes


@pytest.mark.parametrize("make", [ZOO["chatml"], ZOO["hostile"]])
def test_a_split_off_a_boundary_falls_back_to_whole(
    make: Callable[[], Tokenizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A boundary that does not end with its token in the encoding (a broken analysis) is
    caught: the prompt is encoded whole and nothing is stored."""
    tok = make()
    real = tok.boundaries
    assert isinstance(real, TokenBoundaries)
    wrong = TokenBoundaries(pattern=real.pattern, ids={c: -1 for c in real.ids})
    monkeypatch.setattr(tok, "_boundaries", wrong)
    cache = PromptCache()
    check(cache, tok, "<|im_start|>user\nhello<|im_end|>\n")
    assert cache.stats.uncached_prompts == 1
    assert cache.num_entries == 0
