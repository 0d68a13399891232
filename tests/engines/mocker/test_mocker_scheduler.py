"""Scheduler: overload with preemption, simulated timing, cached tokens, stop rules, bad input.

Driven the way vLLM's scheduler tests are: step, advance a simulated clock by the step's
duration, repeat. No event loop, no real sleeping.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.engines.mocker.replay import BS, ReplayModel

from turnout.engines.mocker import (
    MockerConfig,
    MockRequest,
    PolynomialTimingModel,
    Scheduler,
)
from turnout.protocols.llm import (
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    StopConditions,
)


def make_request(tokens: list[int], **stop: object) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="mock",
        token_ids=tokens,
        stop_conditions=StopConditions(**stop),  # type: ignore[arg-type]
    )


def run(
    sched: Scheduler, now: float = 0.0, replay: ReplayModel | None = None, max_steps: int = 100_000
) -> tuple[dict[str, list[LLMEngineOutput]], float]:
    """Step until idle; every output by request id, and the simulated end time."""
    outs: dict[str, list[LLMEngineOutput]] = {}
    for _ in range(max_steps):
        if not sched.has_work():
            return outs, now
        result = sched.step(now)
        now += result.duration_s
        for rid, out in result.outputs:
            outs.setdefault(rid, []).append(out)
        sched.pool.check_invariants()
        if replay is not None:
            replay.apply(sched.pool.take_events())
            assert replay.resident == sched.pool.get_resident_hashes()
    raise AssertionError("scheduler did not drain: a request is stuck")


def final(outs: list[LLMEngineOutput]) -> LLMEngineOutput:
    assert outs[-1].finish_reason is not None
    assert all(o.finish_reason is None for o in outs[:-1])
    return outs[-1]


def test_overload_preempts_and_finishes_everything() -> None:
    cfg = MockerConfig(num_gpu_blocks=16, block_size=BS, max_num_seqs=8)
    sched = Scheduler(cfg)
    for i in range(30):
        prompt = [i % 3] * 12 + [100 + i] * 8  # three shared prefixes, distinct tails
        assert sched.add_request(f"r{i}", make_request(prompt, max_tokens=30)) is None
    outs, _ = run(sched, replay=ReplayModel())
    assert sched.num_preemptions > 0
    assert len(outs) == 30
    for rid, seq in outs.items():
        last = final(seq)
        assert last.finish_reason is FinishReason.LENGTH, rid
        assert sum(len(o.token_ids) for o in seq) == 30
        assert last.usage is not None and last.usage.completion_tokens == 30
    assert sched.pool.num_used == 0
    assert sched.get_load().active_prefill_tokens == 0


@settings(max_examples=25, deadline=None)
@given(
    blocks=st.integers(8, 24),
    requests=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 28), st.integers(1, 12)),
        min_size=1,
        max_size=12,
    ),
    budget=st.integers(4, 64),
    caching=st.booleans(),
)
def test_any_load_drains_with_consistent_events(
    blocks: int, requests: list[tuple[int, int, int]], budget: int, caching: bool
) -> None:
    cfg = MockerConfig(
        num_gpu_blocks=blocks,
        block_size=BS,
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
    )
    sched = Scheduler(cfg)
    for i, (prefix, length, max_tokens) in enumerate(requests):
        prompt = ([prefix] * 8 + [50 + i] * 20)[:length]
        assert sched.add_request(f"r{i}", make_request(prompt, max_tokens=max_tokens)) is None
    outs, _ = run(sched, replay=ReplayModel())
    for i, (_, length, max_tokens) in enumerate(requests):
        seq = outs[f"r{i}"]
        last = final(seq)
        # A request stops at max_tokens, or with LENGTH when it fills the whole pool.
        expected = min(max_tokens, blocks * BS - length)
        assert last.usage is not None and last.usage.completion_tokens == expected
        assert last.finish_reason is FinishReason.LENGTH
    assert sched.pool.num_used == 0


def test_lone_request_takes_prefill_plus_decode_steps() -> None:
    timing = PolynomialTimingModel()
    cfg = MockerConfig(num_gpu_blocks=1024, block_size=16)
    sched = Scheduler(cfg, timing=timing)
    sched.add_request("a", make_request(list(range(64)), max_tokens=64))
    outs, end = run(sched)
    assert len(outs["a"]) == 64
    req_ttft = timing.prefill_ms(64) / 1000
    # Decode steps: 63 at a small, slowly growing KV usage.
    low = req_ttft + 63 * timing.decode_ms(1, 0.0) / 1000
    high = req_ttft + 63 * timing.decode_ms(1, 9 / 1024) / 1000
    assert low <= end <= high


def test_repeated_prompt_has_lower_ttft_and_reports_cached_tokens() -> None:
    cfg = MockerConfig(num_gpu_blocks=1024, block_size=16)
    sched = Scheduler(cfg)
    prompt = [7 + (i % 50) for i in range(4000)]
    ttft = []
    cached = []
    now = 0.0
    for rid in ("first", "again"):
        sched.add_request(rid, make_request(prompt, max_tokens=4))
        req = sched.get_request(rid)
        assert isinstance(req, MockRequest)
        outs, end = run(sched, now)
        assert req.first_token_time is not None
        ttft.append(req.first_token_time - now)
        usage = final(outs[rid]).usage
        assert usage is not None
        cached.append(usage.cached_tokens)
        now = end
    assert cached == [0, 3984]  # 249 full blocks; the last token is always recomputed
    assert ttft[1] < ttft[0] / 3


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    cfg = MockerConfig(num_gpu_blocks=256, block_size=16, max_num_batched_tokens=256)
    sched = Scheduler(cfg)
    sched.add_request("long", make_request(list(range(1000)), max_tokens=2))
    steps = []
    while sched.has_work():
        steps.append(sched.step())
    assert [s.num_prefill_tokens for s in steps[:4]] == [256, 256, 256, 232]
    assert [len(s.outputs) for s in steps] == [0, 0, 0, 1, 1]


def test_without_chunked_prefill_a_prompt_over_budget_is_refused() -> None:
    cfg = MockerConfig(enable_chunked_prefill=False, max_num_batched_tokens=128)
    out = Scheduler(cfg).add_request("x", make_request(list(range(200))))
    assert out is not None and out.finish_reason is FinishReason.ERROR
    assert "chunked prefill is off" in (out.error or "")


@pytest.mark.parametrize(
    ("prompt_len", "stop", "message"),
    [
        (65, {}, "whole KV cache"),
        (0, {}, "empty"),
        (8, {"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_requests_end_with_error_not_a_hang(
    prompt_len: int, stop: dict[str, int], message: str
) -> None:
    cfg = MockerConfig(num_gpu_blocks=4, block_size=16)
    sched = Scheduler(cfg)
    out = sched.add_request("bad", make_request(list(range(prompt_len)), **stop))
    assert out is not None and out.finish_reason is FinishReason.ERROR
    assert message in (out.error or "")
    assert not sched.has_work()


def test_a_request_that_outgrows_the_pool_ends_with_length() -> None:
    cfg = MockerConfig(num_gpu_blocks=4, block_size=16)
    sched = Scheduler(cfg)
    sched.add_request("big", make_request(list(range(60)), max_tokens=100, ignore_eos=True))
    outs, _ = run(sched)
    last = final(outs["big"])
    assert last.finish_reason is FinishReason.LENGTH
    assert last.usage is not None and last.usage.completion_tokens == 4  # 60 + 4 = 64 tokens


class StopAt:
    """A sampler that emits ``token`` at output position ``at`` (and 5 otherwise)."""

    def __init__(self, token: int, at: int) -> None:
        self.token, self.at = token, at

    def next_token(self, request: MockRequest) -> int:
        return self.token if request.num_output >= self.at else 5


@pytest.mark.parametrize(
    ("stop", "reason", "count"),
    [
        ({"stop_token_ids_hidden": [9], "max_tokens": 20}, FinishReason.STOP, 4),
        ({"stop_token_ids_hidden": [9], "max_tokens": 20, "min_tokens": 7}, FinishReason.STOP, 7),
        ({"max_tokens": 20}, FinishReason.LENGTH, 20),  # 9 is no stop token here
    ],
)
def test_stop_token_ids_and_min_tokens(
    stop: dict[str, object], reason: FinishReason, count: int
) -> None:
    sched = Scheduler(MockerConfig(), sampler=StopAt(9, 3))
    sched.add_request("s", make_request([1, 2, 3], **stop))
    outs, _ = run(sched)
    last = final(outs["s"])
    assert last.finish_reason is reason
    assert last.usage is not None and last.usage.completion_tokens == count


def test_eos_honoured_unless_ignored() -> None:
    cfg = MockerConfig(eos_token_ids=[2])
    for ignore, reason, count in ((False, FinishReason.EOS, 4), (True, FinishReason.LENGTH, 10)):
        sched = Scheduler(cfg, sampler=StopAt(2, 3))
        sched.add_request("e", make_request([1, 2, 3], max_tokens=10, ignore_eos=ignore))
        last = final(run(sched)[0]["e"])
        assert (last.finish_reason, last.usage and last.usage.completion_tokens) == (reason, count)


def test_default_sampler_is_deterministic_and_ends_with_eos_without_max_tokens() -> None:
    cfg = MockerConfig(seed=3, vocab_size=1000, eos_token_ids=[0], default_max_tokens=50)

    def tokens(seed_cfg: MockerConfig, **stop: object) -> list[int]:
        sched = Scheduler(seed_cfg)
        sched.add_request("d", make_request(list(range(30)), **stop))
        return [t for o in run(sched)[0]["d"] for t in o.token_ids]

    a = tokens(cfg)
    assert a == tokens(cfg)
    assert len(a) == 50 and a[-1] == 0 and 0 not in a[:-1]
    assert all(0 <= t < 1000 for t in a)
    b = tokens(MockerConfig(seed=4, vocab_size=1000, eos_token_ids=[0], default_max_tokens=50))
    assert a != b
    c = tokens(cfg, max_tokens=80, min_tokens=10)
    assert len(c) == 80 and 0 not in c  # max_tokens set: no EOS, runs to the length


def test_abort_frees_blocks_and_load_counters() -> None:
    sched = Scheduler(MockerConfig(num_gpu_blocks=64, block_size=16))
    sched.add_request("a", make_request(list(range(100)), max_tokens=50))
    sched.add_request("b", make_request(list(range(300)), max_tokens=50))
    sched.step()
    assert sched.pool.num_used > 0
    assert sched.abort("a") and sched.abort("b")
    assert not sched.abort("a")
    load = sched.get_load()
    assert (load.active_prefill_tokens, load.active_decode_blocks, load.num_running) == (0, 0, 0)
    sched.pool.check_invariants()
