"""Admission control through the real frontend: the HTTP server on a real port, TCP request plane,
echo workers held at a gate so "in flight" is exact, and the httpx / openai clients.

Queue timeouts run on an injected clock; every wait is for an observable state (a count
reached), bounded, never a sleep that hopes time passed."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable

import httpx
import openai
import pytest
from tests.frontend.fake_clock import FakeClock
from tests.frontend.stack import ENDPOINT, Stack, echo_engine
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.echo import EchoEngine
from turnout.frontend.admission.limiter import Clock
from turnout.frontend.service import Frontend, FrontendConfig, free_port
from turnout.protocols.llm import LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import EndpointId
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery.memory import MemoryStore


class GatedEcho(EchoEngine):
    """Echo that holds every request until ``gate`` opens, and records arrivals in order
    (by ``max_tokens``, which each test makes distinct where order matters)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gate = asyncio.Event()
        self.arrived: list[int | None] = []

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        self.arrived.append(request.stop_conditions.max_tokens)
        await self.gate.wait()
        async for out in super().generate(request, ctx):
            yield out


async def start_stack(clock: Clock | None = None, **config: object) -> Stack:
    runtime = await DistributedRuntime.create(
        store=MemoryStore(), request_plane="tcp", lease_ttl=5.0
    )
    cfg = FrontendConfig(port=free_port(), **config)  # type: ignore[arg-type]
    frontend = Frontend(cfg, runtime=runtime, clock=clock)
    await frontend.start()
    return Stack(runtime=runtime, frontend=frontend)


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Until ``condition()`` holds; a generous bound only guards against a hang."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)
    assert condition(), what


def body(max_tokens: int = 1, priority: int | None = None, model: str = "echo") -> dict:
    out: dict = {"model": model, "prompt": "one two three four", "max_tokens": max_tokens}
    if priority is not None:
        out["nvext"] = {"priority": priority}
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of ``/metrics`` (0 when absent)."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m and want <= set((m.group(1) or "").split(",")) - {""}:
            return float(m.group(2))
    return 0.0


async def gated_stack(gguf_path: str, clock: Clock | None = None, **config: object) -> tuple[
    Stack, GatedEcho
]:  # fmt: skip
    stack = await start_stack(clock, **config)
    engine = GatedEcho(gguf_path)
    await stack.add_worker(engine)
    await stack.wait_for_model("echo")
    return stack, engine


@pytest.mark.parametrize("status", [429, 503, 529])
async def test_full_queue_rejects_with_configured_status(gguf_path: str, status: int) -> None:
    before = set(asyncio.all_tasks())
    stack, engine = await gated_stack(gguf_path, max_inflight=1, queue_size=1, reject_status=status)
    admission = stack.frontend.admission
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            running = asyncio.create_task(http.post("/v1/completions", json=body()))
            await eventually(lambda: len(engine.arrived) == 1, "first request at the worker")
            queued = asyncio.create_task(http.post("/v1/completions", json=body()))
            await eventually(lambda: admission.queued == 1, "second request queued")

            r = await http.post("/v1/completions", json=body())
            assert r.status_code == status
            assert r.headers["retry-after"] == "1"
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "overloaded_error"
            assert error["code"] == "server_overloaded"
            assert "--max-inflight 1" in error["message"]
            assert "--queue-size 1" in error["message"]

            # The official client sees the same status, as an APIStatusError.
            api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="-", max_retries=0)
            with pytest.raises(openai.APIStatusError) as info:
                await api.completions.create(model="echo", prompt="x", max_tokens=1)
            assert info.value.status_code == status
            await api.close()

            metrics = (await http.get("/metrics")).text
            assert metric(metrics, "turnout_queued_requests") == 1
            assert (
                metric(metrics, "turnout_rejections_total", model="echo", reason="queue_full") == 2
            )
            engine.gate.set()
            assert (await running).status_code == 200
            assert (await queued).status_code == 200
            metrics = (await http.get("/metrics")).text
            assert metric(metrics, "turnout_queued_requests") == 0
            assert metric(metrics, "turnout_queue_wait_seconds_count", model="echo") == 2
            assert admission.inflight == 0
    finally:
        await stack.close()
    await assert_no_leaked_tasks(before)


async def test_priority_orders_the_queue(gguf_path: str) -> None:
    stack, engine = await gated_stack(gguf_path, max_inflight=1, queue_size=8)
    admission = stack.frontend.admission
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            tasks = [asyncio.create_task(http.post("/v1/completions", json=body(1)))]
            await eventually(lambda: len(engine.arrived) == 1, "first request at the worker")
            # max_tokens tells the requests apart; priority None is the default, 0.
            for n, (max_tokens, priority) in enumerate(
                [(2, None), (3, 5), (4, 1), (5, 5), (6, -2), (7, 0)], start=1
            ):
                request = body(max_tokens, priority)
                tasks.append(asyncio.create_task(http.post("/v1/completions", json=request)))
                await eventually(lambda n=n: admission.queued == n, f"{n} queued")
            engine.gate.set()
            responses = await asyncio.gather(*tasks)
            assert [r.status_code for r in responses] == [200] * 7
            # One at a time, in priority order, first come first served within a priority.
            assert engine.arrived == [1, 3, 5, 4, 2, 7, 6]
    finally:
        await stack.close()


