"""Latency metrics of one request: TTFT once, ITL between one choice's own tokens."""

from __future__ import annotations

from turnout.frontend.metrics.frontend import FrontendMetrics, StreamTimer


def _counts(metrics: FrontendMetrics) -> tuple[float | None, float | None]:
    registry = metrics.registry
    labels = {"model": "m"}
    return (
        registry.get_sample_value("turnout_time_to_first_token_seconds_count", labels),
        registry.get_sample_value("turnout_inter_token_latency_seconds_count", labels),
    )


def test_one_choice_has_a_gap_between_each_pair_of_token_deliveries() -> None:
    metrics = FrontendMetrics()
    timer = StreamTimer(metrics.model("m"))
    for _ in range(4):
        timer.on_tokens()
    assert _counts(metrics) == (1.0, 3.0)


def test_several_choices_measure_each_choices_own_gaps() -> None:
    """Two choices, interleaved: one TTFT for the request; a choice's first token is no
    gap (it follows nothing of its own), so 2 choices x 3 tokens give 2 x 2 gaps."""
    metrics = FrontendMetrics()
    timer = StreamTimer(metrics.model("m"))
    timer.per_choice(2)
    for _ in range(3):
        timer.on_choice_tokens(0)
        timer.on_choice_tokens(1)
    assert _counts(metrics) == (1.0, 4.0)
