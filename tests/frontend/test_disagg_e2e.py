"""Disaggregated serving end to end: mocker prefill and decode workers behind the real
frontend (KV mode), on the real request plane, driven over HTTP by the official client."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
from tests.frontend.stack import ENDPOINT, Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.mocker import MockerConfig, MockerEngine
from turnout.engines.worker import Worker
from turnout.protocols.disagg import KvHandle
from turnout.protocols.model import EndpointId
from turnout.router.kv.config import KvRouterConfig
from turnout.router.mode import RouterMode

BLOCK = 16
MIN_TOKENS = 64
PREFILL = EndpointId(namespace="test", component="prefill", name="generate")
LONG = [1000 + (i * 37) % 20000 for i in range(300)]  # 300 tokens: well over MIN_TOKENS

MakeStack = Callable[..., Awaitable[Stack]]


def config(**changes: Any) -> MockerConfig:
    settings: dict[str, Any] = {"num_gpu_blocks": 512, "block_size": BLOCK, "speedup_ratio": 0.0}
    return MockerConfig(**(settings | changes))


@pytest.fixture
async def stacks(gguf_path: str) -> AsyncIterator[MakeStack]:
    """Builds a stack: ``prefill`` and ``decode`` mocker workers (configs per role)."""
    before = set(asyncio.all_tasks())
    made: list[Stack] = []

    async def build(
        *,
        prefill: int = 1,
        decode: int = 1,
        prefill_config: MockerConfig | None = None,
        decode_config: MockerConfig | None = None,
        **frontend: Any,
    ) -> Stack:
        settings: dict[str, Any] = {
            "router_mode": RouterMode.KV,
            "kv": KvRouterConfig(block_size=BLOCK),
            "prefill_min_tokens": MIN_TOKENS,
        }
        stack = await make_stack(**(settings | frontend))
        made.append(stack)
        for _ in range(decode):
            await add(stack, decode_config or config(role="decode"), gguf_path)
        if decode:
            await stack.wait_for_model("mock", instances=decode)
        for _ in range(prefill):
            await add(stack, prefill_config or config(role="prefill"), gguf_path)
        await wait_for_prefill(stack, prefill)
        return stack

    yield build
    for stack in made:
        await stack.close()
    await assert_no_leaked_tasks(before)


async def add(stack: Stack, cfg: MockerConfig, gguf_path: str) -> Worker:
    engine = MockerEngine(cfg, model_path=gguf_path)
    endpoint = PREFILL if cfg.role == "prefill" else ENDPOINT
    return await stack.add_worker(engine, model_name="mock", endpoint=endpoint)


async def wait_for_prefill(stack: Stack, count: int, timeout: float = 10.0) -> None:
    """Until the frontend's /health lists ``count`` prefill instances of the model."""
    async with httpx.AsyncClient(base_url=stack.url) as http:
        async with asyncio.timeout(timeout):
            while True:
                body = (await http.get("/health")).json()
                model = next((m for m in body.get("models", []) if m["name"] == "mock"), None)
                disagg = (model or {}).get("disaggregation") or {}
                if len(disagg.get("prefill_instances", [])) == count:
                    return
                await asyncio.sleep(0.02)


def engines(stack: Stack, role: str) -> list[MockerEngine]:
    out = []
    for worker in stack.workers:
        engine = worker.engine
        if isinstance(engine, MockerEngine) and engine.config.role == role:
            out.append(engine)
    return out


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def blocks_held(engine: MockerEngine) -> int:
    return sum(s.pool.num_used for s in engine.get_schedulers())


