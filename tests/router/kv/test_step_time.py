"""Step-time fitting and TTFT prediction: hand-computed cases, convergence on a mocker worker
whose timing is known (fake clock), and robustness to bad samples."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tests.engines.mocker.test_mocker_engine import FakeClock, RecordingSink

from turnout.engines.mocker import MockerConfig, MockerEngine, PolynomialTimingModel
from turnout.protocols.kv import LoadReport, StepSample
from turnout.protocols.llm import PreprocessedRequest, StopConditions
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.step_time import (
    RidgeFit,
    StepTimeModels,
    StepTimePrior,
    WorkerStepModel,
)
from turnout.runtime.context import RequestContext


def test_predict_ttft_by_hand_with_the_prior() -> None:
    prior = StepTimePrior()
    model = WorkerStepModel(prior)
    model.step_budget = 1000

    def step(tokens: int, decodes: int) -> float:
        return (
            prior.prefill_constant
            + prior.prefill_per_token * tokens
            + prior.prefill_per_token_sq * tokens * tokens
            + prior.prefill_per_decode * decodes
            # A step with decodes also runs a decode pass (here at KV usage 0).
            + (prior.mixed_constant if decodes else 0.0)
        )

    # 2,300 queued + 450 new = 2,750 tokens; 100 decodes leave 900 tokens a step:
    # three full steps of 900 and one of 50, each beside the 100 decodes.
    expected = 3 * step(900, 100) + step(50, 100)
    assert model.predict_ttft(2300, 450, 100) == pytest.approx(expected, rel=1e-12)
    # Nothing queued and a fully cached prompt: still one step to compute the last token.
    assert model.predict_ttft(0, 0, 0) == pytest.approx(step(1, 0), rel=1e-12)
    # More queued work or more new tokens never predicts less.
    assert model.predict_ttft(0, 2000, 0) < model.predict_ttft(500, 2000, 0)
    assert model.predict_ttft(0, 2000, 0) < model.predict_ttft(0, 2500, 0)
    # A worker that reports no budget is assumed to take 8192 tokens a step.
    default = WorkerStepModel(prior)
    assert default.predict_ttft(0, 8192, 0) == pytest.approx(step(8192, 0), rel=1e-12)


def test_ridge_fit_recovers_exact_coefficients_and_forgets() -> None:
    truth = np.array([0.02, 0.5, 0.1, 0.3])
    fit = RidgeFit(np.zeros(4), weight=1e-9, forgetting=1.0)
    rng = np.random.default_rng(0)
    rows = np.column_stack([np.ones(200), *(rng.uniform(0, 4, (3, 200)))])
    rows[:, 2] = rows[:, 1] ** 2
    fit.add(rows, rows @ truth)
    assert fit.coefficients == pytest.approx(truth, rel=1e-4)
    # With forgetting, a worker that becomes twice as slow is followed.
    slow = RidgeFit(np.zeros(4), weight=1e-9, forgetting=0.99)
    slow.add(rows, rows @ truth)
    for _ in range(10):
        slow.add(rows, rows @ (2 * truth))
    assert slow.coefficients == pytest.approx(2 * truth, rel=1e-2)


def test_prior_holds_until_data_and_coefficients_stay_non_negative() -> None:
    model = WorkerStepModel(StepTimePrior())
    before = model.prefill_step_s(4096, 0)
    # Data that a least-squares fit would explain with a negative slope.
    model.observe([StepSample(p, 0, 0.5 - p / 20000) for p in range(100, 8000, 100)])
    assert all(x >= 0 for x in model.prefill.coefficients[:5])  # the token/decode terms
    assert model.prefill_step_s(8000, 0) >= model.prefill_step_s(100, 0)
    assert model.prefill_step_s(4096, 0) != before


def test_bad_samples_are_not_data() -> None:
    model = WorkerStepModel(StepTimePrior())
    model.observe(
        [StepSample(100, 0, float("nan")), StepSample(100, 0, -1.0), StepSample(0, 0, 0.1)]
    )
    assert model.prefill.num_samples == 0 and model.decode.num_samples == 0


def test_models_follow_reports_and_forget_workers() -> None:
    models = StepTimeModels()
    key = WorkerKey(7, 0)
    default = models.get(key).predict_ttft(0, 1000, 0)
    models.on_load(
        LoadReport(
            worker_id=7,
            steps=[StepSample(p, 0, 1.0 + p / 1000) for p in (100, 1000, 3000, 6000)] * 10,
            max_num_batched_tokens=2048,
        )
    )
    assert models.get(key).step_budget == 2048
    assert models.get(key).predict_ttft(0, 1000, 0) > 10 * default
    models.remove_worker(7)
    assert models.get(key).predict_ttft(0, 1000, 0) == default


async def test_calibration_converges_on_a_mocker_worker_with_known_timing() -> None:
    """The mocker's step times are its timing model divided by the speedup; fitted from its
    load reports alone, the router's model predicts them within a few percent."""
    clock = FakeClock()
    sink = RecordingSink()
    timing = PolynomialTimingModel()
    speedup = 2.0
    config = MockerConfig(
        num_gpu_blocks=4096, block_size=16, speedup_ratio=speedup, max_num_batched_tokens=4096
    )
    engine = MockerEngine(config, sink=sink, timing=timing, clock=clock, sleep=clock.sleep)
    rng = np.random.default_rng(1)

    async def one(i: int) -> None:
        length = int(rng.integers(64, 6000))
        prompt = [1000 + (i * 7919 + j) % 30000 for j in range(length)]
        request = PreprocessedRequest(
            model="m", token_ids=prompt, stop_conditions=StopConditions(max_tokens=8)
        )
        async for _ in engine.generate(request, RequestContext()):
            pass

    try:
        for wave in range(40):
            await asyncio.gather(*(one(wave * 8 + i) for i in range(int(rng.integers(1, 8)))))
    finally:
        await engine.stop()
    models = StepTimeModels()
    for report in sink.loads:
        models.on_load(report)
    fitted = models.get(WorkerKey(0, 0))
    assert fitted.step_budget == 4096
    assert fitted.prefill.num_samples >= 20 and fitted.decode.num_samples >= 20
    for tokens in (256, 1024, 4000):
        expected = timing.prefill_ms(tokens) / 1000 / speedup
        assert fitted.prefill_step_s(tokens, 0) == pytest.approx(expected, rel=0.05)
    # Decode steps, over the KV usage the run covered (about 0.02 to 0.4): batch size and
    # usage move together in this run, so the fit is looser.
    for usage in (0.1, 0.2, 0.3):
        expected = timing.decode_ms(4, usage) / 1000 / speedup
        assert fitted.decode_step_s(4, usage) == pytest.approx(expected, rel=0.1)
