"""What one worker sustains within the SLOs: the profile file, the per-pool request rate, and
the steady-state estimate from the KV router's step-time model (its prior: no report yet),
checked against the step times recomputed by hand from ``decode_step_s``/``prefill_step_s``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from turnout.errors import ConfigError
from turnout.planner.capacity import (
    BATCH_MARGIN,
    WorkerCapacity,
    WorkerLimits,
    from_step_model,
    load_profile,
)
from turnout.router.kv.step_time import StepTimePrior, WorkerStepModel

PROMPT = 512
OUTPUT = 128


def write(tmp_path: Path, data: object) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return str(path)


# -- the profile file ---------------------------------------------------------------------


def test_a_flat_profile_applies_to_every_pool(tmp_path: Path) -> None:
    profile = load_profile(
        write(tmp_path, {"prefill_tokens_per_s": 8000, "decode_tokens_per_s": 640.5})
    )
    expected = WorkerCapacity(8000.0, 640.5, "profile")
    assert profile == {"aggregated": expected, "prefill": expected, "decode": expected}


def test_a_per_pool_profile_gives_each_pool_its_own(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "pools": {
                "prefill": {"prefill_tokens_per_s": 20000, "decode_tokens_per_s": 1},
                "decode": {"prefill_tokens_per_s": 1, "decode_tokens_per_s": 3000},
            }
        },
    )
    assert load_profile(path) == {
        "prefill": WorkerCapacity(20000.0, 1.0, "profile"),
        "decode": WorkerCapacity(1.0, 3000.0, "profile"),
    }


@pytest.mark.parametrize(
    ("entry", "key"),
    [
        ({"decode_tokens_per_s": 100}, "prefill_tokens_per_s"),  # missing
        ({"prefill_tokens_per_s": 0, "decode_tokens_per_s": 100}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": 100, "decode_tokens_per_s": -5}, "decode_tokens_per_s"),
        ({"prefill_tokens_per_s": 100, "decode_tokens_per_s": "fast"}, "decode_tokens_per_s"),
        ({"prefill_tokens_per_s": math.inf, "decode_tokens_per_s": 100}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": 100, "decode_tokens_per_s": math.nan}, "decode_tokens_per_s"),
        ({"prefill_tokens_per_s": 100, "decode_tokens_per_s": None}, "decode_tokens_per_s"),
    ],
)
def test_a_bad_value_names_its_pool_and_key(
    tmp_path: Path, entry: dict[str, object], key: str
) -> None:
    path = write(tmp_path, {"pools": {"decode": entry}})
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    assert str(err.value) == f"--profile {path}: decode.{key} must be a number above 0"
    # A flat profile: the first pool checked is named.
    path = write(tmp_path, entry)
    with pytest.raises(ConfigError, match=f"aggregated.{key} must be a number above 0"):
        load_profile(path)


def test_a_boolean_is_not_a_number(tmp_path: Path) -> None:
    path = write(tmp_path, {"prefill_tokens_per_s": True, "decode_tokens_per_s": 100})
    with pytest.raises(ConfigError, match="prefill_tokens_per_s must be a number above 0"):
        load_profile(path)


def test_an_unknown_pool_is_named(tmp_path: Path) -> None:
    path = write(
        tmp_path, {"pools": {"encode": {"prefill_tokens_per_s": 1, "decode_tokens_per_s": 1}}}
    )
    with pytest.raises(ConfigError, match="unknown pool 'encode'"):
        load_profile(path)
    path = write(tmp_path, {"pools": {"decode": [1, 2]}})
    with pytest.raises(ConfigError, match="pool 'decode' is not an object"):
        load_profile(path)


def test_a_file_that_is_not_a_profile_says_so(tmp_path: Path) -> None:
    path = write(tmp_path, [1000, 100])
    with pytest.raises(ConfigError, match="expected a JSON object"):
        load_profile(path)
    broken = tmp_path / "broken.json"
    broken.write_text('{"prefill_tokens_per_s": ')
    with pytest.raises(ConfigError, match=f"--profile {broken}: cannot read it"):
        load_profile(str(broken))
    missing = tmp_path / "missing.json"
    with pytest.raises(ConfigError, match=f"--profile {missing}: cannot read it"):
        load_profile(str(missing))
    with pytest.raises(ConfigError, match="cannot read it"):
        load_profile(str(tmp_path))  # a directory


# -- requests per second per pool ---------------------------------------------------------


def test_requests_per_second_of_each_pool() -> None:
    capacity = WorkerCapacity(prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0, source="t")
    # Prefill: 1000 / 100 tokens; decode: 100 / 10 tokens; aggregated: 0.1 s + 0.1 s each.
    assert capacity.requests_per_s("prefill", 100, 10) == 10.0
    assert capacity.requests_per_s("decode", 100, 10) == 10.0
    assert capacity.requests_per_s("aggregated", 100, 10) == 5.0
    assert capacity.requests_per_s("aggregated", 400, 20) == pytest.approx(1 / (0.4 + 0.2))
    # No length known (an interval without requests): one token each, never a division by 0.
    assert capacity.requests_per_s("prefill", 0, 0) == 1000.0
    assert capacity.requests_per_s("decode", 0, 0) == 100.0
    assert capacity.requests_per_s("aggregated", 0.0, 0.0) == pytest.approx(1 / (0.001 + 0.01))
    assert capacity.as_dict() == {
        "prefill_tokens_per_s": 1000.0,
        "decode_tokens_per_s": 100.0,
        "source": "t",
    }


# -- from the step-time model -------------------------------------------------------------


def prior_model() -> WorkerStepModel:
    return WorkerStepModel(StepTimePrior())


def capacity_of(
    pool: str = "aggregated",
    *,
    ttft: float = 10.0,
    itl: float = 1.0,
    limits: WorkerLimits | None = None,
    model: WorkerStepModel | None = None,
) -> float:
    """Requests per second of one worker of ``pool`` at ``PROMPT``/``OUTPUT`` tokens."""
    capacity = from_step_model(
        model or prior_model(), limits or WorkerLimits(), pool=pool, prompt_tokens=PROMPT,
        output_tokens=OUTPUT, ttft_slo=ttft, itl_slo=itl, source="step-prior",
    )  # fmt: skip
    assert capacity.source == "step-prior"
    return capacity.requests_per_s(pool, PROMPT, OUTPUT)


def by_hand(pool: str, batch: int, kv_tokens: int) -> tuple[float, float, float]:
    """(rate, ITL, TTFT) of a worker keeping ``batch`` requests decoding, from the model's own
    step times: ``λ = B / (d·O + B·p)``, ITL ``d / (1 - λp)``, TTFT ``(p + d) / (1 - λp)``."""
    model = prior_model()
    u = min(batch * (PROMPT + OUTPUT / 2) / kv_tokens, 1.0) if kv_tokens else 0.0
    d = model.decode_step_s(batch, u)
    p = model.prefill_step_s(PROMPT, batch, u) if pool == "aggregated" else 0.0
    rate = batch / (d * OUTPUT + batch * p)
    return rate, d / (1 - rate * p), (p + d) / (1 - rate * p)


def batch_of(pool: str, rate: float, kv_tokens: int, most: int) -> int:
    """The batch whose steady rate is ``rate`` (the one ``from_step_model`` settled on)."""
    matches = [
        b for b in range(1, most + 1) if by_hand(pool, b, kv_tokens)[0] == pytest.approx(rate)
    ]
    assert len(matches) == 1, (rate, matches)
    return matches[0]


def test_the_prior_steps_the_estimates_below_use() -> None:
    """The hand computations below lean on these: with the KV cache unknown (usage 0) the
    prior's decode step is 5.74 ms at any batch, and a prefill beside decodes adds a decode
    pass to the prompt's step."""
    model = prior_model()
    assert model.decode_step_s(1, 0.0) == model.decode_step_s(200, 0.0) == pytest.approx(0.00574)
    alone = 0.0165 + 1.518e-5 * PROMPT + 4.21e-10 * PROMPT**2
    assert model.prefill_step_s(PROMPT, 0, 0.0) == pytest.approx(alone)
    assert model.prefill_step_s(PROMPT, 7, 0.0) == pytest.approx(alone + 0.00574)


