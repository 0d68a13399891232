"""The load-based router modes end to end: echo workers behind the real frontend, over real
sockets. Requests are held in flight on gated engines, so what is measured is where the
router sent them, never how fast anything ran."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from tests.frontend.stack import ENDPOINT, Stack, make_stack

from turnout.engines.echo import EchoEngine
from turnout.engines.worker import Worker
from turnout.errors import ConfigError
from turnout.protocols.llm import ErrorKind, FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.router.mode import RouterMode
from turnout.runtime.context import RequestContext

MODEL = "echo"


class GatedEcho(EchoEngine):
    """Echo that holds every request after its first token until ``gate`` is set, and
    records the requests it got."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()
        self.received: list[PreprocessedRequest] = []
        self.active = 0

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        self.received.append(request)
        self.active += 1
        try:
            first = True
            async for out in super().generate(request, ctx):
                yield out
                if first:
                    first = False
                    await self.gate.wait()
        finally:
            self.active -= 1


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


async def add(stack: Stack, engine: GatedEcho, device_type: str | None = None) -> int:
    worker = Worker(stack.runtime, engine, ENDPOINT, model_name=MODEL, device_type=device_type)
    serving = await worker.start()
    stack.workers.append(worker)
    return serving.instance_id


def in_flight(stack: Stack) -> dict[int, int]:
    factory = stack.frontend.factory
    assert factory is not None
    load = factory.served[MODEL].load
    assert load is not None
    return load.snapshot()


def body() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4,
        "stream": True,
    }


async def hold(
    client: httpx.AsyncClient, n: int, make: Callable[[], dict[str, Any]] = body
) -> list[asyncio.Task[int]]:
    async def one() -> int:
        async with client.stream("POST", "/v1/chat/completions", json=make()) as response:
            async for _ in response.aiter_lines():
                pass
            return response.status_code

    return [asyncio.create_task(one()) for _ in range(n)]


@pytest.fixture
async def run_stack() -> AsyncIterator[Callable[..., Awaitable[Stack]]]:
    stacks: list[Stack] = []

    async def start(**config: Any) -> Stack:
        stack = await make_stack(**config)
        stacks.append(stack)
        return stack

    yield start
    for stack in stacks:
        for worker in stack.workers:
            getattr(worker.engine, "gate", asyncio.Event()).set()
        await stack.close()


async def test_least_loaded_balances_exactly_and_counts_return_to_zero(
    gguf_path: str, run_stack: Callable[..., Awaitable[Stack]]
) -> None:
    stack = await run_stack(router_mode=RouterMode.LEAST_LOADED)
    engines = [GatedEcho(gguf_path) for _ in range(3)]
    ids = [await add(stack, e) for e in engines]
    await stack.wait_for_model(MODEL, instances=3)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        tasks = await hold(client, 9)
        await until(lambda: sum(e.active for e in engines) == 9)
        assert [e.active for e in engines] == [3, 3, 3]
        assert in_flight(stack) == dict.fromkeys(ids, 3)
        for e in engines:
            e.gate.set()
        assert await asyncio.gather(*tasks) == [200] * 9
    await until(lambda: in_flight(stack) == {})


async def test_a_client_that_disconnects_leaves_no_count(
    gguf_path: str, run_stack: Callable[..., Awaitable[Stack]]
) -> None:
    stack = await run_stack(router_mode=RouterMode.POWER_OF_TWO)
    engine = GatedEcho(gguf_path)
    instance = await add(stack, engine)
    await stack.wait_for_model(MODEL)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        (task,) = await hold(client, 1)
        await until(lambda: engine.active == 1)
        assert in_flight(stack) == {instance: 1}
        task.cancel()  # the client goes away mid-stream
        with pytest.raises(asyncio.CancelledError):
            await task
    await until(lambda: engine.active == 0)
    await until(lambda: in_flight(stack) == {})


