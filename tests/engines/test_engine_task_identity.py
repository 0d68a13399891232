"""An engine's own deadlines are its own: a client that stops reading must not trip them.

An engine may bound its waits with ``asyncio.timeout`` (or, as ``turnout attach`` does, cancel
its current task when an upstream goes silent). Those cancel the task the engine runs in, so
that task must be the engine's alone: were the engine's step left suspended in the request
handler's task while the handler waits for the client's credit, a client slower than the
engine's deadline would have its stream aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from turnout.engines.echo import EchoEngine
from turnout.engines.worker import Worker
from turnout.protocols.llm import (
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    StopConditions,
)
from turnout.protocols.model import EndpointId
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery.memory import MemoryStore

ENDPOINT = EndpointId(namespace="t", component="backend", name="generate")
TOKENS = 200
#: The engine's deadline on each of its waits, and the client's pause: longer than it.
ENGINE_DEADLINE_S = 0.2
CLIENT_PAUSE_S = 3 * ENGINE_DEADLINE_S
_decode = msgspec.msgpack.Decoder(LLMEngineOutput).decode
_encode = msgspec.msgpack.Encoder().encode


class DeadlineEngine(EchoEngine):
    """Echo's card; each token comes after a short wait bounded by a deadline."""

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        for i in range(TOKENS):
            async with asyncio.timeout(ENGINE_DEADLINE_S):
                await asyncio.sleep(0.001)
            last = i == TOKENS - 1
            yield LLMEngineOutput(
                token_ids=[7], finish_reason=FinishReason.LENGTH if last else None
            )


async def test_a_slow_client_does_not_trip_the_engine_deadline(gguf_path: str) -> None:
    runtime = await DistributedRuntime.create(
        store=MemoryStore(), request_plane="tcp", lease_ttl=30.0
    )
    worker = Worker(runtime, DeadlineEngine(gguf_path), ENDPOINT, health_interval=0)
    try:
        serving = await worker.start()
        client = await runtime.endpoint(ENDPOINT).client()
        request = PreprocessedRequest(
            model="m", token_ids=[1, 2, 3], stop_conditions=StopConditions(max_tokens=TOKENS)
        )
        stream = client.stream(serving.instance_id, _encode(request), RequestContext("slow"))
        outputs = [_decode(await anext(stream))]
        await asyncio.sleep(CLIENT_PAUSE_S)  # the stimulus: a client that stops reading
        async with asyncio.timeout(30):
            outputs += [_decode(raw) async for raw in stream]
        assert sum(len(o.token_ids) for o in outputs) == TOKENS
        assert outputs[-1].finish_reason is FinishReason.LENGTH
        await client.close()
    finally:
        await worker.stop(drain_timeout=0.5)
        await runtime.shutdown()
