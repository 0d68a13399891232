"""The mocker's timing, pinned to Dynamo 1.6.1's mocker as measured end to end.

``dynamo_mocker_reference.json`` holds what ``benchmarks/mocker_calibration.py`` measured on
one Dynamo mocker worker over HTTP (simulated milliseconds: wall time x speedup, TTFT net of
the serving path's fixed overhead). Here turnout's ``Scheduler`` runs the same workloads with
no sockets and no clock: the simulated step durations (``StepResult.duration_s``) are summed
until each token, and TTFT, inter-token latency (ITL), the duration of a mixed step and the
ITL over a shared prefix must match Dynamo's within a few percent. Any material change of
the timing model (coefficients, what a mixed step costs, when the first token comes) fails.

Regenerate the reference (needs Dynamo, see ``benchmarks/dynamo_peer.py``)::

    .venv/bin/python benchmarks/mocker_calibration.py \\
        --write-reference tests/engines/mocker/dynamo_mocker_reference.json
"""

from __future__ import annotations

import json
import random
import statistics
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from turnout.engines.mocker import MockerConfig, PolynomialTimingModel, Scheduler
from turnout.protocols.llm import PreprocessedRequest, StopConditions

REFERENCE: dict[str, Any] = json.loads(
    (Path(__file__).parent / "dynamo_mocker_reference.json").read_text()
)
GRID: dict[str, Any] = REFERENCE["settings"]
#: Run-to-run noise of the reference: under 3 % for TTFT (the serving overhead it is net of
#: varies), under 0.5 % for the rest. A material model change moves a figure by far more (the
#: old decode constant 12.55: x2.2; a mixed step costed as ``prefill(T + B)``: -3.6 %).
TOLERANCE = 0.05
MIXED_TOLERANCE = 0.02


def scheduler(num_gpu_blocks: int) -> Scheduler:
    config = MockerConfig(
        block_size=GRID["block_size"],
        num_gpu_blocks=num_gpu_blocks,
        max_num_batched_tokens=GRID["max_num_batched_tokens"],
    )
    return Scheduler(config, timing=PolynomialTimingModel())


def prompt(rng: random.Random, n: int) -> list[int]:
    """Fresh random tokens, as the benchmark sends (no prefix hits between prompts)."""
    return [rng.randint(1000, 40000) for _ in range(n)]


def add(sched: Scheduler, rid: str, tokens: list[int], max_tokens: int) -> None:
    request = PreprocessedRequest(
        model="calib",
        token_ids=tokens,
        stop_conditions=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )
    assert sched.add_request(rid, request) is None


def run(
    sched: Scheduler,
    now_ms: float = 0.0,
    times: dict[str, list[float]] | None = None,
    max_steps: int = 100_000,
) -> tuple[float, dict[str, list[float]]]:
    """Step until idle (or ``max_steps`` steps): the simulated ms of every token by request."""
    times = {} if times is None else times
    for _ in range(max_steps):
        if not sched.has_work():
            break
        result = sched.step(now_ms / 1000)
        now_ms += result.duration_s * 1000
        for rid, out in result.outputs:
            times.setdefault(rid, []).extend([now_ms] * len(out.token_ids))
    return now_ms, times


def period(ts: list[float]) -> float:
    """A stream's mean inter-token gap (the benchmark's ITL, robust to bursts)."""
    return (ts[-1] - ts[0]) / (len(ts) - 1)


@pytest.mark.parametrize("length", GRID["prompt_lengths"])
def test_ttft_of_a_lone_prompt_matches_dynamo(length: int) -> None:
    """The first token comes at the end of the step that computes the prompt's last chunk,
    with no decode charged: TTFT = prefill_ms(P)."""
    sched = scheduler(GRID["num_gpu_blocks"])
    add(sched, "r", prompt(random.Random(length), length), 2)
    _, times = run(sched)
    expected = REFERENCE["ttft_sim_ms"][str(length)]
    assert times["r"][0] == pytest.approx(expected, rel=TOLERANCE)


@pytest.mark.parametrize("batch", GRID["batches"])
def test_itl_of_concurrent_requests_matches_dynamo(batch: int) -> None:
    """A decode step costs 5.74 + 54.01·u - 25.74·u² ms: the batch size itself adds nothing."""
    sched = scheduler(GRID["num_gpu_blocks"])
    rng = random.Random(batch)
    for i in range(batch):
        add(sched, f"r{i}", prompt(rng, GRID["itl_prompt_len"]), GRID["itl_output_tokens"])
    _, times = run(sched)
    assert all(len(ts) == GRID["itl_output_tokens"] for ts in times.values())
    itl = statistics.median(period(ts) for ts in times.values())
    assert itl == pytest.approx(REFERENCE["itl_sim_ms"][str(batch)], rel=TOLERANCE)


def test_a_mixed_step_costs_its_prefill_plus_a_decode_like_dynamo() -> None:
    """A request decoding when a long prompt arrives: the step that computes the prompt
    beside its decode costs prefill_ms(T) + decode_ms(u) (not prefill_ms(T + 1))."""
    sched = scheduler(GRID["num_gpu_blocks"])
    rng = random.Random(7)
    add(sched, "a", prompt(rng, 128), 120)
    now, times = run(sched, max_steps=27)  # the benchmark's B arrives ~150 ms in
    add(sched, "b", prompt(rng, GRID["mixed_prompt_len"]), 2)
    _, times = run(sched, now, times)
    longest = max(y - x for x, y in pairwise(times["a"]))
    assert longest == pytest.approx(REFERENCE["mixed_step_sim_ms"], rel=MIXED_TOLERANCE)
    # B's first token comes with A's token at the end of that step.
    assert times["b"][0] in times["a"]


def test_itl_over_a_shared_prefix_reads_every_requests_context_like_dynamo() -> None:
    sched = scheduler(GRID["shared_num_gpu_blocks"])
    rng = random.Random(11)
    shared = prompt(rng, GRID["shared_prompt_len"])
    add(sched, "warm", shared, 2)  # the prefix is resident before the batch arrives
    run(sched)
    for i in range(GRID["shared_batch"]):
        add(sched, f"s{i}", list(shared), GRID["itl_output_tokens"])
    _, times = run(sched)
    itl = statistics.median(period(ts) for ts in times.values())
    assert itl == pytest.approx(REFERENCE["shared_itl_sim_ms"], rel=TOLERANCE)


def test_the_reference_agrees_with_dynamos_published_formulas() -> None:
    """The measured figures are Dynamo's polynomials (ai-dynamo/aisimulate perf_model.rs):
    the reference is a measurement of that model, not of noise."""
    formula = REFERENCE["dynamo_formula"]
    for key in ("ttft_sim_ms", "itl_sim_ms"):
        for k, measured in REFERENCE[key].items():
            assert measured == pytest.approx(formula[key][k], rel=0.02), (key, k)
    for key in ("mixed_step_sim_ms", "shared_itl_sim_ms"):
        assert REFERENCE[key] == pytest.approx(formula[key], rel=0.02), key