async def test_an_instance_that_leaves_is_forgotten(
    gguf_path: str, run_stack: Callable[..., Awaitable[Stack]]
) -> None:
    stack = await run_stack(router_mode=RouterMode.LEAST_LOADED, migration_limit=0)
    engines = [GatedEcho(gguf_path) for _ in range(2)]
    ids = [await add(stack, e) for e in engines]
    await stack.wait_for_model(MODEL, instances=2)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        tasks = await hold(client, 2)
        await until(lambda: in_flight(stack) == dict.fromkeys(ids, 1))
        leaving = stack.workers.pop(0)
        await leaving.stop(drain_timeout=0.0)
        await until(lambda: ids[0] not in in_flight(stack))
        engines[1].gate.set()
        await asyncio.gather(*tasks)
    await until(lambda: in_flight(stack) == {})


async def test_device_aware_keeps_cpu_under_ratio_times_gpu(
    gguf_path: str, run_stack: Callable[..., Awaitable[Stack]]
) -> None:
    stack = await run_stack(router_mode=RouterMode.DEVICE_AWARE_WEIGHTED, router_cpu_gpu_ratio=1)
    gpu, cpus = GatedEcho(gguf_path), [GatedEcho(gguf_path) for _ in range(2)]
    gpu_id = await add(stack, gpu)  # the echo engine says gpu by default
    cpu_ids = [await add(stack, e, device_type="cpu") for e in cpus]
    await stack.wait_for_model(MODEL, instances=3)
    assert stack.frontend.manager.device_types(MODEL) == {
        gpu_id: "gpu",
        **dict.fromkeys(cpu_ids, "cpu"),
    }
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        for n in range(1, 13):  # one at a time, so each decision sees the ones before
            tasks = await hold(client, 1)
            await until(lambda n=n: gpu.active + sum(e.active for e in cpus) == n)  # type: ignore[misc]
        # Ratio 1, 2 CPUs, 1 GPU: CPUs take a request while cpu < gpu x 2 // 1:
        # g c c g c c ... -> 4 on the GPU, 8 on the CPUs (least-loaded between them).
        assert gpu.active == 4
        assert [e.active for e in cpus] == [4, 4]
        for e in [gpu, *cpus]:
            e.gate.set()
        del tasks
    await until(lambda: in_flight(stack) == {})


class DyingEcho(GatedEcho):
    """Its engine dies under every request after the first token (the frontend migrates)."""

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        self.received.append(request)
        yield LLMEngineOutput(token_ids=request.token_ids[:1])
        yield LLMEngineOutput(
            finish_reason=FinishReason.ERROR,
            error="engine died",
            error_kind=ErrorKind.ENGINE_FAILED.value,
        )


async def test_a_migrated_request_is_counted_on_its_new_instance_only(
    gguf_path: str, run_stack: Callable[..., Awaitable[Stack]]
) -> None:
    stack = await run_stack(router_mode=RouterMode.LEAST_LOADED)
    steady, dying = GatedEcho(gguf_path), DyingEcho(gguf_path)
    steady_id = await add(stack, steady)
    await add(stack, dying)
    await stack.wait_for_model(MODEL, instances=2)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        tasks = await hold(client, 1)
        await until(lambda: steady.active == 1)
        # The next request goes to the idle instance, which dies under it: it moves over.
        tasks += await hold(client, 1)
        await until(lambda: steady.active == 2)
        assert len(dying.received) == 1
        assert in_flight(stack) == {steady_id: 2}
        steady.gate.set()
        assert await asyncio.gather(*tasks) == [200, 200]
    await until(lambda: in_flight(stack) == {})


def test_a_bad_device_type_fails_at_start_up(gguf_path: str) -> None:
    with pytest.raises(ConfigError, match="--device-type must be cpu or gpu, got 'tpu'"):
        Worker(None, EchoEngine(gguf_path), ENDPOINT, device_type="tpu")  # type: ignore[arg-type]
