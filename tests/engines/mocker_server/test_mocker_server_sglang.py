"""The mocker-server's SGLang face: ``/generate``, the native routes, the OpenAI routes."""

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
    server = await start_server(Api.SGLANG, **kw)
    return httpx.AsyncClient(base_url=server.url, timeout=30), server


async def test_generate_whole_and_streamed_cumulative(start_server: StartServer) -> None:
    client, server = await client_for(start_server)
    async with client:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
        whole = (await client.post("/generate", json=body)).json()
        assert set(whole) >= {"text", "output_ids", "meta_info"}
        meta = whole["meta_info"]
        assert len(whole["output_ids"]) == 6 == meta["completion_tokens"]
        assert meta["prompt_tokens"] == len(PROMPT)
        assert meta["finish_reason"] == {"type": "length", "length": 6}
        assert meta["cached_tokens"] == 0 and meta["e2e_latency"] >= 0
        assert whole["text"] == server.model.tokenizer.decode(whole["output_ids"])

        r = await client.post("/generate", json={**body, "stream": True})
        events = sse_events(r.text)
        assert len(events) == 6
        # SGLang's default stream: every event holds everything so far.
        for n, event in enumerate(events, 1):
            assert event["output_ids"] == whole["output_ids"][:n]
            assert event["meta_info"]["completion_tokens"] == n
            assert (event["meta_info"]["finish_reason"] is None) == (n < 6)
        assert events[-1]["text"] == whole["text"]
        # The same prompt again: its full blocks are cached now.
        again = (await client.post("/generate", json=body)).json()
        assert again["meta_info"]["cached_tokens"] == len(PROMPT) // 16 * 16


async def test_generate_incremental_stream(start_server: StartServer) -> None:
    client, _ = await client_for(start_server, incremental_streaming_output=True)
    async with client:
        body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 5}}
        whole = (await client.post("/generate", json=body)).json()
        r = await client.post("/generate", json={**body, "stream": True})
        events = sse_events(r.text)
        assert [t for e in events for t in e["output_ids"]] == whole["output_ids"]
        assert "".join(e["text"] for e in events) == whole["text"]


async def test_generate_stop_string_and_logprobs(start_server: StartServer) -> None:
    client, _ = await client_for(start_server)
    async with client:
        params: dict[str, Any] = {"max_new_tokens": 12}
        body: dict[str, Any] = {"input_ids": PROMPT, "sampling_params": params}
        text = (await client.post("/generate", json=body)).json()["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        r = await client.post(
            "/generate",
            json={**body, "sampling_params": {**params, "stop": stop}, "return_logprob": True,
                  "top_logprobs_num": 2},
        )  # fmt: skip
        out = r.json()
        assert out["text"] == text[: text.index(stop)]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        logprobs = out["meta_info"]["output_token_logprobs"]
        assert [entry[1] for entry in logprobs] == out["output_ids"]
        assert all(len(top) == 2 for top in out["meta_info"]["output_top_logprobs"])


async def test_native_info_routes(start_server: StartServer) -> None:
    client, server = await client_for(
        start_server, kv_events_endpoint="tcp://127.0.0.1:0", mocker={"dp_size": 2}
    )
    async with client:
        info = (await client.get("/get_model_info")).json()
        assert info["model_path"] == server.model.path and info["is_generation"] is True
        assert (await client.get("/model_info")).json() == info
        server_info = (await client.get("/get_server_info")).json()
        assert server_info["page_size"] == 16 and server_info["dp_size"] == 2
        assert len(server_info["internal_states"]) == 2
        assert "tcp://127.0.0.1:0" in server_info["kv_events_config"]
        loads = (await client.get("/get_load")).json()
        assert [load["dp_rank"] for load in loads] == [0, 1]
        assert all(load["num_reqs"] == 0 for load in loads)
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/health_generate")).status_code == 200
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["max_model_len"] == server.model.max_model_len


