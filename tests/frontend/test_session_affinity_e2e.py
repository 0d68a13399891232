"""Session affinity end to end: echo workers behind the real frontend, over real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from tests.frontend.stack import Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.echo import EchoEngine
from turnout.errors import ConfigError
from turnout.frontend.models.factory import PipelineFactory
from turnout.frontend.models.manager import ModelKind
from turnout.protocols.llm import ErrorKind, FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.router.mode import RouterMode
from turnout.runtime.context import RequestContext

MODEL = "echo"


class FailingEcho(EchoEngine):
    """Echo whose engine 'dies' under a request after ``fail_after`` tokens when set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_after: int | None = None

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        produced = 0
        async for out in super().generate(request, ctx):
            if self.fail_after is not None and produced >= self.fail_after:
                yield LLMEngineOutput(
                    finish_reason=FinishReason.ERROR,
                    error="engine died",
                    error_kind=ErrorKind.ENGINE_FAILED.value,
                )
                return
            produced += len(out.token_ids)
            yield out


async def start(gguf_path: str, mode: RouterMode, workers: int = 3) -> Stack:
    stack = await make_stack(router_mode=mode, router_session_affinity_ttl_s=60.0)
    for _ in range(workers):
        await stack.add_worker(FailingEcho(gguf_path))
    await stack.wait_for_model(MODEL, instances=workers)
    return stack


@pytest.fixture(params=[RouterMode.ROUND_ROBIN, RouterMode.KV])
async def stack(gguf_path: str, request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    before = set(asyncio.all_tasks())
    s = await start(gguf_path, request.param)
    yield s
    await s.close()
    await assert_no_leaked_tasks(before)


async def complete(
    http: httpx.AsyncClient,
    session: str | None,
    *,
    pin: int | None = None,
    max_tokens: int = 4,
    expect: int = 200,
) -> Any:
    nvext: dict[str, Any] = {"extra_fields": ["worker_id", "migrations"]}
    if pin is not None:
        nvext["backend_instance_id"] = pin
    headers = {"x-session-id": session} if session is not None else {}
    r = await http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": [5, 6, 7, 8] * 8, "max_tokens": max_tokens,
              "nvext": nvext},
        headers=headers,
        timeout=30,
    )  # fmt: skip
    assert r.status_code == expect, r.text
    return r.json()


def worker_of(body: Any) -> int:
    return int(body["nvext"]["worker_id"], 16)


def engine_of(stack: Stack, instance_id: int) -> FailingEcho:
    for worker in stack.workers:
        if worker.serving is not None and worker.serving.instance_id == instance_id:
            assert isinstance(worker.engine, FailingEcho)
            return worker.engine
    raise AssertionError(f"no worker {instance_id:x}")


async def test_sessions_stick_over_many_turns(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        homes = {s: worker_of(await complete(http, s)) for s in ("a", "b", "c", "d")}
        for _ in range(5):
            for session, home in homes.items():
                assert worker_of(await complete(http, session)) == home
        if stack.frontend.config.router_mode is RouterMode.ROUND_ROBIN:
            assert len(set(homes.values())) > 1  # sessions still spread over the workers
        metrics = (await http.get("/metrics")).text
        assert f'turnout_session_affinity_sessions{{model="{MODEL}"}} 4.0' in metrics
        assert f'turnout_session_affinity_refused_total{{model="{MODEL}"}} 0.0' in metrics


async def test_concurrent_first_requests_land_on_one_instance(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        bodies = await asyncio.gather(*(complete(http, "fresh") for _ in range(8)))
    assert len({worker_of(b) for b in bodies}) == 1


async def test_a_pin_to_another_instance_than_the_sessions_is_a_400(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        home = worker_of(await complete(http, "s"))
        other = next(i for i in stack.frontend.manager.model_instances(MODEL) if i != home)
        body = await complete(http, "s", pin=other, expect=400)
        assert body["error"]["param"] == "nvext.backend_instance_id"
        assert f"{home:x}" in body["error"]["message"]
        assert worker_of(await complete(http, "s", pin=home)) == home


async def test_the_session_rebinds_when_its_instance_leaves(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        home = worker_of(await complete(http, "s"))
        worker = next(w for w in stack.workers if w.serving and w.serving.instance_id == home)
        await worker.stop(drain_timeout=1.0)
        stack.workers.remove(worker)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while home in stack.frontend.manager.model_instances(MODEL):
            assert loop.time() < deadline, "the worker did not leave discovery"
            await asyncio.sleep(0.02)
        new_home = worker_of(await complete(http, "s"))
        assert new_home != home
        for _ in range(3):
            assert worker_of(await complete(http, "s")) == new_home


async def test_the_session_rebinds_when_its_instance_is_set_aside(stack: Stack) -> None:
    """What an unreachable instance becomes: set aside by the endpoint client."""
    async with httpx.AsyncClient(base_url=stack.url) as http:
        home = worker_of(await complete(http, "s"))
        pipeline = stack.frontend.manager.get_engine(ModelKind.COMPLETIONS, MODEL)
        pipeline.client.report_instance_down(home)  # type: ignore[attr-defined]
        new_home = worker_of(await complete(http, "s"))
        assert new_home != home
        assert worker_of(await complete(http, "s")) == new_home


async def test_a_bound_request_migrates_when_its_worker_fails_mid_stream(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        home = worker_of(await complete(http, "s"))
        engine_of(stack, home).fail_after = 2
        body = await complete(http, "s", max_tokens=6)
        assert body["nvext"]["migrations"] == 1
        assert body["usage"]["completion_tokens"] == 6
        new_home = worker_of(body)
        assert new_home != home
        engine_of(stack, home).fail_after = None
        # The session re-bound where the migrated request landed.
        assert worker_of(await complete(http, "s")) == new_home


async def test_a_bad_ttl_is_refused_at_start_up() -> None:
    with pytest.raises(ConfigError, match="--router-session-affinity-ttl-secs"):
        PipelineFactory(session_affinity_ttl_s=0.0)