@pytest.mark.parametrize("itl", [0.008, 0.01, 0.02, 0.05])
def test_the_rate_keeps_the_itl_within_its_target(itl: float) -> None:
    """Recomputed by hand: at the estimated rate λ each step runs ``d`` plus the prefills of
    ``λ`` requests a second, so ITL ``d / (1 - λp)`` must be within the target, and the batch
    one larger (the next rate the worker could carry) must not be."""
    model = prior_model()
    rate = capacity_of(itl=itl)
    d = model.decode_step_s(1, 0.0)
    p = model.prefill_step_s(PROMPT, 1, 0.0)
    assert d / (1 - rate * p) <= itl
    assert (p + d) / (1 - rate * p) <= 10.0
    batch = rate * d * OUTPUT / (1 - rate * p)  # B from λ = B / (d·O + B·p)
    assert batch == pytest.approx(round(batch))
    most = round(256 * BATCH_MARGIN)
    assert round(batch) < most  # the ITL, not the batch limit, bounds these
    assert by_hand("aggregated", round(batch) + 1, 0)[1] > itl


def test_capacity_grows_with_a_looser_itl_target() -> None:
    rates = [capacity_of(itl=itl) for itl in (0.008, 0.01, 0.02, 0.05)]
    assert rates == sorted(rates) and len(set(rates)) == len(rates)


