"""Deadlines and engine error kinds over HTTP: 504 before streaming, an SSE error after,
400 for a bad ``nvext.request_timeout``, 400/503 for engine refusals."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from tests.frontend.stack import Stack, make_stack

from turnout.engines.echo import EchoEngine
from turnout.protocols.llm import ErrorKind, FinishReason, LLMEngineOutput, PreprocessedRequest
from turnout.runtime.context import RequestContext


class ScriptedEngine(EchoEngine):
    """Echo's card; ``first`` tokens, then waits forever (or refuses with ``refuse``)."""

    def __init__(self, gguf_path: str) -> None:
        super().__init__(gguf_path)
        self.first = 0
        self.refuse: ErrorKind | None = None

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        if self.refuse is not None:
            yield LLMEngineOutput(
                finish_reason=FinishReason.ERROR, error="refused", error_kind=self.refuse.value
            )
            return
        for i in range(self.first):
            yield LLMEngineOutput(token_ids=[request.token_ids[i % len(request.token_ids)]])
        await asyncio.get_running_loop().create_future()


@pytest.fixture
async def stack(gguf_path: str) -> AsyncIterator[tuple[Stack, ScriptedEngine]]:
    s = await make_stack(request_timeout=3600.0)
    engine = ScriptedEngine(gguf_path)
    await s.add_worker(engine)
    await s.wait_for_model("echo")
    try:
        yield s, engine
    finally:
        await s.close()


def body(stream: bool = False, **nvext: object) -> dict[str, object]:
    return {"model": "echo", "prompt": "hello there", "max_tokens": 8, "stream": stream,
            "nvext": nvext}  # fmt: skip


async def test_deadline_before_streaming_is_504(stack: tuple[Stack, ScriptedEngine]) -> None:
    s, _ = stack
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(s.url + "/v1/completions", json=body(request_timeout=0.2))
    assert r.status_code == 504, r.text
    assert "0.2s deadline" in r.json()["error"]["message"]


async def test_deadline_after_streaming_is_an_sse_error(
    stack: tuple[Stack, ScriptedEngine],
) -> None:
    s, engine = stack
    engine.first = 2
    events: list[str] = []
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", s.url + "/v1/completions", json=body(True, request_timeout=0.3)) as r,
    ):
        assert r.status_code == 200
        # Read up to [DONE], as OpenAI clients do (the frontend may keep the body open).
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if line == "data: [DONE]":
                    break
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "request_timeout" and "deadline" in error["message"]


@pytest.mark.parametrize("bad", [0, -1, "soon"])
async def test_a_bad_request_timeout_is_400_naming_it(
    stack: tuple[Stack, ScriptedEngine], bad: object
) -> None:
    s, _ = stack
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(s.url + "/v1/completions", json=body(request_timeout=bad))
    assert r.status_code == 400, r.text
    assert "nvext.request_timeout" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("kind", "status"), [(ErrorKind.BAD_REQUEST, 400), (ErrorKind.OVERLOADED, 503)]
)
async def test_engine_refusals(
    stack: tuple[Stack, ScriptedEngine], kind: ErrorKind, status: int
) -> None:
    s, engine = stack
    engine.refuse = kind
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(s.url + "/v1/completions", json=body())
    assert r.status_code == status, r.text
    assert "refused" in r.json()["error"]["message"]
    if status == 503:
        assert r.headers["retry-after"]
