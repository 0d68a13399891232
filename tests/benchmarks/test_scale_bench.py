"""The scale benchmarks' pieces: reading histograms off ``/metrics``, the virtual-time loop of
``fleet_events`` and a short simulated fleet, the streams client's completion rules."""

from __future__ import annotations

import argparse
import asyncio
import math
import time

import pytest

from benchmarks import fleet_events, scale_stack, streams

METRICS = """\
# HELP turnout_kv_router_decision_seconds Time of one KV routing decision
# TYPE turnout_kv_router_decision_seconds histogram
turnout_kv_router_decision_seconds_bucket{le="0.001",model="a"} 4.0
turnout_kv_router_decision_seconds_bucket{le="0.01",model="a"} 8.0
turnout_kv_router_decision_seconds_bucket{le="+Inf",model="a"} 10.0
turnout_kv_router_decision_seconds_bucket{le="0.001",model="b"} 6.0
turnout_kv_router_decision_seconds_bucket{le="0.01",model="b"} 10.0
turnout_kv_router_decision_seconds_bucket{le="+Inf",model="b"} 10.0
turnout_kv_events_applied_total{model="a"} 3.0
turnout_kv_events_applied_total{model="b"} 4.5
"""


def test_histogram_buckets_are_summed_over_label_sets() -> None:
    family = scale_stack.find_family(METRICS, r"decision.*seconds")
    assert family == "turnout_kv_router_decision_seconds"
    buckets = scale_stack.histogram_buckets(METRICS, family)
    assert buckets == {0.001: 10.0, 0.01: 18.0, math.inf: 20.0}
    assert scale_stack.counter_sum(METRICS, "turnout_kv_events_applied_total") == 7.5
    assert scale_stack.find_family(METRICS, "nothing") is None


@pytest.mark.parametrize(
    ("q", "expected"),
    [(0.25, 0.0005), (0.5, 0.001), (0.7, 0.001 + 0.009 * 4 / 8), (0.95, math.inf)],
)
def test_bucket_quantile_interpolates_inside_its_bucket(q: float, expected: float) -> None:
    buckets = {0.001: 10.0, 0.01: 18.0, math.inf: 20.0}
    assert scale_stack.bucket_quantile(buckets, q) == pytest.approx(expected)


def test_bucket_quantile_of_an_empty_window_is_none() -> None:
    assert scale_stack.bucket_quantile({}, 0.5) is None
    assert scale_stack.bucket_quantile({0.001: 0.0, math.inf: 0.0}, 0.5) is None
    before = {0.001: 1.0, math.inf: 2.0}
    assert scale_stack.minus({0.001: 4.0, math.inf: 6.0}, before) == {0.001: 3.0, math.inf: 4.0}


def test_virtual_time_loop_jumps_to_the_next_timer() -> None:
    loop = fleet_events.VirtualTimeLoop()
    try:
        wall0 = time.monotonic()

        async def sleepers() -> list[float]:
            seen: list[float] = []

            async def one(delay: float) -> None:
                await asyncio.sleep(delay)
                seen.append(asyncio.get_running_loop().time())

            await asyncio.gather(one(3600.0), one(60.0), one(1.5))
            return seen

        assert loop.run_until_complete(sleepers()) == [1.5, 60.0, 3600.0]
        assert time.monotonic() - wall0 < 30  # an hour of simulated time, not of waiting
    finally:
        loop.close()


def fleet_args(**changes: object) -> argparse.Namespace:
    settings: dict[str, object] = {
        "sim_workers": 2, "seconds": 20.0, "warmup_seconds": 5.0, "rate": 2.0,
        "prompt_tokens": 512, "shared": 0.5, "prefixes": 4, "output_tokens": 16,
        "block_size": 64, "num_gpu_blocks": 64, "fleet": [10, 1000], "shards": 10,
        "us_per_report": 10.0, "us_per_block": 1.0,
    }  # fmt: skip
    return argparse.Namespace(**(settings | changes))


def test_simulated_workers_publish_events_and_reports() -> None:
    args = fleet_args()
    loop = fleet_events.VirtualTimeLoop()
    try:
        per_worker = loop.run_until_complete(fleet_events.simulate(args))
    finally:
        loop.close()
    assert per_worker["requests_per_worker_s"] > 0.5
    assert per_worker["blocks_stored"] > 0
    assert per_worker["blocks_removed"] > 0  # 64 blocks fill within the run: eviction
    assert per_worker["load_reports"] >= 1.0  # at least the once-a-second beat
    rows = fleet_events.extrapolate(per_worker, args)
    assert [r["workers"] for r in rows] == [10, 1000]
    msgs = per_worker["kv_batches"] + per_worker["load_reports"]
    assert rows[1]["published_msgs_per_s"] == round(1000 * msgs)
    assert rows[1]["per_shard_msgs_per_s"] == round(100 * msgs)


def finish(proto: streams._Stream, *chunks: bytes) -> None:
    for chunk in chunks:
        proto.data_received(chunk)


def stream(loop: asyncio.AbstractEventLoop) -> tuple[streams._Stream, asyncio.Future[str]]:
    done: asyncio.Future[str] = loop.create_future()
    return streams._Stream(b"", done, {"open": 1, "peak_open": 1}), done


def test_stream_outcomes() -> None:
    loop = asyncio.new_event_loop()
    try:
        head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        ok, done = stream(loop)
        # The end marker split across reads is still found.
        finish(
            ok, head, b'10\r\ndata: {"x": 1}\n\n\r\n', b"e\r\ndata: [DO", b"NE]\n\n\r\n0\r\n\r\n"
        )
        assert done.result() == "ok"
        errored, done = stream(loop)
        finish(errored, head, b'15\r\ndata: {"error": {}}\n\n\r\n0\r\n\r\n')
        assert done.result() == "error event"
        refused, done = stream(loop)
        finish(refused, b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\n\r\n{}")
        assert done.result() == "status 503"
        cut, done = stream(loop)
        finish(cut, head, b'10\r\ndata: {"x": 1}\n\n\r\n')
        cut.connection_lost(ConnectionResetError())
        assert done.result() == "connection lost (ConnectionResetError)"
    finally:
        loop.close()