def test_capacity_grows_with_a_looser_ttft_target() -> None:
    rates = [capacity_of(ttft=ttft) for ttft in (0.05, 0.1, 0.3)]
    assert rates == sorted(rates) and len(set(rates)) == len(rates)
    for ttft, rate in zip((0.05, 0.1, 0.3), rates, strict=True):
        batch = batch_of("aggregated", rate, 0, round(256 * BATCH_MARGIN))
        assert by_hand("aggregated", batch, 0)[2] <= ttft < by_hand("aggregated", batch + 1, 0)[2]


def test_a_prefill_worker_waits_no_longer_than_the_ttft_target_leaves() -> None:
    """Prompts one after another (deterministic service ``p``): the mean wait at utilisation
    ``rho`` is ``rho·p / 2(1 - rho)``; prefill plus wait is the target."""
    model = prior_model()
    p = model.prefill_step_s(PROMPT, 0, 0.0)
    rates = []
    for ttft in (0.03, 0.05, 0.1):
        rate = capacity_of("prefill", ttft=ttft)
        rho = rate * p
        assert 0.05 < rho < 0.9
        assert p + rho * p / (2 * (1 - rho)) == pytest.approx(ttft)
        rates.append(rate)
    assert rates == sorted(rates)
    # A target under one prefill: plan for 5% utilisation; a loose one: at most 90%.
    assert capacity_of("prefill", ttft=p / 2) * p == pytest.approx(0.05)
    assert capacity_of("prefill", ttft=100.0) * p == pytest.approx(0.9)


def test_the_batch_limit_bounds_the_capacity() -> None:
    """With loose targets the worker runs ``BATCH_MARGIN`` of its ``max_num_seqs``."""
    model = prior_model()
    for seqs in (4, 20, 100):
        most = round(seqs * BATCH_MARGIN)
        limits = WorkerLimits(max_num_seqs=seqs)
        d = model.decode_step_s(most, 0.0)
        p = model.prefill_step_s(PROMPT, most, 0.0)
        assert capacity_of(limits=limits) == pytest.approx(most / (d * OUTPUT + most * p))
        assert capacity_of("decode", limits=limits) == pytest.approx(most / (d * OUTPUT))
    rates = [capacity_of(limits=WorkerLimits(max_num_seqs=n)) for n in (4, 20, 100, 256)]
    assert rates == sorted(rates) and len(set(rates)) == len(rates)
    # A card naming 1 running request still plans for one.
    d = model.decode_step_s(1, 0.0)
    one = capacity_of("decode", limits=WorkerLimits(max_num_seqs=1))
    assert one == pytest.approx(1 / (d * OUTPUT))


@pytest.mark.parametrize("pool", ["aggregated", "decode"])
def test_kv_pressure_lowers_the_capacity(pool: str) -> None:
    """A smaller KV cache fills at a smaller batch, and a fuller cache makes each step
    slower: fewer requests a second within the same targets."""
    kvs = (0, 1_000_000, 100_000, 20_000, 5_000)  # 0: unknown, no pressure counted
    rates = [capacity_of(pool, ttft=2.0, itl=0.03, limits=WorkerLimits(kv_tokens=kv)) for kv in kvs]
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == len(rates)
    for kv, rate in zip(kvs, rates, strict=True):
        most = round(256 * BATCH_MARGIN)
        batch = batch_of(pool, rate, kv, most)
        _, itl, ttft = by_hand(pool, batch, kv)
        assert itl <= 0.03 and (pool == "decode" or ttft <= 2.0)
        if batch < most:  # one more request would break a target
            _, itl_more, ttft_more = by_hand(pool, batch + 1, kv)
            assert itl_more > 0.03 or (pool == "aggregated" and ttft_more > 2.0)


def test_targets_no_batch_meets_plan_one_request_at_a_time() -> None:
    """A 1 ms ITL target is under even one decode step: the estimate is one request at a
    time (the SLO rule then adds workers on what is observed)."""
    model = prior_model()
    u = (PROMPT + OUTPUT / 2) / 1000  # one request in a 1000-token cache
    d = model.decode_step_s(1, u)
    p = model.prefill_step_s(PROMPT, 1, u)
    rate = capacity_of(ttft=0.01, itl=0.001, limits=WorkerLimits(kv_tokens=1000))
    assert rate == pytest.approx(1 / (d * OUTPUT + p))
    assert capacity_of("decode", itl=0.001, limits=WorkerLimits(kv_tokens=1000)) == pytest.approx(
        1 / (d * OUTPUT)
    )


def test_a_decode_worker_has_no_prefill_to_plan() -> None:
    capacity = from_step_model(
        prior_model(), WorkerLimits(), pool="decode", prompt_tokens=PROMPT,
        output_tokens=OUTPUT, ttft_slo=1.0, itl_slo=0.05, source="step-model",
    )  # fmt: skip
    assert capacity.prefill_tokens_per_s == math.inf
    assert capacity.source == "step-model"
