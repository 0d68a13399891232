"""In ``kv`` mode a request pinned by its session's binding skips the KV decision, yet its
load is the KV router's to weigh: it is booked on its worker while in flight and freed at
its end. Echo workers behind the real frontend, over real sockets; requests are held in
flight on gated engines, so what is checked is the router's books, never timing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
from tests.frontend.stack import make_stack
from tests.polling import eventually

from turnout.engines.echo import EchoEngine
from turnout.protocols.llm import LLMEngineOutput, PreprocessedRequest
from turnout.router.kv.base import WorkerKey
from turnout.router.mode import RouterMode
from turnout.runtime.context import RequestContext

MODEL = "echo"


class GatedEcho(EchoEngine):
    """Echo that holds every request after its first token until ``gate`` is set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()
        self.active = 0

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
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


async def test_a_session_pinned_request_is_booked_on_its_worker(gguf_path: str) -> None:
    stack = await make_stack(router_mode=RouterMode.KV, router_session_affinity_ttl_s=60.0)
    engines = [GatedEcho(gguf_path) for _ in range(2)]
    try:
        for engine in engines:
            await stack.add_worker(engine, model_name=MODEL)
        await stack.wait_for_model(MODEL, instances=2)
        active = stack.frontend.factory.kv_routers[MODEL].core.active

        def booked() -> dict[WorkerKey, int]:
            return {key: c.num_requests for key, c in active.counters.items() if c.num_requests}

        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:

            async def complete() -> int:
                r = await http.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": [5, 6, 7, 8] * 8, "max_tokens": 4},
                    headers={"x-session-id": "s"},
                )
                return r.status_code

            first = asyncio.create_task(complete())
            await eventually(lambda: sum(e.active for e in engines) == 1, what="first held")
            (worker,) = booked()
            assert booked() == {worker: 1}
            # The session's next request is pinned to the same worker by its binding: the
            # KV router counts it there too.
            second = asyncio.create_task(complete())
            await eventually(lambda: sum(e.active for e in engines) == 2, what="second held")
            assert [e.active for e in engines].count(2) == 1  # both on the bound worker
            assert booked() == {worker: 2}
            for engine in engines:
                engine.gate.set()
            assert await asyncio.gather(first, second) == [200, 200]
        await eventually(lambda: booked() == {}, what="both freed")
    finally:
        for engine in engines:
            engine.gate.set()
        await stack.close()
