"""The HTTP frontend end to end, in one process: real HTTP server, real TCP request plane,
echo workers registered through a real (memory) discovery store, real HTTP clients."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from tests.frontend.stack import Stack, WholePromptEcho, echo_engine, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.echo import EchoEngine
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.llm import LLMEngineOutput, PreprocessedRequest
from turnout.runtime.context import RequestContext


class RecordingEcho(EchoEngine):
    """Echo that records how many tokens it produced and how many streams are open."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.produced = 0
        self.open_streams = 0
        self.cancelled = 0

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        self.open_streams += 1
        try:
            async for out in super().generate(request, ctx):
                self.produced += len(out.token_ids)
                yield out
        finally:
            self.open_streams -= 1
            if ctx.is_cancelled:
                self.cancelled += 1


@pytest.fixture
async def stack(gguf_path: str) -> AsyncIterator[Stack]:
    before = set(asyncio.all_tasks())
    s = await make_stack(max_body_bytes=64 * 1024)
    await s.add_worker(echo_engine(gguf_path))
    await s.wait_for_model("echo")
    yield s
    await s.close()
    await assert_no_leaked_tasks(before)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from tests.helpers import smollm2_path

    path = smollm2_path()
    assert path is not None
    return Tokenizer.from_gguf(path)


def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


