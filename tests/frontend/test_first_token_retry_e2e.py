"""A request that gets no token from its instance goes to another one, over real sockets;
and an instance whose load reports say it is busy is skipped.

Echo workers behind the real frontend: an instance that answers ``overloaded`` or whose
engine fails before the first token costs the request nothing but the try, whatever the
migration budget (0 here); only when every instance refuses is the answer a 503. A stream
that breaks after its first token is still migration's business (with budget 0: it fails).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import msgspec
import pytest
from tests.frontend.stack import ENDPOINT, Stack, make_stack
from tests.polling import eventually

from turnout.engines.echo import EchoEngine
from turnout.engines.worker import Worker
from turnout.protocols.kv import LOAD_TOPIC, LoadReport
from turnout.protocols.llm import ErrorKind, FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.router.mode import RouterMode
from turnout.runtime.context import RequestContext

MODEL = "echo"


class RecordingEcho(EchoEngine):
    """Echo that records the requests it got."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.received: list[PreprocessedRequest] = []

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        self.received.append(request)
        async for output in super().generate(request, ctx):
            yield output


class OverloadedEcho(RecordingEcho):
    """Its queue is always full: every request is refused as ``overloaded``."""

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        self.received.append(request)
        yield LLMEngineOutput(
            finish_reason=FinishReason.ERROR,
            error="waiting queue full",
            error_kind=ErrorKind.OVERLOADED.value,
        )


class FailsEarlyEcho(RecordingEcho):
    """Its engine fails under every request before the first token."""

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        self.received.append(request)
        yield LLMEngineOutput(
            finish_reason=FinishReason.ERROR,
            error="engine died",
            error_kind=ErrorKind.ENGINE_FAILED.value,
        )


class FailsMidStreamEcho(RecordingEcho):
    """Its engine fails under every request after the first token."""

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


@pytest.fixture
async def run_stack() -> AsyncIterator[Callable[..., Awaitable[Stack]]]:
    stacks: list[Stack] = []

    async def start(**config: Any) -> Stack:
        stack = await make_stack(**config)
        stacks.append(stack)
        return stack

    yield start
    for stack in stacks:
        await stack.close()


async def add(stack: Stack, engine: EchoEngine) -> int:
    worker = Worker(stack.runtime, engine, ENDPOINT, model_name=MODEL)
    serving = await worker.start()
    stack.workers.append(worker)
    return serving.instance_id


async def chat(client: httpx.AsyncClient, n: int = 0) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"hello {n}"}],
        "max_tokens": 3,
        "nvext": {"extra_fields": ["worker_id", "migrations"]},
    }
    return await client.post("/v1/chat/completions", json=body)


MODES = [RouterMode.ROUND_ROBIN, RouterMode.RANDOM, RouterMode.KV]


async def until_tried(
    client: httpx.AsyncClient, engine: RecordingEcho, limit: int = 40
) -> list[httpx.Response]:
    """Requests (different prompts, so no instance holds one's prefix) until ``engine``'s
    instance got one, and one more."""
    responses: list[httpx.Response] = []
    while not engine.received:
        assert len(responses) < limit, f"{limit} requests and none reached the instance"
        responses.append(await chat(client, len(responses)))
    responses.append(await chat(client, len(responses)))
    return responses


@pytest.mark.parametrize("mode", MODES)
async def test_an_overloaded_instance_costs_only_a_try(
    gguf_path: str, run_stack: Callable[..., Awaitable[Stack]], mode: RouterMode
) -> None:
    stack = await run_stack(router_mode=mode, migration_limit=0)
    full, steady = OverloadedEcho(gguf_path), RecordingEcho(gguf_path)
    await add(stack, full)
    await add(stack, steady)
    await stack.wait_for_model(MODEL, instances=2)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        responses = await until_tried(client, full)
    assert [r.status_code for r in responses] == [200] * len(responses)
    assert len(steady.received) == len(responses)  # every request, refused or not, ended there


@pytest.mark.parametrize("mode", MODES)
async def test_every_instance_overloaded_is_a_503(
    gguf_path: str, run_stack: Callable[..., Awaitable[Stack]], mode: RouterMode
) -> None:
    stack = await run_stack(router_mode=mode, migration_limit=3)
    engines = [OverloadedEcho(gguf_path) for _ in range(2)]
    for engine in engines:
        await add(stack, engine)
    await stack.wait_for_model(MODEL, instances=2)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        response = await chat(client)
    assert response.status_code == 503
    assert "overloaded" in response.json()["error"]["message"]
    assert [len(e.received) for e in engines] == [1, 1]  # each tried once, no more


@pytest.mark.parametrize("mode", MODES)
async def test_a_failure_before_the_first_token_spends_no_migration(
    gguf_path: str, run_stack: Callable[..., Awaitable[Stack]], mode: RouterMode
) -> None:
    stack = await run_stack(router_mode=mode, migration_limit=0)
    failing, steady = FailsEarlyEcho(gguf_path), RecordingEcho(gguf_path)
    await add(stack, failing)
    await add(stack, steady)
    await stack.wait_for_model(MODEL, instances=2)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        responses = await until_tried(client, failing)
    assert [r.status_code for r in responses] == [200] * len(responses)
    assert len(steady.received) == len(responses)
    assert all(r.json()["nvext"].get("migrations", 0) == 0 for r in responses)


async def test_a_failure_mid_stream_without_budget_still_fails(
    gguf_path: str, run_stack: Callable[..., Awaitable[Stack]]
) -> None:
    stack = await run_stack(router_mode=RouterMode.ROUND_ROBIN, migration_limit=0)
    failing, steady = FailsMidStreamEcho(gguf_path), RecordingEcho(gguf_path)
    await add(stack, failing)
    await add(stack, steady)
    await stack.wait_for_model(MODEL, instances=2)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        # Round-robin over two instances: one request each.
        responses = [await chat(client) for _ in range(2)]
    assert len(failing.received) == 1 and len(steady.received) == 1
    assert sorted(r.status_code == 200 for r in responses) == [False, True]


@pytest.mark.parametrize("mode", [RouterMode.ROUND_ROBIN, RouterMode.RANDOM])
async def test_an_instance_that_reports_busy_is_skipped(
    gguf_path: str, run_stack: Callable[..., Awaitable[Stack]], mode: RouterMode
) -> None:
    stack = await run_stack(router_mode=mode)
    busy, free = RecordingEcho(gguf_path), RecordingEcho(gguf_path)
    busy_id = await add(stack, busy)
    await add(stack, free)
    await stack.wait_for_model(MODEL, instances=2)
    publisher = await stack.runtime.event_plane.publisher(ENDPOINT.namespace, ENDPOINT.component)
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            assert (await chat(client)).status_code == 200  # the pipeline exists
            load = stack.frontend.factory.served[MODEL].load
            assert load is not None

            def reported(busy_now: bool) -> bool:
                # Published on every look: the frontend's feed is subscribed asynchronously.
                report = LoadReport(worker_id=busy_id, busy=busy_now)
                publisher.publish_nowait(LOAD_TOPIC, msgspec.msgpack.encode(report))
                return load.is_busy(busy_id) is busy_now

            await eventually(lambda: reported(True), what="the busy report applied")
            before = len(busy.received)
            responses = [await chat(client, n) for n in range(8)]
            assert [r.status_code for r in responses] == [200] * 8
            assert len(busy.received) == before  # none went to the busy instance
            await eventually(lambda: reported(False), what="the free report applied")
            responses = [await chat(client, n) for n in range(8, 24)]
            assert len(busy.received) > before
    finally:
        await publisher.close()