async def complete(stack: Stack, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        r = await http.post(
            "/v1/completions",
            json={"model": "mock", "prompt": prompt, "max_tokens": max_tokens,
                  "ignore_eos": True, "nvext": {"extra_fields": ["routing", "worker_id"]}},
            timeout=30,
        )  # fmt: skip
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of ``name`` whose labels include ``labels``."""
    for line in text.splitlines():
        match = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            return float(match.group(2))
    return 0.0


async def metrics(stack: Stack) -> str:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        return (await http.get("/metrics")).text


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_long_prompt_runs_in_two_stages(stacks: MakeStack, mode: str) -> None:
    stack = await stacks(prefill_config=config(role="prefill", kv_transfer=mode))
    (prefill,) = engines(stack, "prefill")
    (decode,) = engines(stack, "decode")
    body = await complete(stack, LONG, max_tokens=8)
    assert body["usage"]["prompt_tokens"] == len(LONG)
    assert body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["finish_reason"] == "length"
    routing = body["nvext"]["routing"]
    assert routing["disaggregated"] is True
    assert routing["prefill"]["worker_id"] == f"{prefill.worker_id:x}"
    assert body["nvext"]["worker_id"] == f"{decode.worker_id:x}"
    transfer = routing["kv_transfer"]
    assert transfer["mode"] == mode and transfer["tokens"] == len(LONG)
    assert transfer["bytes"] == len(LONG) * prefill.config.kv_bytes_per_token
    # The prefill side's blocks go back once the decode side has them; the decode side
    # stored them (cached now for the next turn).
    await until(lambda: len(prefill.kv_handles) == 0 and blocks_held(prefill) == 0)
    assert decode.get_schedulers()[0].pool.num_resident >= len(LONG) // BLOCK
    text = await metrics(stack)
    assert metric(text, "turnout_disagg_requests_total", model="mock", stage="prefill") == 1
    assert metric(text, "turnout_disagg_requests_total", model="mock", stage="decode") == 1
    async with httpx.AsyncClient(base_url=stack.url) as http:
        listed = (await http.get("/v1/models")).json()["data"]
    assert [m["id"] for m in listed] == ["mock"]  # the prefill card is no model of its own
    assert metric(text, "turnout_disagg_transfer_bytes_total", model="mock") == transfer["bytes"]


async def test_streamed_chat_through_both_stages(stacks: MakeStack) -> None:
    stack = await stacks()
    (prefill,) = engines(stack, "prefill")
    api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    words = " ".join(f"word{i}" for i in range(150))  # a prompt of a few hundred tokens
    stream = await api.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": words}], max_tokens=10, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "nvext": {"extra_fields": ["routing"]}},
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    await api.close()
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 10
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    routed = [
        (c.model_extra or {}).get("nvext", {}).get("routing")
        for c in chunks
        if (c.model_extra or {}).get("nvext")
    ]
    assert routed and routed[0]["disaggregated"] is True
    await until(lambda: blocks_held(prefill) == 0)


async def test_short_and_cached_prompts_skip_the_prefill_stage(stacks: MakeStack) -> None:
    stack = await stacks()
    (prefill,) = engines(stack, "prefill")
    short = await complete(stack, LONG[:20])
    assert short["nvext"]["routing"]["disaggregated"] is False
    assert short["nvext"]["routing"]["reason"] == "short_prompt"
    await complete(stack, LONG)  # the decode worker now holds the prompt's blocks
    await stack.wait_for_cached_blocks("mock", LONG, len(LONG) // BLOCK)
    again = await complete(stack, [*LONG[:-4], 7, 7, 7, 7])
    assert again["nvext"]["routing"]["disaggregated"] is False
    assert again["nvext"]["routing"]["reason"] == "cached_on_decode"
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    text = await metrics(stack)
    assert metric(text, "turnout_disagg_local_total", model="mock", reason="short_prompt") == 1
    assert metric(text, "turnout_disagg_requests_total", model="mock", stage="prefill") == 1
    assert blocks_held(prefill) == 0


async def test_fallback_on_serves_whole_requests_without_prefill_workers(
    stacks: MakeStack,
) -> None:
    stack = await stacks(prefill=0)
    body = await complete(stack, LONG)
    assert body["choices"][0]["finish_reason"] == "length"
    async with httpx.AsyncClient(base_url=stack.url) as http:
        health = (await http.get("/health")).json()
    (model,) = health["models"]
    assert model["disaggregation"]["disaggregated"] is False
    assert model["disaggregation"]["ready"] is True


async def test_fallback_off_fails_with_503_naming_the_role(stacks: MakeStack) -> None:
    stack = await stacks(prefill=0, decode_fallback=False)
    async with httpx.AsyncClient(base_url=stack.url) as http:
        health = await http.get("/health")
        r = await http.post(
            "/v1/completions",
            json={"model": "mock", "prompt": LONG, "max_tokens": 4,
                  "nvext": {"request_timeout": 0.5}},
            timeout=30,
        )  # fmt: skip
    assert health.status_code == 503
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert "no prefill worker (role prefill)" in error["message"]
    assert "--no-decode-fallback" in error["message"]


async def test_prefill_workers_activate_and_deactivate_the_stage(
    stacks: MakeStack, gguf_path: str
) -> None:
    stack = await stacks(prefill=0)
    assert (await complete(stack, LONG))["nvext"]["routing"].get("disaggregated") is not True
    worker = await add(stack, config(role="prefill"), gguf_path)
    await wait_for_prefill(stack, 1)
    assert (await complete(stack, LONG[::-1]))["nvext"]["routing"]["disaggregated"] is True
    stack.workers.remove(worker)
    await worker.stop(drain_timeout=1.0)
    await wait_for_prefill(stack, 0)
    body = await complete(stack, LONG[5:])
    assert body["nvext"]["routing"].get("disaggregated") is not True


async def test_cancel_during_prefill_frees_the_prefill_blocks(stacks: MakeStack) -> None:
    # A slow prefill: 300 tokens in chunks of 16 at real speed.
    slow = config(role="prefill", speedup_ratio=1.0, max_num_batched_tokens=16)
    stack = await stacks(prefill_config=slow)
    (prefill,) = engines(stack, "prefill")
    async with httpx.AsyncClient(base_url=stack.url) as http:
        body = {"model": "mock", "prompt": LONG, "max_tokens": 4, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            await until(lambda: blocks_held(prefill) > 0)
        # The client is gone mid-prefill.
    await until(lambda: blocks_held(prefill) == 0 and len(prefill.kv_handles) == 0)


async def test_a_prefill_worker_dying_mid_transfer_reprefills_elsewhere(
    stacks: MakeStack,
) -> None:
    # Transfers take ~0.4 s (300 tokens x 128 KiB over 0.1 GB/s): time to kill the sender.
    slow_link = config(role="prefill", kv_transfer_bandwidth_gbps=0.1, speedup_ratio=1.0)
    stack = await stacks(prefill=2, prefill_config=slow_link)
    prefills = engines(stack, "prefill")
    request = asyncio.create_task(complete(stack, LONG, max_tokens=4))
    await until(lambda: any(e.kv_handles.num_transferring for e in prefills))
    victim = next(e for e in prefills if e.kv_handles.num_transferring)
    worker = next(w for w in stack.workers if w.engine is victim)
    stack.workers.remove(worker)
    await worker.stop(drain_timeout=0)
    body = await request
    routing = body["nvext"]["routing"]
    assert routing["disaggregated"] is True
    assert routing["prefill"]["worker_id"] != f"{victim.worker_id:x}"
    assert body["usage"]["completion_tokens"] == 4
    text = await metrics(stack)
    assert metric(text, "turnout_disagg_retries_total", model="mock", reason="kv_transfer") == 1


async def test_an_expired_handle_is_a_clean_retry(stacks: MakeStack) -> None:
    stack = await stacks(prefill_config=config(role="prefill", kv_handle_ttl_s=0.05))
    (prefill,) = engines(stack, "prefill")
    (decode,) = engines(stack, "decode")
    obtain = decode.kv_arrivals.obtain
    delayed: list[str] = []

    async def late_first_pull(handle: KvHandle, instance_id: int) -> str | None:
        if not delayed:  # the first pull comes after the handle's TTL
            delayed.append(handle.handle_id)
            await until(lambda: handle.handle_id not in prefill.kv_handles)
        return await obtain(handle, instance_id)

    decode.kv_arrivals.obtain = late_first_pull  # type: ignore[method-assign]
    body = await complete(stack, LONG, max_tokens=4)
    assert delayed and body["nvext"]["routing"]["disaggregated"] is True
    assert body["usage"]["completion_tokens"] == 4
    text = await metrics(stack)
    assert metric(text, "turnout_disagg_retries_total", model="mock", reason="kv_transfer") == 1
    assert blocks_held(prefill) == 0


async def test_a_dying_decode_worker_migrates(stacks: MakeStack, gguf_path: str) -> None:
    # The doomed decode worker holds the prompt (a first turn ran there), so the request runs
    # whole on it; it fails a few tokens in, and the continuation goes to the other decode
    # worker, which holds nothing of the prompt: through the prefill stage again.
    doomed_config = config(role="decode", fail_after_steps=6)
    stack = await stacks(decode=1, decode_config=doomed_config, migration_limit=2)
    (doomed,) = engines(stack, "decode")
    await complete(stack, LONG, max_tokens=2)
    await stack.wait_for_cached_blocks("mock", LONG, len(LONG) // BLOCK)
    await add(stack, config(role="decode"), gguf_path)
    await stack.wait_for_model("mock", instances=2)
    body = await complete(stack, LONG, max_tokens=20)
    assert doomed.failure is not None
    assert body["usage"]["completion_tokens"] == 20
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["nvext"]["worker_id"] != f"{doomed.worker_id:x}"
    assert body["nvext"]["routing"]["disaggregated"] is True
    text = await metrics(stack)
    assert metric(text, "turnout_disagg_local_total", model="mock", reason="cached_on_decode") == 1