async def test_models_health_live_metrics(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        models = (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["echo"]
        # ``created``: when the frontend began serving it, not a placeholder.
        assert abs(models["data"][0]["created"] - time.time()) < 3600
        health = await http.get("/health")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "healthy"
        assert len(body["models"][0]["instances"]) == 1
        assert (await http.get("/live")).json() == {"status": "live"}
        await http.post("/v1/completions", json={"model": "echo", "prompt": "hi", "max_tokens": 1})
        metrics = (await http.get("/metrics")).text
        assert 'turnout_requests_total{endpoint="completions",model="echo"' in metrics
        assert "turnout_time_to_first_token_seconds_bucket" in metrics


async def test_completion_whole_and_streamed(stack: Stack, tokenizer: Tokenizer) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 你好"
    n = len(tokenizer.encode(prompt))
    api = client(stack)
    whole = await api.completions.create(model="echo", prompt=prompt, max_tokens=n)
    assert whole.choices[0].text == prompt
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == n
    assert whole.usage.completion_tokens == n
    assert whole.usage.total_tokens == 2 * n

    stream = await api.completions.create(
        model="echo", prompt=prompt, max_tokens=n, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    pieces, reasons, usage = [], [], None
    async for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.text)
            reasons.append(choice.finish_reason)
        usage = chunk.usage or usage
    assert "".join(pieces) == prompt
    assert reasons[-1] == "length"
    assert usage is not None and usage.completion_tokens == n and usage.prompt_tokens == n
    await api.close()


async def test_chat_whole_and_streamed(stack: Stack) -> None:
    api = client(stack)
    messages = [{"role": "user", "content": "Hello there"}]
    whole = await api.chat.completions.create(model="echo", messages=messages, max_tokens=8)
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert text and "<|im_start|>" not in text  # special tokens are not shown
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    stream = await api.chat.completions.create(
        model="echo", messages=messages, max_tokens=8, stream=True
    )
    pieces = []
    roles = []
    async for chunk in stream:
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        pieces.append(delta.content or "")
    assert roles[0] == "assistant"
    assert "".join(pieces) == text
    await api.close()


async def test_stop_string_hides_match(stack: Stack) -> None:
    api = client(stack)
    out = await api.completions.create(
        model="echo", prompt="one two three four five", stop=[" three"], max_tokens=20
    )
    assert out.choices[0].text == "one two"
    assert out.choices[0].finish_reason == "stop"
    await api.close()


async def test_worker_id_is_explained_on_request(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        r = await http.post(
            "/v1/completions",
            json={"model": "echo", "prompt": "hi", "max_tokens": 1,
                  "nvext": {"extra_fields": ["worker_id"]}},
        )  # fmt: skip
        worker = stack.workers[0].serving
        assert worker is not None
        assert r.json()["nvext"]["worker_id"] == f"{worker.instance_id:x}"


BAD_REQUESTS = [
    # (path, raw body, status, words expected in the message)
    ("/v1/chat/completions", b"{not json", 400, "json"),
    ("/v1/completions", b'{"model": "echo", "prompt": "x", "max_tokens": "9"}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"model": "echo"}', 400, "messages"),
    ("/v1/completions", b'{"model": "echo"}', 400, "prompt"),
    ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404, "nope"),
    ("/v1/completions", b'{"model": "echo", "prompt": "x", "max_tokens": -3}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "echo", "prompt": "x", "max_tokens": 1000000000}', 400,
     "context"),
    ("/v1/chat/completions", b'{"model": "echo", "messages": [], "max_tokens": 1}', 400,
     "messages"),
    ("/v1/completions", b'{"model": "echo", "prompt": "x", "temperature": 9}', 400, "temperature"),
    ("/v1/completions", b'{"model": "echo", "prompt": "x", "n": 0}', 400, "n"),
    ("/v1/nowhere", b"{}", 404, "route"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "words"), BAD_REQUESTS)
async def test_bad_requests_get_openai_errors(
    stack: Stack, path: str, body: bytes, status: int, words: str
) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        r = await http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert words.lower() in error["message"].lower(), error
        # The frontend keeps serving.
        ok = await http.post(
            "/v1/completions", json={"model": "echo", "prompt": "a", "max_tokens": 1}
        )
        assert ok.status_code == 200


async def test_prompt_past_context_is_400(stack: Stack) -> None:
    context = stack.workers[0].card.context_length  # type: ignore[union-attr]
    async with httpx.AsyncClient(base_url=stack.url) as http:
        r = await http.post(
            "/v1/completions", json={"model": "echo", "prompt": list(range(100, 100 + context))}
        )
        assert r.status_code == 400
        assert "context length" in r.json()["error"]["message"]


async def test_body_over_limit_is_413(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        big = json.dumps({"model": "echo", "prompt": "x" * 100_000}).encode()
        r = await http.post("/v1/completions", content=big)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"
        r = await http.get("/v1/completions")
        assert r.status_code == 405


class SlowWholePromptEcho(RecordingEcho, WholePromptEcho):
    """A recording echo that answers with the whole conversation (no early end token)."""


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "word " * 200, "max_tokens": 500}),
        ("/v1/responses", {"input": "word " * 200}),
        ("/v1/messages", {"max_tokens": 500,
                          "messages": [{"role": "user", "content": "word " * 200}]}),
    ],
)  # fmt: skip
async def test_client_disconnect_cancels_worker(
    gguf_path: str, path: str, body: dict[str, object]
) -> None:
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    engine = SlowWholePromptEcho(gguf_path, delay_ms=20)
    await stack.add_worker(engine)
    await stack.wait_for_model("echo")
    try:
        async with httpx.AsyncClient(base_url=stack.url) as http:
            request = {"model": "echo", "stream": True, **body}
            async with http.stream("POST", path, json=request) as r:
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        seen += 1
                    if seen == 6:
                        break
        for _ in range(200):
            if engine.open_streams == 0:
                break
            await asyncio.sleep(0.02)
        assert engine.open_streams == 0, "the worker kept generating after the client left"
        assert engine.cancelled == 1
        produced = engine.produced
        assert produced < 100
        await asyncio.sleep(0.2)  # time under test: nothing more is produced for a while
        assert engine.produced == produced
    finally:
        await stack.close()
    await assert_no_leaked_tasks(before)


async def test_extras_are_accepted_and_unknown_fields_refused(stack: Stack) -> None:
    body = {"model": "echo", "prompt": "a b c", "max_tokens": 2, "top_k": 5, "min_p": 0.1,
            "repetition_penalty": 1.1, "ignore_eos": True,
            "nvext": {"ignore_eos": True}}  # fmt: skip
    async with httpx.AsyncClient(base_url=stack.url) as http:
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
        # A field turnout does not know would be accepted and ignored: refused, named.
        r = await http.post("/v1/completions", json={**body, "some_future_field": [1]})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "some_future_field"
        r = await http.post("/v1/completions", json={**body, "nvext": {"unknown": 1}})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "nvext.unknown"
