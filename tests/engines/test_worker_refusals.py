"""A worker refuses, as a bad request, what its card says its engine cannot do, even when the
request reaches it past the frontend's own check (another frontend, a request-plane client):
an engine would otherwise serve it ignoring the grammar or the alternatives."""

from __future__ import annotations

import msgspec
import pytest

from turnout.engines.base import Engine
from turnout.engines.echo import EchoEngine
from turnout.engines.mocker import MockerConfig, MockerEngine
from turnout.engines.worker import Worker
from turnout.protocols.llm import (
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    OutputOptions,
    PreprocessedRequest,
    StopConditions,
    StructuredOutput,
)
from turnout.protocols.model import EndpointId
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery.memory import MemoryStore

ENDPOINT = EndpointId(namespace="t", component="backend", name="generate")
CHOICE = StructuredOutput(kind="choice", grammar='%llguidance {}\nstart: "a" | "b"')
_decode = msgspec.msgpack.Decoder(LLMEngineOutput).decode
_encode = msgspec.msgpack.Encoder().encode


def request(**kw: object) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m", token_ids=list(range(10, 14)), stop_conditions=StopConditions(max_tokens=3),
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


async def run(engine: Engine, req: PreprocessedRequest) -> list[LLMEngineOutput]:
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


def mocker() -> MockerEngine:
    return MockerEngine(MockerConfig(speedup_ratio=0))


@pytest.mark.parametrize(
    ("engine", "req", "says"),
    [
        ("echo", request(structured=CHOICE), "cannot enforce choice output"),
        ("mocker", request(structured=CHOICE), "enforces: none"),
        ("echo", request(output_options=OutputOptions(logprobs=0)), "log probabilities"),
        ("mocker", request(output_options=OutputOptions(logprobs=21)), "at most 20"),
    ],
)
async def test_what_the_card_does_not_list_is_a_bad_request(
    gguf_path: str, engine: str, req: PreprocessedRequest, says: str
) -> None:
    outs = await run(EchoEngine(gguf_path) if engine == "echo" else mocker(), req)
    assert len(outs) == 1 and not outs[0].token_ids
    assert outs[0].finish_reason is FinishReason.ERROR
    assert outs[0].error_kind == ErrorKind.BAD_REQUEST.value
    assert outs[0].error is not None and says in outs[0].error


async def test_what_the_card_lists_runs() -> None:
    outs = await run(mocker(), request(output_options=OutputOptions(logprobs=20)))
    assert sum(len(o.token_ids) for o in outs) == 3
    assert outs[-1].finish_reason is FinishReason.LENGTH
    alternatives = [alts for o in outs for alts in o.top_logprobs or []]
    assert [len(alts) for alts in alternatives] == [20, 20, 20]
