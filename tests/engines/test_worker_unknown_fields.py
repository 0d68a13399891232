"""A worker refuses a request field it does not know instead of dropping it: a frontend newer
than its workers may send a field (a new sampling knob, a new stage of a request) that an
older worker would otherwise ignore, serving something the client did not ask for. The
refusal names the field; the frontend turns it into an error, never a silent 200.

Each test runs a real worker behind the TCP request plane and sends it raw msgpack, as a
newer frontend would."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import pytest
from tests.frontend.stack import echo_engine, make_stack

from turnout.engines import worker as worker_module
from turnout.engines.base import EngineBase
from turnout.engines.mocker import MockerConfig, MockerEngine
from turnout.engines.tensor import NumericEngine
from turnout.engines.worker import Worker
from turnout.protocols.disagg import KV_TRANSFER_HANDLER, KvTransferReply
from turnout.protocols.kv import KV_SNAPSHOT_HANDLER
from turnout.protocols.llm import (
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    StopConditions,
)
from turnout.protocols.model import EndpointId
from turnout.protocols.unary import TensorOutput
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery.memory import MemoryStore
from turnout.runtime.endpoint_client import EndpointClient

ENDPOINT = EndpointId(namespace="t", component="backend", name="generate")
_encode = msgspec.msgpack.Encoder().encode
_decode_output = msgspec.msgpack.Decoder(LLMEngineOutput).decode


def as_dict(request: PreprocessedRequest) -> dict[str, Any]:
    """The request as the wire map a frontend sends, to add fields to."""
    decoded: dict[str, Any] = msgspec.msgpack.decode(_encode(request))
    return decoded


def base_request() -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m", token_ids=[10, 11, 12, 13], stop_conditions=StopConditions(max_tokens=3)
    )


@asynccontextmanager
async def serving(engine: EngineBase) -> AsyncIterator[tuple[EndpointClient, int]]:
    runtime = await DistributedRuntime.create(store=MemoryStore(), request_plane="tcp")
    worker = Worker(runtime, engine, ENDPOINT, health_interval=0)
    try:
        instance = await worker.start()
        client = await runtime.endpoint(ENDPOINT).client()
        yield client, instance.instance_id
    finally:
        await worker.stop(drain_timeout=0.5)
        await runtime.shutdown()


async def collect(
    client: EndpointClient, instance: int, payload: bytes, handler: str | None = None
) -> list[bytes]:
    ctx = RequestContext("r")
    if handler is None:
        return [item async for item in client.stream(instance, payload, ctx)]
    return [item async for item in client.call(instance, handler, payload, ctx)]


def mocker() -> MockerEngine:
    return MockerEngine(MockerConfig(speedup_ratio=0))


@pytest.mark.parametrize(
    ("where", "field", "path"),
    [
        ((), "max_thinking_tokens", ""),
        (("stop_conditions",), "stop_after_tool_call", "$.stop_conditions"),
        (("sampling_options",), "xtc_probability", "$.sampling_options"),
        (("output_options",), "return_hidden_states", "$.output_options"),
    ],
)
async def test_an_unknown_request_field_is_a_bad_request_naming_it(
    where: tuple[str, ...], field: str, path: str
) -> None:
    wire = as_dict(base_request())
    target = wire
    for key in where:
        target = target.setdefault(key, {})
    target[field] = 1
    async with serving(mocker()) as (client, instance):
        outs = [_decode_output(i) for i in await collect(client, instance, _encode(wire))]
    assert len(outs) == 1 and not outs[0].token_ids
    assert outs[0].finish_reason is FinishReason.ERROR
    assert outs[0].error_kind == ErrorKind.BAD_REQUEST.value
    assert outs[0].error is not None
    assert f"unknown field `{field}`" in outs[0].error
    if where:
        assert f"at `{path}`" in outs[0].error


async def test_the_same_request_without_the_field_runs() -> None:
    """The control: the wire map itself is what the worker reads; only the field was wrong."""
    async with serving(mocker()) as (client, instance):
        items = await collect(client, instance, _encode(as_dict(base_request())))
    outs = [_decode_output(i) for i in items]
    assert sum(len(o.token_ids) for o in outs) == 3
    assert outs[-1].finish_reason is FinishReason.LENGTH


async def test_a_unary_engine_refuses_an_unknown_field() -> None:
    request = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": b"\0\0\x80?"}],
        "precision": "fp8",
    }
    async with serving(NumericEngine()) as (client, instance):
        items = await collect(client, instance, _encode(request))
    reply = msgspec.msgpack.decode(items[0], type=TensorOutput)
    assert reply.error_kind == ErrorKind.BAD_REQUEST.value
    assert reply.error is not None and "unknown field `precision`" in reply.error
    assert not reply.outputs


async def test_side_handlers_refuse_unknown_fields() -> None:
    async with serving(mocker()) as (client, instance):
        items = await collect(
            client,
            instance,
            _encode({"op": "release", "handle_id": "ab", "priority": 1}),
            handler=KV_TRANSFER_HANDLER,
        )
        reply = msgspec.msgpack.decode(items[0], type=KvTransferReply)
        assert not reply.ok
        assert reply.error is not None and "unknown field `priority`" in reply.error
        with pytest.raises(Exception, match="unknown field `layer`"):
            await collect(
                client, instance, _encode({"dp_rank": 0, "layer": 2}), handler=KV_SNAPSHOT_HANDLER
            )


def older_request_type(without: str) -> type[msgspec.Struct]:
    """``PreprocessedRequest`` as a worker built before ``without`` existed reads it."""
    fields: list[tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(PreprocessedRequest):
        if f.name == without:
            continue
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, f.type))  # type: ignore[arg-type]
    return msgspec.defstruct(
        "OlderPreprocessedRequest",
        fields,
        kw_only=True,
        omit_defaults=True,
        forbid_unknown_fields=True,
    )


async def test_a_frontend_newer_than_its_worker_gets_an_error_not_a_silent_200(
    gguf_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the HTTP frontend: a worker that does not know ``cache_salt`` refuses a
    salted request (a 400 naming the field) rather than serving it unsalted, sharing the
    tenant's cache; an unsalted request, which does not carry the field, runs."""
    monkeypatch.setattr(
        worker_module, "_request_decoder", msgspec.msgpack.Decoder(older_request_type("cache_salt"))
    )
    stack = await make_stack()
    try:
        await stack.add_worker(echo_engine(gguf_path))
        await stack.wait_for_model("echo")
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            body: dict[str, Any] = {"model": "echo", "prompt": "hello there", "max_tokens": 2}
            plain = await http.post("/v1/completions", json=body)
            assert plain.status_code == 200, plain.text
            salted = await http.post("/v1/completions", json={**body, "cache_salt": "tenant-a"})
        assert salted.status_code == 400, salted.text
        assert "unknown field `cache_salt`" in salted.json()["error"]["message"]
    finally:
        await stack.close()
