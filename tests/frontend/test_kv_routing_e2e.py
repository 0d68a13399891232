"""KV-aware routing end to end: 4 mocker workers behind the real frontend in kv mode."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from tests.frontend.stack import Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.mocker import MockerConfig, make_mocker_engines
from turnout.router.kv.config import KvRouterConfig, RouterCost
from turnout.router.mode import RouterMode

BLOCK = 16


@pytest.fixture(params=[RouterCost.TTFT, RouterCost.BLOCKS])
async def kv_stack(gguf_path: str, request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    before = set(asyncio.all_tasks())
    stack = await make_stack(
        router_mode=RouterMode.KV, kv=KvRouterConfig(block_size=BLOCK, router_cost=request.param)
    )
    config = MockerConfig(num_gpu_blocks=1024, block_size=BLOCK, speedup_ratio=1.0)
    for engine in make_mocker_engines(config, 4, model_path=gguf_path):
        await stack.add_worker(engine, model_name="mock")
    await stack.wait_for_model("mock", instances=4)
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


async def complete(http: httpx.AsyncClient, prompt: list[int], max_tokens: int = 4) -> Any:
    r = await http.post(
        "/v1/completions",
        json={"model": "mock", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
              "nvext": {"extra_fields": ["worker_id", "routing"]}},
        timeout=30,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def prompt_of(seed: int, tokens: int = 512) -> list[int]:
    return [1000 + (seed * 7919 + i * 31) % 30000 for i in range(tokens)]


async def test_repeated_prompts_go_where_their_prefix_is(kv_stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=kv_stack.url) as http:
        homes = {}
        for seed in range(3):
            first = await complete(http, prompt_of(seed))
            homes[seed] = first["nvext"]["worker_id"]
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for seed in range(3):
            await kv_stack.wait_for_cached_blocks("mock", prompt_of(seed), 512 // BLOCK)
        for _ in range(3):
            for seed in range(3):
                # Same prefix, different tail: only the shared blocks can hit.
                prompt = prompt_of(seed)[:480] + [5, 6, 7] * 10
                out = await complete(http, prompt)
                assert out["nvext"]["worker_id"] == homes[seed]
                routing = out["nvext"]["routing"]
                # The shared 30 blocks, and from the second pass on the tail block too.
                assert routing["overlap_blocks"] >= 480 // BLOCK
                assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 480 - BLOCK
                # The explanation lists every candidate with its cost terms.
                assert len(routing["candidates"]) == 4
                chosen = min(routing["candidates"], key=lambda c: c["cost"])
                assert chosen["cost"] <= min(c["cost"] for c in routing["candidates"])
        metrics = (await http.get("/metrics")).text
        assert 'turnout_kv_predicted_hit_rate{model="mock"}' in metrics
        assert "turnout_kv_events_applied_total" in metrics


async def test_a_flood_of_one_prefix_spreads_once_its_worker_is_loaded(kv_stack: Stack) -> None:
    """Requests sharing a cached prefix but each with its own long tail: the prefix's worker
    takes the first ones, then its queued prefill outweighs the hit and others take the rest
    (with either cost)."""
    async with httpx.AsyncClient(base_url=kv_stack.url) as http:
        await complete(http, prompt_of(42))
        await kv_stack.wait_for_cached_blocks("mock", prompt_of(42), 512 // BLOCK)
        flood = [
            complete(http, prompt_of(42)[:480] + prompt_of(1000 + i), max_tokens=40)
            for i in range(16)
        ]
        outs = await asyncio.gather(*flood)
        used = Counter(o["nvext"]["worker_id"] for o in outs)
        assert len(used) >= 3, used
        home = outs[0]["nvext"]["worker_id"]
        assert used[home] >= 2


async def test_tenants_with_identical_prompts_share_no_cache(kv_stack: Stack) -> None:
    """cache_salt partitions the workers' caches and the router's index alike."""
    prompt = prompt_of(7)
    async with httpx.AsyncClient(base_url=kv_stack.url) as http:

        async def as_tenant(salt: str, where: str) -> Any:
            body: dict[str, Any] = {
                "model": "mock", "prompt": prompt, "max_tokens": 2, "ignore_eos": True,
                "nvext": {"extra_fields": ["worker_id", "routing"]},
            }  # fmt: skip
            if where == "top":
                body["cache_salt"] = salt
            else:
                body["nvext"]["cache_salt"] = salt
            r = await http.post("/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()

        await as_tenant("tenant-a", "top")
        await kv_stack.wait_for_cached_blocks(
            "mock", prompt, len(prompt) // BLOCK, cache_salt="tenant-a"
        )
        again = await as_tenant("tenant-a", "nvext")
        assert again["nvext"]["routing"]["overlap_blocks"] == len(prompt) // BLOCK
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) - BLOCK
        other = await as_tenant("tenant-b", "top")
        assert all(c["overlap_blocks"] == 0 for c in other["nvext"]["routing"]["candidates"])
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        plain = await complete(http, prompt)
        assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize(
    ("extra", "headers", "param"),
    [
        ({"cache_salt": "a", "nvext": {"cache_salt": "b"}}, {}, "cache_salt"),
        ({"cache_salt": ""}, {}, "cache_salt"),
        ({"nvext": {"cache_salt": "x" * 257}}, {}, "nvext.cache_salt"),
        ({"cache_salt": 5}, {}, None),
        ({}, {"x-session-id": "s" * 257}, "x-session-id"),
    ],
)
async def test_bad_salt_or_session_is_a_400_naming_it(
    kv_stack: Stack, extra: dict[str, Any], headers: dict[str, str], param: str | None
) -> None:
    body = {"model": "mock", "prompt": [1, 2, 3], "max_tokens": 1, **extra}
    async with httpx.AsyncClient(base_url=kv_stack.url) as http:
        r = await http.post("/v1/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param and param in error["message"]
    else:
        assert "cache_salt" in error["message"]


@pytest.mark.parametrize("header", ["x-session-id", "x-claude-code-session-id", "session-id"])
async def test_a_session_header_names_the_last_turns_worker(kv_stack: Stack, header: str) -> None:
    async with httpx.AsyncClient(base_url=kv_stack.url) as http:

        async def turn(tokens: list[int]) -> Any:
            r = await http.post(
                "/v1/completions",
                json={"model": "mock", "prompt": tokens, "max_tokens": 2,
                      "nvext": {"extra_fields": ["worker_id", "routing"]}},
                headers={header: "conversation-1"},
                timeout=30,
            )  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()

        first = await turn(prompt_of(11, 64))
        assert first["nvext"]["routing"].get("preferred_worker_id") is None
        second = await turn(prompt_of(12, 64))  # an unrelated prompt: only the session links
        routing = second["nvext"]["routing"]
        assert routing["preferred_worker_id"] == first["nvext"]["worker_id"]
        assert second["nvext"]["worker_id"] == first["nvext"]["worker_id"]
        bonus = [c for c in routing["candidates"] if c.get("session_bonus")]
        assert [c["worker_id"] for c in bonus] == [first["nvext"]["worker_id"]]
        metrics = (await http.get("/metrics")).text
        assert "turnout_kv_ttft_predictions_total" in metrics or routing["cost"] == "blocks"
        assert "turnout_kv_worker_step_model" in metrics


async def test_a_request_past_its_first_token_weighs_as_decode_not_prefill(
    kv_stack: Stack,
) -> None:
    """The router's books move a request from prefill to decode at its first token: while it
    streams, the next request's routing sees its worker with decode blocks and no prefill
    left (were it still counted as prefilling, that worker would look slower to a first token
    than it is)."""
    body = {"model": "mock", "prompt": prompt_of(77), "max_tokens": 4000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    async with httpx.AsyncClient(base_url=kv_stack.url) as http:
        async with http.stream("POST", "/v1/completions", json=body, timeout=30) as stream:
            assert stream.status_code == 200
            async for line in stream.aiter_lines():
                # The router books the first token before the frontend sends it on.
                if line.startswith("data: {") and any(
                    c.get("text") for c in json.loads(line[6:])["choices"]
                ):
                    break
            out = await complete(http, prompt_of(78))
            busy = [c for c in out["nvext"]["routing"]["candidates"] if c["active_decode_blocks"]]
            assert len(busy) == 1, out["nvext"]["routing"]
            assert busy[0]["active_decode_blocks"] >= 512 // BLOCK
            assert busy[0]["active_prefill_blocks"] == 0
        if kv_stack.frontend.factory.kv_routers["mock"].config.router_cost is RouterCost.TTFT:
            # The first token also realised the streamed request's predicted TTFT.
            metrics = (await http.get("/metrics")).text
            assert (
                f'turnout_kv_ttft_predictions_total{{model="mock",worker="{busy[0]["worker_id"]}'
                in metrics
            )
