"""The prompt cache behind the real frontend: a multi-turn chat through an echo worker (which
answers with the prompt's own tokens) gets the same prompt with the cache as without, and
/metrics shows what the cache saved."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import pytest
from tests.frontend.stack import echo_engine, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.errors import ConfigError
from turnout.frontend.service import Frontend, FrontendConfig


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found is not None, name
    return float(found.group(1))


async def conversation(url: str, turns: int) -> list[tuple[int, str]]:
    """``turns`` requests, each the conversation so far plus a new question: per request,
    its prompt's token count and the echo (the prompt's text)."""
    out = []
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief, café ☕."}]
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for i in range(turns):
            messages.append({"role": "user", "content": f"  Question {i}:\n what now?  "})
            body = {"model": "echo", "messages": messages, "max_tokens": 2000,
                    "nvext": {"ignore_eos": True}}  # fmt: skip
            resp = await http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            data = resp.json()
            answer = data["choices"][0]["message"]["content"]
            out.append((data["usage"]["prompt_tokens"], answer))
            messages.append({"role": "assistant", "content": f"Answer {i}, with words."})
    return out


async def run(gguf_path: str, mib: float) -> tuple[list[tuple[int, str]], str]:
    before = set(asyncio.all_tasks())
    stack = await make_stack(prompt_cache_bytes=int(mib * 2**20))
    try:
        await stack.add_worker(echo_engine(gguf_path), model_name="echo")
        await stack.wait_for_model("echo")
        answers = await conversation(stack.url, 8)
        async with httpx.AsyncClient(base_url=stack.url) as http:
            metrics = (await http.get("/metrics")).text
    finally:
        await stack.close()
    await assert_no_leaked_tasks(before)
    return answers, metrics


async def test_same_prompts_fewer_tokens_encoded(gguf_path: str) -> None:
    cached, on = await run(gguf_path, 64)
    assert "Question 7:\n what now?" in cached[-1][1]  # the echo is the whole prompt
    whole, off = await run(gguf_path, 0)
    assert cached == whole
    total = sum(n for n, _ in whole)
    p = "turnout_prompt_cache_"
    for text in (on, off):
        assert metric(text, p + "prompts_total") == 8
        assert (
            metric(text, p + "tokens_encoded_total") + metric(text, p + "tokens_reused_total")
            == total
        )
    assert metric(off, p + "uncached_prompts_total") == 8
    assert metric(off, p + "capacity_bytes") == 0
    assert metric(on, p + "uncached_prompts_total") == 0
    assert 3 * metric(on, p + "tokens_encoded_total") < total
    assert metric(on, p + "entries") > 0 and metric(on, p + "bytes") <= 64 * 2**20
    assert metric(on, p + 'pieces_total{result="hit"}') > 0


def test_negative_bound_refused() -> None:
    with pytest.raises(ConfigError, match="prompt-cache-mib"):
        Frontend(FrontendConfig(prompt_cache_bytes=-1, response_store="memory:"))
