"""The load forecasts on hand-made series: each expected value is worked out in the comment
beside it, so a change in a predictor's arithmetic shows as a number, not a trend."""

from __future__ import annotations

import pytest

from turnout.planner.predict import (
    LastValue,
    Load,
    LoadPredictor,
    MovingAverageTrend,
    SeasonalNaive,
    make_series,
)


def feed(predictor: MovingAverageTrend | SeasonalNaive | LastValue, values: list[float]) -> None:
    for value in values:
        predictor.add(value)


def test_nothing_added_predicts_nothing() -> None:
    assert MovingAverageTrend(4).predict() is None
    assert SeasonalNaive(4).predict() is None
    assert LastValue().predict() is None
    assert LoadPredictor("moving-average").predict() is None


def test_moving_average_of_flat_load_is_its_level() -> None:
    ma = MovingAverageTrend(6)
    feed(ma, [7.0] * 10)
    assert ma.predict() == pytest.approx(7.0)
    one = MovingAverageTrend(6)
    one.add(3.0)  # a single value: no slope to read
    assert one.predict() == 3.0


def test_moving_average_of_a_ramp_is_its_next_value() -> None:
    ma = MovingAverageTrend(4)
    feed(ma, [1.0, 2.0, 3.0, 4.0])  # mean 2.5, slope 1, read at 2.5 past the centre (1.5)
    assert ma.predict() == pytest.approx(5.0)
    ma = MovingAverageTrend(5)
    feed(ma, [10.0, 13.0, 16.0])  # a partial window follows the same line: 19
    assert ma.predict() == pytest.approx(19.0)
    # Noise about a line: least squares through 2, 4, 4, 6 (slope 1.2, mean 4) reads 6.
    ma = MovingAverageTrend(4)
    feed(ma, [2.0, 4.0, 4.0, 6.0])
    assert ma.predict() == pytest.approx(4.0 + 1.2 * 2.5)


def test_moving_average_reads_only_its_window() -> None:
    ma = MovingAverageTrend(3)
    feed(ma, [100.0, 0.0, 0.0, 10.0, 20.0, 30.0])  # only 10, 20, 30 count: 40
    assert ma.predict() == pytest.approx(40.0)
    ma = MovingAverageTrend(3)
    feed(ma, [50.0, 50.0, 50.0, 5.0, 5.0, 5.0])  # the old level has left the window
    assert ma.predict() == pytest.approx(5.0)


def test_moving_average_of_a_fall_never_goes_below_zero() -> None:
    ma = MovingAverageTrend(3)
    feed(ma, [30.0, 20.0, 10.0])  # the line reads 0 next; steeper would read below it
    assert ma.predict() == pytest.approx(0.0)
    feed(ma, [4.0])  # 20, 10, 4: slope -8, mean 11.33, reads 11.33 - 16 < 0
    assert ma.predict() == 0.0


def test_windows_and_seasons_are_positive() -> None:
    with pytest.raises(ValueError, match="window"):
        MovingAverageTrend(0)
    with pytest.raises(ValueError, match="season"):
        SeasonalNaive(0)
    with pytest.raises(ValueError, match="unknown predictor 'arima'"):
        make_series("arima", window=3, season=3)


def test_seasonal_naive_is_the_last_value_until_a_season_is_known() -> None:
    sn = SeasonalNaive(4)
    for value, expected in ((5.0, 5.0), (9.0, 9.0), (2.0, 2.0)):
        sn.add(value)
        assert sn.predict() == expected


def test_seasonal_naive_repeats_one_season_ago_after_a_full_season() -> None:
    sn = SeasonalNaive(4)
    feed(sn, [1.0, 2.0, 3.0, 4.0])  # the 5th interval is one season after the 1st
    assert sn.predict() == 1.0
    sn.add(5.0)  # the 6th: one season after the 2nd
    assert sn.predict() == 2.0
    feed(sn, [6.0, 7.0, 8.0])  # the 9th: one after the 5th
    assert sn.predict() == 5.0


def test_last_value_repeats_the_last() -> None:
    last = LastValue()
    feed(last, [3.0, 8.0])
    assert last.predict() == 8.0


def test_load_predictor_forecasts_each_series_on_its_own() -> None:
    lp = LoadPredictor("moving-average", window=3)
    for rate, prompt, output in ((1, 100, 10), (2, 200, 10), (3, 300, 10)):
        lp.add(Load(rate, prompt, output))
    predicted = lp.predict()
    assert predicted is not None
    assert predicted.request_rate == pytest.approx(4.0)
    assert predicted.prompt_tokens == pytest.approx(400.0)
    assert predicted.output_tokens == pytest.approx(10.0)


def test_load_predictor_keeps_lengths_over_empty_intervals() -> None:
    """An interval without requests says the rate is 0 and nothing about lengths."""
    lp = LoadPredictor("moving-average", window=3)
    lp.add(Load(4.0, 500.0, 50.0))
    lp.add(Load(4.0, 500.0, 50.0))
    for _ in range(3):
        lp.add(Load(0.0, 0.0, 0.0))  # what ``interval`` reports with no request
    predicted = lp.predict()
    assert predicted is not None
    assert predicted.request_rate == pytest.approx(0.0)
    assert (predicted.prompt_tokens, predicted.output_tokens) == (500.0, 50.0)
    last = LoadPredictor("last")
    last.add(Load(2.0, 800.0, 80.0))
    last.add(Load(0.0, 0.0, 0.0))
    assert last.predict() == Load(0.0, 800.0, 80.0)
    seasonal = LoadPredictor("seasonal-naive", season=2)
    seasonal.add(Load(3.0, 300.0, 30.0))
    seasonal.add(Load(0.0, 0.0, 0.0))
    # Rate: one season (two intervals) ago, 3; lengths: only one known, so the last one.
    assert seasonal.predict() == Load(3.0, 300.0, 30.0)


def test_load_predictor_with_only_empty_intervals_predicts_no_lengths() -> None:
    lp = LoadPredictor("last")
    lp.add(Load(0.0, 0.0, 0.0))
    assert lp.predict() == Load(0.0, 0.0, 0.0)
