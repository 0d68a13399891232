"""A worker refuses, as a bad request, a salted request when its card says the engine cannot
partition its prefix cache, whatever the engine: the frontend refuses it first, and this
catches the ones that reach the worker anyway (another frontend, a request-plane client), which
would otherwise share one cache across tenants."""

from __future__ import annotations

import msgspec
import pytest

from turnout.engines.echo import EchoEngine
from turnout.engines.worker import Worker
from turnout.llm.cache_salt import tenant_cache_salt
from turnout.protocols.llm import (
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    StopConditions,
)
from turnout.protocols.model import EndpointId, ModelCapabilities, ModelDeploymentCard
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery.memory import MemoryStore

ENDPOINT = EndpointId(namespace="t", component="backend", name="generate")
_decode = msgspec.msgpack.Decoder(LLMEngineOutput).decode
_encode = msgspec.msgpack.Encoder().encode


class UnpartitionedEcho(EchoEngine):
    """An echo whose card says its engine cannot partition its prefix cache."""

    def model_card_template(self) -> ModelDeploymentCard:
        card = super().model_card_template()
        return msgspec.structs.replace(card, capabilities=ModelCapabilities(cache_salt=False))


def request(cache_salt: str | None) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m", token_ids=[10, 11, 12], stop_conditions=StopConditions(max_tokens=3),
        cache_salt=cache_salt,
    )  # fmt: skip


async def run(engine: EchoEngine, req: PreprocessedRequest) -> list[LLMEngineOutput]:
    runtime = await DistributedRuntime.create(store=MemoryStore(), request_plane="tcp")
    worker = Worker(runtime, engine, ENDPOINT, health_interval=0)
    try:
        serving = await worker.start()
        client = await runtime.endpoint(ENDPOINT).client()
        stream = client.stream(serving.instance_id, _encode(req), RequestContext("r"))
        return [_decode(item) async for item in stream]
    finally:
        await worker.stop(drain_timeout=0.5)
        await runtime.shutdown()


@pytest.mark.parametrize("salt", ["mine", tenant_cache_salt("alice", None)])
async def test_a_salted_request_to_an_unpartitioned_engine_is_a_bad_request(
    gguf_path: str, salt: str
) -> None:
    outs = await run(UnpartitionedEcho(gguf_path), request(salt))
    assert len(outs) == 1 and not outs[0].token_ids
    assert outs[0].finish_reason is FinishReason.ERROR
    assert outs[0].error_kind == ErrorKind.BAD_REQUEST.value
    assert outs[0].error is not None and "cannot honour cache_salt" in outs[0].error
    assert "alice" not in outs[0].error  # a tenant's salt is not quoted back


async def test_an_unsalted_request_to_an_unpartitioned_engine_runs(gguf_path: str) -> None:
    outs = await run(UnpartitionedEcho(gguf_path), request(None))
    assert [t for o in outs for t in o.token_ids] == [10, 11, 12]
    assert outs[-1].finish_reason is FinishReason.LENGTH


async def test_a_salted_request_to_a_partitioning_engine_runs(gguf_path: str) -> None:
    outs = await run(EchoEngine(gguf_path), request(tenant_cache_salt("alice", "mine")))
    assert [t for o in outs for t in o.token_ids] == [10, 11, 12]
    assert outs[-1].finish_reason is FinishReason.LENGTH