async def test_tokenize_routes(start_server: StartServer) -> None:
    client, server = await client_for(start_server)
    async with client:
        probe = "The quick brown fox — jumps over 13 lazy dogs. 🦊"
        local = Tokenizer.from_gguf(server.model.path)
        for path in ("/tokenize", "/v1/tokenize"):
            body = (await client.post(path, json={"prompt": probe})).json()
            assert body["tokens"] == local.encode(probe, add_special_tokens=True)
            assert body["count"] == len(body["tokens"])
            assert body["max_model_len"] == server.model.max_model_len
        batch = (await client.post("/tokenize", json={"prompt": [probe, "hi"]})).json()
        assert batch["count"] == [len(batch["tokens"][0]), len(batch["tokens"][1])]
        r = await client.post("/detokenize", json={"tokens": body["tokens"]})
        assert r.json() == {"text": probe}


async def test_openai_routes_through_the_client(start_server: StartServer) -> None:
    server = await start_server(Api.SGLANG)
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
    try:
        messages: Any = [{"role": "user", "content": "Hello!"}]
        whole = await client.chat.completions.create(
            model=server.model.name, messages=messages, max_tokens=6
        )
        parts = []
        stream = await client.chat.completions.create(
            model=server.model.name, messages=messages, max_tokens=6, stream=True
        )
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
        assert "".join(parts) == whole.choices[0].message.content
        completion = await client.completions.create(
            model=server.model.name, prompt=PROMPT, max_tokens=3
        )
        assert completion.choices[0].model_extra["matched_stop"] is None
        assert completion.usage is not None and completion.usage.completion_tokens == 3
    finally:
        await client.close()


async def test_metrics_and_disconnect(start_server: StartServer) -> None:
    server = await start_server(Api.SGLANG, mocker={"speedup_ratio": 1.0})
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        text = (await client.get("/metrics")).text
        for name in (
            "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
            "sglang:cache_hit_rate", "sglang:num_used_tokens", "sglang:gen_throughput",
            "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
        ):  # fmt: skip
            assert metric(text, name, model_name=server.model.name) is not None, name
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4000,
                "ignore_eos": True}, "stream": True}  # fmt: skip
        async with client.stream("POST", "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
            running = metric((await client.get("/metrics")).text, "sglang:num_running_reqs")
            assert running == 1
            assert (await client.get("/get_load")).json()[0]["num_reqs"] == 1
        await wait_for_metric(client, "sglang:num_running_reqs", lambda v: v == 0)
        await wait_for_metric(client, "sglang:num_aborted_requests_total", lambda v: v == 1)
        await wait_for_metric(client, "sglang:token_usage", lambda v: v == 0)
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}
        for _ in range(2):
            await client.post("/generate", json=body)
        text = (await client.get("/metrics")).text
        assert (metric(text, "sglang:cache_hit_rate") or 0) > 0
        assert metric(text, "sglang:num_requests_total") == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"sampling_params": {}}, "text"),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"input_ids": [[1, 2], [3]]}, "input_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"n": 2}}, "sampling_params.n"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**6}}, "max_tokens"),
        ({"input_ids": [1, 2], "sampling_params": "fast"}, "sampling_params"),
    ],
)
async def test_bad_generate_requests(
    start_server: StartServer, body: dict[str, Any], param: str
) -> None:
    client, _ = await client_for(start_server)
    async with client:
        r = await client.post("/generate", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


async def test_a_full_queue_is_a_503(start_server: StartServer) -> None:
    server = await start_server(
        Api.SGLANG, mocker={"speedup_ratio": 1.0, "max_num_seqs": 1, "max_waiting": 1}
    )
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4000}}
        slow = [asyncio.create_task(client.post("/generate", json=body))]
        await wait_for_metric(client, "sglang:num_running_reqs", lambda v: v == 1)
        slow.append(asyncio.create_task(client.post("/generate", json=body)))
        await wait_for_metric(client, "sglang:num_queue_reqs", lambda v: v == 1)
        r = await client.post("/generate", json=body)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["code"] == "service_unavailable"
        for task in slow:
            task.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
