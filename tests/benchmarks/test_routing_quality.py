"""The routing benchmark's arithmetic (load scaling, ITL, spread) and a real ``--quick`` run."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from benchmarks.traces import (
    Segment,
    SegmentKind,
    Trace,
    TraceRequest,
    load_mooncake,
    oracle_hit_rate,
)

from benchmarks import routing_quality as rq
from turnout.engines.mocker.timing import PolynomialTimingModel


@dataclass(frozen=True)
class LinearModel:
    """prefill_ms(T) = 0.01 T + 20: a full chunk of 1000 tokens takes 30 ms."""

    def prefill_ms(self, new_tokens: int) -> float:
        return 0.01 * new_tokens + 20.0

    def decode_ms(self, batch_size: int, kv_usage: float) -> float:
        return 10.0


def write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def result(
    index: int,
    *,
    ttft: float = 0.1,
    e2e: float = 1.0,
    prompt: int = 100,
    output: int = 10,
    worker: str | None = "w0",
    error: str | None = None,
) -> rq.RequestResult:
    return rq.RequestResult(
        index, ttft_s=ttft, e2e_s=e2e, prompt_tokens=prompt, output_tokens=output,
        worker_id=worker, error=error,
    )  # fmt: skip


# ------------------------------------------------------------------------------------ load


def test_capacity_is_workers_times_full_chunk_throughput() -> None:
    # 1000 tokens in 30 ms = 33,333 tokens/s per worker.
    assert rq.prefill_capacity(3, 1000, LinearModel()) == pytest.approx(100_000.0)
    model = PolynomialTimingModel()
    per_worker = 8192 / (model.prefill_ms(8192) / 1000.0)
    assert rq.prefill_capacity(8) == pytest.approx(8 * per_worker)
    assert 40_000 < per_worker < 60_000  # the default model's ~48k tokens/s


def test_load_scale_hand_computed() -> None:
    # 600,000 uncached tokens over a 10 s trace offer 60,000 tokens/s; half of a 100,000
    # tokens/s cluster is 50,000/s, so the trace must be stretched 1.2x.
    assert rq.load_sim_scale(600_000, 10.0, 100_000.0, 0.5) == pytest.approx(1.2)
    assert rq.load_sim_scale(600_000, 10.0, 100_000.0, 1.2) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        rq.load_sim_scale(600_000, 0.0, 100_000.0, 0.5)
    with pytest.raises(ValueError):
        rq.load_sim_scale(600_000, 10.0, 100_000.0, 0.0)


def test_auto_speedup_aims_at_the_wall_rate_within_bounds() -> None:
    # 100 requests over 20 simulated s at 10 requests per wall second: 10 wall s, speedup 2.
    assert rq.auto_speedup(100, 20.0, 10.0, (0.02, 10.0)) == pytest.approx(2.0)
    assert rq.auto_speedup(100, 2000.0, 10.0, (0.02, 10.0)) == 10.0
    assert rq.auto_speedup(100, 0.01, 10.0, (0.02, 10.0)) == 0.02


def test_plan_cell_on_a_hand_made_trace(tmp_path: Path) -> None:
    # Three requests of unique blocks (nothing cached): 1536 uncached tokens over 4 s.
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 512, "output_length": 4, "hash_ids": [1]},
        {"timestamp": 1000, "input_length": 512, "output_length": 4, "hash_ids": [2]},
        {"timestamp": 4000, "input_length": 512, "output_length": 4, "hash_ids": [3]},
    ])  # fmt: skip
    trace = load_mooncake(path)
    oracle = oracle_hit_rate(trace, 64)
    assert oracle.uncached_tokens == 1536
    capacity = rq.prefill_capacity(2, 8192)
    plan = rq.plan_cell(
        trace, oracle, 2, 0.5, max_num_batched_tokens=8192, speedup=None, wall_rate=10.0
    )
    assert plan.capacity_tokens_per_s == pytest.approx(capacity)
    assert plan.sim_scale == pytest.approx(1536 / (4.0 * 0.5 * capacity))
    assert plan.offered_tokens_per_s == pytest.approx(0.5 * capacity)
    assert plan.sim_span_s == pytest.approx(4.0 * plan.sim_scale)
    # The automatic speedup makes 3 requests arrive at 10/s... unless clamped at 0.02.
    expected_speedup = max(10.0 * plan.sim_span_s / 3, rq.SPEEDUP_BOUNDS[0])
    assert plan.speedup == pytest.approx(expected_speedup)
    assert plan.time_scale == pytest.approx(plan.sim_scale / plan.speedup)
    assert plan.wall_span_s == pytest.approx(4.0 * plan.time_scale)
    fixed = rq.plan_cell(
        trace, oracle, 2, 0.5, max_num_batched_tokens=8192, speedup=4.0, wall_rate=10.0
    )
    assert fixed.speedup == 4.0 and fixed.time_scale == pytest.approx(fixed.sim_scale / 4.0)


# ------------------------------------------------------------------------------- reporting


def test_itl_is_time_after_the_first_token_per_later_token() -> None:
    results = [
        result(0, ttft=0.1, e2e=1.1, output=11),  # 1.0 s over 10 gaps
        result(1, ttft=0.2, e2e=0.6, output=5),  # 0.4 s over 4 gaps
        result(2, ttft=0.2, e2e=0.3, output=1),  # a single token: no ITL
        result(3, ttft=None, e2e=None, output=0, error="boom"),
    ]
    assert rq.itl_values(results) == pytest.approx([0.1, 0.1])


def test_spread_is_max_over_mean_prompt_tokens_over_all_workers() -> None:
    results = [
        result(0, prompt=300, worker="a"),
        result(1, prompt=100, worker="b"),
        result(2, prompt=200, worker="a"),
        result(3, prompt=999, worker="c", error="failed requests do not count"),
    ]
    per_worker, spread = rq.work_spread(results, num_workers=4)
    assert per_worker == {"a": 500, "b": 100}
    # mean over 4 workers (two served nothing) = 600 / 4 = 150; max 500.
    assert spread == pytest.approx(500 / 150)
    assert rq.work_spread(results[:2], num_workers=2)[1] == pytest.approx(300 / 200)
    assert rq.work_spread([], num_workers=2) == ({}, 0.0)


def test_summarize_reports_simulated_times_and_throughput() -> None:
    results = [
        result(0, ttft=0.1, e2e=1.1, prompt=400, output=11, worker="a"),
        result(1, ttft=0.3, e2e=0.7, prompt=400, output=5, worker="b"),
    ]
    results[0].cached_tokens = 300
    s = rq.summarize(results, elapsed=2.0, speedup=0.5, num_workers=2)
    assert s["num_ok"] == 2 and s["num_errors"] == 0
    assert s["cache_hit_rate"] == pytest.approx(300 / 800)
    assert s["ttft_sim_ms"]["p50"] == pytest.approx(100.0)  # 200 wall ms x 0.5
    assert s["itl_sim_ms"]["p50"] == pytest.approx(50.0)  # 100 wall ms x 0.5
    assert s["output_tokens_per_s"] == pytest.approx(8.0)
    assert s["sim_output_tokens_per_s"] == pytest.approx(16.0)  # 2 wall s = 1 simulated s
    assert s["requests_per_s"] == pytest.approx(1.0)
    assert s["spread"] == pytest.approx(1.0)
    assert s["ttft_sim_s_sorted"] == [0.05, 0.15]


def test_worker_labels_of_turnout_and_dynamo() -> None:
    assert rq.worker_label("abc") == "abc"
    assert rq.worker_label(None) is None
    assert rq.worker_label({"prefill_worker_id": 7, "decode_worker_id": 9}) == "9"
    assert rq.worker_label({"decode_worker_id": 9, "decode_dp_rank": 2}) == "9/2"


# ------------------------------------------------------------------------------- arguments


def test_defaults_depend_on_the_trace_and_quick() -> None:
    synthetic = rq.parse_args([])
    assert synthetic.modes == rq.DEFAULT_MODES
    assert synthetic.workers == [8, 32] and synthetic.load == [0.7, 0.95]
    assert synthetic.sessions == 300 and synthetic.max_requests is None
    assert synthetic.out.name == "routing_quality_synthetic.json"
    mooncake = rq.parse_args(["--trace", "mooncake"])
    assert (mooncake.window_start, mooncake.max_requests) == (2000, 500)
    assert mooncake.max_input_length == 16384
    assert mooncake.num_gpu_blocks * mooncake.block_size >= 16384 + mooncake.max_output_length
    quick = rq.parse_args(["--quick", "--workers", "2", "--load", "0.5"])
    assert quick.workers == [2] and quick.load == [0.5]
    assert quick.modes == rq.QUICK["modes"] and quick.sessions == rq.QUICK["sessions"]
    assert quick.out.name == "routing_quality_synthetic_quick.json"
    assert rq.plot_path(Path("r"), "mooncake", 8, 0.95).name == (
        "routing_quality_mooncake_w8_load0.95_ttft_cdf.png"
    )


def test_the_mooncake_default_window_fits_the_default_pool(tmp_path: Path) -> None:
    """The default window (records 2000-2499) of a trace in Mooncake's format, with prompts
    longer than the cut, fits a worker's default pool. A file of our own, so the test runs
    wherever the shared trace is absent."""
    trace_file = tmp_path / "mooncake.jsonl"
    lines = [
        json.dumps({"timestamp": i * 100, "input_length": 40_000 + i, "output_length": 500,
                    "hash_ids": list(range(i, i + 79))})
        for i in range(2600)
    ]  # fmt: skip
    trace_file.write_text("\n".join(lines) + "\n")
    args = rq.parse_args(["--trace", "mooncake", "--mooncake-file", str(trace_file)])
    trace = rq.make_trace(args)
    assert len(trace.requests) == 500 and not trace.has_sessions
    assert trace.requests[0].session_id == "r2000"
    assert rq.trace_context_length(trace) <= args.num_gpu_blocks * args.block_size


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "rq.json"
    report = rq.main([
        "--quick", "--workers", "2", "--modes", "round-robin", "--max-requests", "6",
        "--out", str(out), "--plot-dir", str(tmp_path),
    ])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["trace"]["summary"]["num_requests"] == 6
    assert set(report["oracle"]) >= {"hit_rate", "uncached_tokens", "prompt_tokens"}
    [cell] = report["cells"]
    assert cell["plan"]["workers"] == 2 and cell["plan"]["load"] == 0.7
    assert cell["plan"]["speedup_ratio"] > 0
    [mode] = cell["modes"]
    assert mode["mode"] == "round-robin", mode
    s = mode["summary"]
    assert s["num_ok"] == 6, s["first_errors"]
    for key in ("ttft_sim_ms", "itl_sim_ms", "e2e_sim_ms"):
        assert set(s[key]) == {"p50", "p90", "p99", "mean"}
    assert 0.0 <= s["cache_hit_rate"] <= 1.0
    assert s["sim_output_tokens_per_s"] > 0 and s["sim_requests_per_s"] > 0
    assert sum(s["prompt_tokens_per_worker"].values()) == s["prompt_tokens"]
    assert len(s["prompt_tokens_per_worker"]) <= 2 and s["spread"] >= 1.0
    assert Path(cell["plot"]).exists()


def test_effective_load_shrinks_when_sends_spread_past_the_plan() -> None:
    plan = rq.CellPlan(
        workers=2, load=0.8, capacity_tokens_per_s=1.0, offered_tokens_per_s=0.8,
        sim_scale=1.0, speedup=1.0, time_scale=1.0, sim_span_s=10.0, wall_span_s=10.0,
    )  # fmt: skip
    on_time = [rq.RequestResult(i, sent_at_s=float(t)) for i, t in enumerate((0, 4, 10))]
    assert rq.effective_load(on_time, plan) == pytest.approx(0.8)
    late = [rq.RequestResult(i, sent_at_s=float(t)) for i, t in enumerate((0, 4, 20))]
    assert rq.effective_load(late, plan) == pytest.approx(0.4)
    assert rq.effective_load(late[:1], plan) is None


# ------------------------------------------------------------------------------- the client


class FakeServer:
    """A one-request-per-connection HTTP server streaming a two-token completion.

    Records each request's arrival, headers and end; the first turn of session ``a`` is slow.
    """

    def __init__(self) -> None:
        self.seen: list[dict[str, object]] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            headers = dict(line.split(": ", 1) for line in head.split("\r\n")[1:] if ": " in line)
            headers = {k.lower(): v for k, v in headers.items()}
            body = json.loads(await reader.readexactly(int(headers["content-length"])))
            record: dict[str, object] = {"at": time.perf_counter(), "headers": headers}
            self.seen.append(record)
            prompt = len(body["prompt"])
            if headers.get("x-session-id") == "a" and prompt == 64:
                await asyncio.sleep(0.6)
            head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
            events = [
                {**head, "choices": [{"index": 0, "text": "x", "finish_reason": None}],
                 "nvext": {"worker_id": "w1"}},
                {**head, "choices": [{"index": 0, "text": "y", "finish_reason": "length"}],
                 "usage": {"prompt_tokens": prompt, "completion_tokens": 2,
                           "total_tokens": prompt + 2,
                           "prompt_tokens_details": {"cached_tokens": 32}}},
            ]  # fmt: skip
            payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            payload += b"data: [DONE]\n\n"
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
                + f"content-length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
            record["done"] = time.perf_counter()
        finally:
            writer.close()
            await writer.wait_closed()


def two_turn_trace(has_sessions: bool) -> Trace:
    def request(at: float, session: str, turn: int, length: int) -> TraceRequest:
        return TraceRequest(
            arrival_s=at, session_id=session, turn=turn, input_length=length, output_length=2,
            segments=(Segment(SegmentKind.USER_TEXT, 1, 64), Segment(SegmentKind.USER_TEXT, 2, 64)),
        )  # fmt: skip

    requests = [request(0.0, "a", 0, 64), request(0.05, "b", 0, 100), request(0.1, "a", 1, 128)]
    return Trace("test", requests, token_seed=0, has_sessions=has_sessions)


async def test_replay_sends_session_ids_and_keeps_turns_in_order() -> None:
    fake = FakeServer()
    async with fake as url:
        results, _ = await rq.replay(
            url, "m", two_turn_trace(True), time_scale=1.0, concurrency=8, timeout_s=10
        )
    assert [r.error for r in results] == [None, None, None]
    assert [r.cached_tokens for r in results] == [32, 32, 32]
    assert [r.worker_id for r in results] == ["w1", "w1", "w1"]
    assert [s["headers"].get("x-session-id") for s in fake.seen] == ["a", "b", "a"]  # type: ignore[union-attr]
    first, _, second = fake.seen
    assert second["at"] >= first["done"]  # type: ignore[operator]
    assert results[2].session_wait_s > 0.4 and results[1].session_wait_s == 0.0
    # Latency counts from when the turn could go, not from its (earlier) arrival.
    assert results[2].ttft_s is not None and results[2].ttft_s < 0.4


async def test_replay_without_sessions_sends_no_session_id_and_does_not_wait() -> None:
    fake = FakeServer()
    async with fake as url:
        results, _ = await rq.replay(
            url, "m", two_turn_trace(False), time_scale=1.0, concurrency=8, timeout_s=10,
            keepalive=False,
        )  # fmt: skip
    assert [r.error for r in results] == [None, None, None]
    assert all("x-session-id" not in s["headers"] for s in fake.seen)  # type: ignore[operator]
    assert all(r.session_wait_s == 0.0 for r in results)