async def test_queue_timeout_on_injected_clock(gguf_path: str) -> None:
    clock = FakeClock()
    stack, engine = await gated_stack(
        gguf_path, clock, max_inflight=1, queue_size=4, queue_timeout=5.0, reject_status=429
    )
    admission = stack.frontend.admission
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            running = asyncio.create_task(http.post("/v1/completions", json=body()))
            await eventually(lambda: len(engine.arrived) == 1, "first request at the worker")
            waiting = asyncio.create_task(http.post("/v1/completions", json=body()))
            await eventually(lambda: admission.queued == 1, "second request queued")
            clock.advance(4.0)
            await asyncio.sleep(0.05)  # time under test: short of its deadline, it still waits
            assert not waiting.done()
            clock.advance(1.5)
            r = await waiting
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "overloaded_error"
            assert "--queue-timeout" in r.json()["error"]["message"]
            metrics = (await http.get("/metrics")).text
            labels = {"model": "echo", "reason": "queue_timeout"}
            assert metric(metrics, "turnout_rejections_total", **labels) == 1
            assert metric(metrics, "turnout_queue_wait_seconds_sum", model="echo") == 5.5
            engine.gate.set()
            assert (await running).status_code == 200
            assert engine.arrived == [1]  # the timed-out request never reached the worker
    finally:
        await stack.close()


async def test_disconnected_queued_client_frees_its_place(gguf_path: str) -> None:
    stack, engine = await gated_stack(gguf_path, max_inflight=1, queue_size=1)
    admission = stack.frontend.admission
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            running = asyncio.create_task(http.post("/v1/completions", json=body(1)))
            await eventually(lambda: len(engine.arrived) == 1, "first request at the worker")
            # Its own client, so cancelling it closes its connection.
            async with httpx.AsyncClient(base_url=stack.url, timeout=30) as leaver:
                gone = asyncio.create_task(leaver.post("/v1/completions", json=body(2)))
                await eventually(lambda: admission.queued == 1, "second request queued")
                gone.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await gone
            await eventually(lambda: admission.queued == 0, "the leaver left the queue")
            # Its place is free: the next request waits instead of being rejected.
            next_one = asyncio.create_task(http.post("/v1/completions", json=body(3)))
            await eventually(lambda: admission.queued == 1, "third request queued")
            engine.gate.set()
            assert (await running).status_code == 200
            assert (await next_one).status_code == 200
            assert engine.arrived == [1, 3]
            assert admission.inflight == 0
            metrics = (await http.get("/metrics")).text
            assert 'status="499"' in metrics
    finally:
        await stack.close()


async def test_per_model_limit(gguf_path: str) -> None:
    stack = await start_stack(max_inflight=10, max_inflight_per_model=1, queue_size=0)
    hot, cold = GatedEcho(gguf_path), echo_engine(gguf_path)
    await stack.add_worker(hot, model_name="hot")
    other = EndpointId(namespace=ENDPOINT.namespace, component="cold", name=ENDPOINT.name)
    await stack.add_worker(cold, model_name="cold", endpoint=other)
    await stack.wait_for_model("hot")
    await stack.wait_for_model("cold")
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            running = asyncio.create_task(http.post("/v1/completions", json=body(model="hot")))
            await eventually(lambda: len(hot.arrived) == 1, "hot request at the worker")
            r = await http.post("/v1/completions", json=body(model="hot"))
            assert r.status_code == 503
            assert "--max-inflight-per-model 1" in r.json()["error"]["message"]
            # The other model still has room.
            r = await http.post("/v1/completions", json=body(model="cold"))
            assert r.status_code == 200, r.text
            metrics = (await http.get("/metrics")).text
            labels = {"model": "hot", "reason": "model_limit"}
            assert metric(metrics, "turnout_rejections_total", **labels) == 1
            hot.gate.set()
            assert (await running).status_code == 200
    finally:
        await stack.close()


async def raw_post(host: str, port: int, payload: dict) -> tuple[int, dict[str, str], dict]:
    """One request on its own connection, HTTP/1.1 by hand: httpx costs ~2 ms of CPU per
    request, which thousands of requests on a 2-core machine cannot afford."""
    data = json.dumps(payload).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (host.encode(), len(data), data)
        )
        raw = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, content = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(content)


async def test_thousands_of_concurrent_requests_get_200_or_a_clean_rejection(
    gguf_path: str,
) -> None:
    """2,000 requests at once (1,800 on raw sockets, 200 through httpx) against 32 slots
    and 64 places: exactly 96 are served, the rest rejected at once, and nothing hangs."""
    before = set(asyncio.all_tasks())
    stack, engine = await gated_stack(gguf_path, max_inflight=32, queue_size=64)
    admission = stack.frontend.admission
    host, port = stack.frontend.config.host, stack.frontend.config.port
    raw_count, httpx_count, clients = 1800, 200, 10
    total = raw_count + httpx_count
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    https = [httpx.AsyncClient(base_url=stack.url, timeout=60, limits=limits) for _ in range(10)]

    async def via_httpx(i: int) -> tuple[int, dict[str, str], dict]:
        r = await https[i % clients].post("/v1/completions", json=body(1, i % 4))
        return r.status_code, dict(r.headers), r.json()

    try:
        async with asyncio.timeout(60):
            tasks = [
                asyncio.create_task(raw_post(host, port, body(1, i % 4))) for i in range(raw_count)
            ] + [asyncio.create_task(via_httpx(i)) for i in range(httpx_count)]
            await eventually(lambda: sum(t.done() for t in tasks) == total - 96, "rejections", 50)
            assert (admission.inflight, admission.queued) == (32, 64)
            engine.gate.set()
            responses = await asyncio.gather(*tasks)
        statuses = [status for status, _, _ in responses]
        assert statuses.count(200) == 96
        assert statuses.count(503) == total - 96
        for status, headers, content in responses:
            if status == 503:
                assert headers["retry-after"] == "1"
                assert content["error"]["code"] == "server_overloaded"
            else:
                assert content["choices"][0]["text"]
        assert (admission.inflight, admission.queued) == (0, 0)
    finally:
        for http in https:
            await http.aclose()
        await stack.close()
    await assert_no_leaked_tasks(before)
