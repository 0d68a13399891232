"""The mocker-server's vLLM face, through HTTP as a router or a client sees it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from tests.engines.mocker_server.conftest import StartServer, metric, sse_events, wait_for_metric

from turnout.engines.mocker_server.metrics import Api
from turnout.llm.tokenizer import Tokenizer

PROMPT = list(range(1000, 1040))


async def client_for(start_server: StartServer, **kw: Any) -> tuple[httpx.AsyncClient, Any]:
    server = await start_server(Api.VLLM, **kw)
    return httpx.AsyncClient(base_url=server.url, timeout=30), server


async def test_token_prompt_whole_and_streamed_agree(start_server: StartServer) -> None:
    client, server = await client_for(start_server)
    async with client:
        body = {"prompt": PROMPT, "max_tokens": 7, "return_token_ids": True, "ignore_eos": True}
        whole = (await client.post("/v1/completions", json=body)).json()
        choice = whole["choices"][0]
        assert choice["prompt_token_ids"] == PROMPT
        assert len(choice["token_ids"]) == 7
        assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
        assert whole["usage"]["completion_tokens"] == 7
        assert whole["usage"]["prompt_tokens"] == len(PROMPT)

        r = await client.post(
            "/v1/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        chunks, usage = events[:-1], events[-1]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7
        # prompt_token_ids on the first chunk only; token_ids are each chunk's new ids.
        assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT
        assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])
        streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        assert streamed == choice["token_ids"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        tokenizer = server.model.tokenizer
        assert choice["text"] == tokenizer.decode(choice["token_ids"])


async def test_batch_of_prompts_gets_one_choice_each(start_server: StartServer) -> None:
    client, _ = await client_for(start_server)
    async with client:
        prompts = [PROMPT, PROMPT[:20], "Hello there"]
        r = await client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 3})
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        assert r.json()["usage"]["completion_tokens"] == 9
        r = await client.post(
            "/v1/completions", json={"prompt": prompts, "max_tokens": 3, "stream": True}
        )
        events = sse_events(r.text)
        assert sorted(e["choices"][0]["index"] for e in events) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


async def test_eos_ends_a_chat_unless_ignored(start_server: StartServer) -> None:
    client, server = await client_for(start_server, mocker={"default_max_tokens": 6})
    async with client:
        messages = [{"role": "user", "content": "hi"}]
        r = await client.post(
            "/v1/chat/completions", json={"messages": messages, "return_token_ids": True}
        )
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
        assert choice["token_ids"][-1] in server.model.eos_token_ids
        r = await client.post(
            "/v1/chat/completions", json={"messages": messages, "ignore_eos": True}
        )
        assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_stop_string_cuts_the_text_and_is_reported(start_server: StartServer) -> None:
    client, _ = await client_for(start_server)
    async with client:
        body = {"prompt": PROMPT, "max_tokens": 12}
        text = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        assert stop and stop in text
        for stream in (False, True):
            r = await client.post(
                "/v1/completions", json={**body, "stop": [stop], "stream": stream}
            )
            if stream:
                chunks = sse_events(r.text)
                got = "".join(c["choices"][0]["text"] for c in chunks)
                last = chunks[-1]["choices"][0]
            else:
                last = r.json()["choices"][0]
                got = last["text"]
            assert got == text[: text.index(stop)]
            assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)


async def test_chat_through_the_openai_client(start_server: StartServer) -> None:
    server = await start_server(Api.VLLM)
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
    try:
        models = await client.models.list()
        assert models.data[0].id == server.model.name
        assert models.data[0].model_extra["max_model_len"] == server.model.max_model_len
        messages: Any = [{"role": "user", "content": "Tell me a joke"}]
        whole = await client.chat.completions.create(
            model=server.model.name, messages=messages, max_tokens=8, logprobs=True,
            top_logprobs=2,
        )  # fmt: skip
        assert whole.usage is not None and whole.usage.completion_tokens == 8
        assert whole.choices[0].logprobs is not None
        assert len(whole.choices[0].logprobs.content or []) == 8
        parts = []
        stream = await client.chat.completions.create(
            model=server.model.name, messages=messages, max_tokens=8, stream=True
        )
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
        assert "".join(parts) == whole.choices[0].message.content
        completion = await client.completions.create(
            model=server.model.name, prompt=PROMPT, max_tokens=4, logprobs=1
        )
        assert completion.choices[0].logprobs is not None
        assert len(completion.choices[0].logprobs.tokens or []) == 4
    finally:
        await client.close()


async def test_tokenize_agrees_with_turnouts_tokenizer(start_server: StartServer) -> None:
    client, server = await client_for(start_server)
    async with client:
        probe = "The quick brown fox — jumps over 13 lazy dogs. 🦊"
        local = Tokenizer.from_gguf(server.model.path)
        r = await client.post("/tokenize", json={"prompt": probe})
        body = r.json()
        assert body["tokens"] == local.encode(probe, add_special_tokens=True)
        assert body["count"] == len(body["tokens"])
        assert body["max_model_len"] == server.model.max_model_len
        r = await client.post("/detokenize", json={"tokens": body["tokens"]})
        assert r.json() == {"prompt": probe}
        messages = [{"role": "user", "content": probe}]
        r = await client.post("/tokenize", json={"messages": messages})
        assert r.json()["count"] > len(body["tokens"])


async def test_metrics_move_under_load(start_server: StartServer) -> None:
    server = await start_server(Api.VLLM, mocker={"speedup_ratio": 20.0})
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        text = (await client.get("/metrics")).text
        for name in (
            "vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total", "vllm:num_preemptions_total",
        ):  # fmt: skip
            assert metric(text, name, model_name=server.model.name) is not None, name
        body = {"prompt": PROMPT * 4, "max_tokens": 64, "ignore_eos": True}
        requests = [asyncio.create_task(client.post("/v1/completions", json=body))
                    for _ in range(4)]  # fmt: skip
        await wait_for_metric(client, "vllm:num_requests_running", lambda v: (v or 0) > 0)
        await wait_for_metric(client, "vllm:kv_cache_usage_perc", lambda v: (v or 0) > 0)
        await asyncio.gather(*requests)
        text = (await client.get("/metrics")).text
        assert metric(text, "vllm:num_requests_running") == 0
        assert metric(text, "vllm:generation_tokens_total") == 4 * 64
        assert metric(text, "vllm:prefix_cache_queries_total") == 4 * len(PROMPT) * 4
        # The same prompt four times: the later ones hit the first one's blocks.
        assert (metric(text, "vllm:prefix_cache_hits_total") or 0) > 0
        assert metric(text, "vllm:request_success_total", finished_reason="length") == 4


async def test_a_client_gone_mid_stream_aborts_its_request(start_server: StartServer) -> None:
    server = await start_server(Api.VLLM, mocker={"speedup_ratio": 1.0})
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        body = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # one token seen: the request runs; now leave
        await wait_for_metric(client, "vllm:num_requests_running", lambda v: v == 0)
        await wait_for_metric(
            client, "vllm:request_success_total", lambda v: v == 1, finished_reason="abort"
        )
        assert server.engine is not None
        assert all(s.pool.num_used == 0 for s in server.engine.get_schedulers())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "n": 2}, "n"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [10**7]}, "prompt"),
        ({"prompt": PROMPT, "max_tokens": 10**6}, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
        ({"prompt": PROMPT, "echo": True}, "echo"),
        ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": PROMPT, "model": "nope"}, "model"),
    ],
)
async def test_bad_requests_get_openai_errors(
    start_server: StartServer, body: dict[str, Any], param: str
) -> None:
    client, _ = await client_for(start_server)
    async with client:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == (404 if param == "model" else 400), r.text
        error = r.json()["error"]
        assert error["param"] == param and error["message"]
        assert set(error) == {"message", "type", "param", "code"}


async def test_malformed_bodies_and_unknown_routes(start_server: StartServer) -> None:
    client, _ = await client_for(start_server)
    async with client:
        r = await client.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = await client.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = await client.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
        assert (await client.get("/health")).status_code == 200
