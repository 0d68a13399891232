"""Statuses the frontend answers for routing and worker failures, through real HTTP: a
request the client got wrong is a 4xx naming the field, a worker that broke the protocol a
502 that does not blame the client, a known instance that is down a 503 with Retry-After."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import openai
import pytest
from tests.frontend.stack import Stack, echo_engine, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.echo import EchoEngine
from turnout.frontend.models.manager import ModelKind
from turnout.protocols.llm import LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import EndpointId, ModelDeploymentCard, ModelInput, ModelType, mdc_key
from turnout.router.mode import RouterMode
from turnout.runtime.context import RequestContext

PIN = "nvext.backend_instance_id"


async def stack_with(
    gguf_path: str, engine: EchoEngine | None = None, **config: object
) -> AsyncIterator[Stack]:
    before = set(asyncio.all_tasks())
    stack = await make_stack(**config)
    await stack.add_worker(engine or echo_engine(gguf_path))
    await stack.wait_for_model("echo")
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


@pytest.fixture(params=[RouterMode.ROUND_ROBIN, RouterMode.DIRECT, RouterMode.KV])
async def any_mode(request: pytest.FixtureRequest, gguf_path: str) -> AsyncIterator[Stack]:
    async for stack in stack_with(gguf_path, router_mode=request.param):
        yield stack


@pytest.fixture
async def direct(gguf_path: str) -> AsyncIterator[Stack]:
    async for stack in stack_with(gguf_path, router_mode=RouterMode.DIRECT):
        yield stack


def instance_of(stack: Stack) -> int:
    serving = stack.workers[0].serving
    assert serving is not None
    return serving.instance_id


def completion(**nvext: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "echo", "prompt": "hello there", "max_tokens": 2}
    if nvext:
        out["nvext"] = nvext
    return out


async def test_direct_mode_without_pin_is_400_naming_the_field(direct: Stack) -> None:
    async with httpx.AsyncClient(base_url=direct.url) as http:
        for path, payload in [
            ("/v1/completions", completion()),
            ("/v1/chat/completions",
             {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}),
        ]:  # fmt: skip
            r = await http.post(path, json=payload)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == PIN
            assert PIN in error["message"]
        body = completion(backend_instance_id=instance_of(direct))
        pinned = await http.post("/v1/completions", json=body)
        assert pinned.status_code == 200, pinned.text


async def test_unknown_pinned_instance_is_404_in_every_mode(any_mode: Stack) -> None:
    async with httpx.AsyncClient(base_url=any_mode.url) as http:
        for stream in (False, True):
            unknown = instance_of(any_mode) ^ 0x5A5A
            body = {**completion(backend_instance_id=unknown), "stream": stream}
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 404, r.text
            assert "retry-after" not in r.headers
            error = r.json()["error"]
            assert error["param"] == PIN
            assert f"{unknown:x}" in error["message"]
        body = completion(backend_instance_id=instance_of(any_mode))
        ok = await http.post("/v1/completions", json=body)
        assert ok.status_code == 200, ok.text


async def test_pinned_instance_that_is_down_is_503(direct: Stack) -> None:
    iid = instance_of(direct)
    client = direct.frontend.manager.get_engine(ModelKind.COMPLETIONS, "echo").client
    client.report_instance_down(iid)  # type: ignore[attr-defined]
    async with httpx.AsyncClient(base_url=direct.url) as http:
        r = await http.post("/v1/completions", json=completion(backend_instance_id=iid))
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert f"{iid:x}" in r.json()["error"]["message"]


class BadOutputEcho(EchoEngine):
    """A worker that breaks the protocol: an output whose ``token_ids`` is not a list,
    after ``good`` well-formed outputs and, when there are some, once ``release`` is set
    (so the good ones reach the client first, not coalesced with the bad one)."""

    def __init__(self, *args: object, good: int = 0, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.good = good
        self.release = asyncio.Event()

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        n = 0
        async for out in super().generate(request, ctx):
            if n == self.good:
                if n:
                    await self.release.wait()
                # Encodes fine (msgspec does not validate on replace), decodes as garbage.
                yield msgspec.structs.replace(out, token_ids="not a list")
                return
            n += 1
            yield out


@pytest.mark.parametrize("mode", [RouterMode.ROUND_ROBIN, RouterMode.KV])
@pytest.mark.parametrize("stream", [False, True])
async def test_worker_protocol_error_is_502_not_the_clients_fault(
    gguf_path: str, stream: bool, mode: RouterMode
) -> None:
    async for stack in stack_with(gguf_path, BadOutputEcho(gguf_path), router_mode=mode):
        async with httpx.AsyncClient(base_url=stack.url) as http:
            r = await http.post("/v1/completions", json={**completion(), "stream": stream})
            assert r.status_code == 502, r.text
            error = r.json()["error"]
            assert error["code"] == "worker_protocol_error"
            assert error["type"] != "invalid_request_error"
            assert "worker" in error["message"]
            assert error["param"] is None
        api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            await api.completions.create(model="echo", prompt="hi", max_tokens=2)
        assert info.value.status_code == 502
        await api.close()


async def test_worker_protocol_error_mid_stream_is_an_sse_error(gguf_path: str) -> None:
    engine = BadOutputEcho(gguf_path, good=6)
    async for stack in stack_with(gguf_path, engine):
        api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="-", max_retries=0)
        stream = await api.completions.create(
            model="echo", prompt="one two three four five six seven eight", max_tokens=8,
            stream=True,
        )  # fmt: skip
        texts = []
        with pytest.raises(openai.APIError, match="malformed response"):
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
                engine.release.set()
        assert "".join(texts).startswith("one two")
        await api.close()


async def test_priority_must_be_an_integer(gguf_path: str) -> None:
    async for stack in stack_with(gguf_path):
        async with httpx.AsyncClient(base_url=stack.url) as http:
            for bad in ["high", 1.5, True, [1]]:
                r = await http.post("/v1/completions", json=completion(priority=bad))
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["param"] == "nvext.priority"
                assert "nvext.priority" in error["message"]
            ok = await http.post("/v1/completions", json=completion(priority=-3))
            assert ok.status_code == 200


async def test_metric_labels_are_bounded_for_unknown_models(gguf_path: str) -> None:
    async for stack in stack_with(gguf_path):
        async with httpx.AsyncClient(base_url=stack.url) as http:
            for i in range(40):
                r = await http.post("/v1/completions", json={**completion(), "model": f"x{i}"})
                assert r.status_code == 404
            await http.post("/v1/completions", content=b"{broken")
            await http.post("/v1/completions", json=completion())
            metrics = (await http.get("/metrics")).text
        samples = [line for line in metrics.splitlines() if line.startswith("turnout_")]
        assert not [line for line in samples if 'model="x' in line]
        unknown = [
            line
            for line in samples
            if line.startswith("turnout_requests_total") and 'model="__unknown__"' in line
        ]
        by_status = {line.split('status="')[1].split('"')[0]: line for line in unknown}
        assert by_status["404"].endswith(" 40.0")
        assert by_status["400"].endswith(" 1.0")
        assert 'turnout_requests_total{endpoint="completions",model="echo"' in metrics


TEXT_ENDPOINT = EndpointId(namespace="test", component="text", name="generate")


async def text_worker(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    """A Text+Chat worker: one good chunk, then (when asked with "garbage") one not JSON."""
    request = msgspec.json.decode(payload)
    content = request["messages"][-1]["content"]
    choice = {"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}
    chunk = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1,
             "model": request["model"], "choices": [choice]}  # fmt: skip
    yield msgspec.json.encode(chunk)
    if content == "garbage":
        yield b"\xff not json"


async def text_stack(mode: RouterMode) -> tuple[Stack, Any, int]:
    stack = await make_stack(router_mode=mode)

    def records(instance_id: int) -> list[tuple[str, bytes]]:
        card = ModelDeploymentCard(
            display_name="text", endpoint=TEXT_ENDPOINT, instance_id=instance_id,
            model_type=ModelType.Chat, model_input=ModelInput.Text,
        )  # fmt: skip
        return [(mdc_key(TEXT_ENDPOINT, instance_id), msgspec.json.encode(card))]

    serving = await stack.runtime.endpoint(TEXT_ENDPOINT).serve(text_worker, records=records)
    await stack.wait_for_model("text")
    return stack, serving, serving.instance_id


async def test_text_models_pins_and_protocol_errors() -> None:
    before = set(asyncio.all_tasks())
    stack, serving, iid = await text_stack(RouterMode.DIRECT)
    try:
        async with httpx.AsyncClient(base_url=stack.url) as http:

            async def chat(content: str = "hi", **nvext: Any) -> httpx.Response:
                body: dict[str, Any] = {
                    "model": "text", "messages": [{"role": "user", "content": content}],
                }  # fmt: skip
                if nvext:
                    body["nvext"] = nvext
                return await http.post("/v1/chat/completions", json=body)

            r = await chat()
            assert (r.status_code, r.json()["error"]["param"]) == (400, PIN), r.text
            r = await chat(backend_instance_id=iid ^ 0x77)
            assert (r.status_code, r.json()["error"]["param"]) == (404, PIN), r.text
            r = await chat(backend_instance_id=iid)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "ok"
            r = await chat("garbage", backend_instance_id=iid)
            assert r.status_code == 502, r.text
            assert r.json()["error"]["code"] == "worker_protocol_error"
    finally:
        await serving.stop(drain_timeout=0.5)
        await stack.close()
    await assert_no_leaked_tasks(before)
