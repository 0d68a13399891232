"""Tenants over HTTP: a tenant past its limits gets 429 with ``Retry-After`` and a body naming
the limit (OpenAI's and Anthropic's shapes), usage per tenant on ``/admin/usage`` and
``/metrics``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from tests.frontend.stack import Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.mocker import MockerConfig, make_mocker_engines

KEY_A = "sk-turnout-test-tenant-a-c0de"
KEY_A2 = "sk-turnout-test-tenant-a-2nd-key"
KEY_B = "sk-turnout-test-tenant-b-f00d"
KEY_SLOW = "sk-turnout-test-slow-1a2b"
KEY_THRIFTY = "sk-turnout-test-thrifty-3c4d"
KEY_ADMIN = "sk-turnout-test-admin-5e6f"
MODEL = "mock"

KEYS = f"""
[[keys]]
key = "{KEY_A}"
tenant = "a"
[[keys]]
key = "{KEY_A2}"
tenant = "a"
[[keys]]
key = "{KEY_B}"
tenant = "b"
[[keys]]
key = "{KEY_SLOW}"
tenant = "slow"
rps = 0.001
[[keys]]
key = "{KEY_THRIFTY}"
tenant = "thrifty"
tokens_per_minute = 1
[[keys]]
key = "{KEY_ADMIN}"
tenant = "ops"
admin = true
"""


@dataclass
class Tenanted:
    stack: Stack

    def openai(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.stack.url + "/v1", api_key=key, max_retries=0)

    def anthropic(self, key: str) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.stack.url, api_key=key, max_retries=0)


@pytest.fixture(params=[frozenset()], ids=["isolated"])
async def tenanted(
    gguf_path: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Tenanted]:
    """A frontend with the keys above and one mocker worker (model ``mock``, blocks of 16):
    every request meets the same KV cache. ``request.param``: the tenants that share one
    cache space (``--shared-cache-tenants``)."""
    before = set(asyncio.all_tasks())
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(KEYS)
    stack = await make_stack(api_keys_file=str(keys_file), shared_cache_tenants=request.param)
    config = MockerConfig(num_gpu_blocks=256, block_size=16, speedup_ratio=0)
    (engine,) = make_mocker_engines(config, 1, model_path=gguf_path)
    await stack.add_worker(engine, model_name=MODEL)
    await stack.wait_for_model(MODEL)
    yield Tenanted(stack)
    await stack.close()
    await assert_no_leaked_tasks(before)


async def complete(
    t: Tenanted, key: str, prompt: list[int] | str = "a b c"
) -> openai.types.Completion:
    async with t.openai(key) as api:
        return await api.completions.create(model=MODEL, prompt=prompt, max_tokens=3)


async def test_rps_limit_is_a_429_naming_it(tenanted: Tenanted) -> None:
    await complete(tenanted, KEY_SLOW)
    with pytest.raises(openai.RateLimitError) as caught:
        await complete(tenanted, KEY_SLOW)
    error = caught.value
    assert error.status_code == 429 and error.code == "tenant_rps_limit"
    assert "'rps' limit (0.001)" in error.message and "'slow'" in error.message
    retry_after = error.response.headers["retry-after"]
    assert retry_after.isdigit() and int(retry_after) >= 1
    async with tenanted.anthropic(KEY_SLOW) as api:
        with pytest.raises(anthropic.RateLimitError) as refused:
            await api.messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
    assert refused.value.response.json()["error"]["type"] == "rate_limit_error"
    assert refused.value.response.headers["retry-after"].isdigit()
    await complete(tenanted, KEY_A)  # other tenants are not held back


async def test_tokens_per_minute_limit(tenanted: Tenanted) -> None:
    await complete(tenanted, KEY_THRIFTY)  # overdraws the budget; the stream is not cut
    with pytest.raises(openai.RateLimitError) as caught:
        await complete(tenanted, KEY_THRIFTY)
    assert caught.value.code == "tenant_tokens_per_minute_limit"
    assert int(caught.value.response.headers["retry-after"]) >= 1


async def test_usage_per_tenant_for_admins(tenanted: Tenanted) -> None:
    first = await complete(tenanted, KEY_A)
    await complete(tenanted, KEY_A2)
    await complete(tenanted, KEY_B)
    async with httpx.AsyncClient(base_url=tenanted.stack.url) as http:
        refused = await http.get("/admin/usage", headers={"authorization": f"Bearer {KEY_A}"})
        assert refused.status_code == 403
        admin = {"authorization": f"Bearer {KEY_ADMIN}"}
        usage = (await http.get("/admin/usage", headers=admin)).json()["tenants"]
        metrics = (await http.get("/metrics", headers=admin)).text
    assert first.usage is not None
    assert usage["a"]["requests"] == 2 and usage["b"]["requests"] == 1
    assert usage["a"]["output_tokens"] == 6 and usage["b"]["output_tokens"] == 3
    assert usage["a"]["prompt_tokens"] == 2 * first.usage.prompt_tokens
    assert 'turnout_tenant_tokens_total{kind="output",tenant="a"} 6.0' in metrics


def cached_tokens(out: openai.types.Completion) -> int:
    assert out.usage is not None
    details = out.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


#: A prompt of 6 full blocks of 16 tokens (and 4 more).
PROMPT = list(range(2000, 2100))


async def test_tenants_never_share_cached_prompts(tenanted: Tenanted) -> None:
    assert cached_tokens(await complete(tenanted, KEY_A, PROMPT)) == 0
    assert cached_tokens(await complete(tenanted, KEY_B, PROMPT)) == 0  # a's blocks: not b's
    assert cached_tokens(await complete(tenanted, KEY_A2, PROMPT)) >= 96  # a's, by another key
    assert cached_tokens(await complete(tenanted, KEY_B, PROMPT)) >= 96  # b's own


@pytest.mark.parametrize("tenanted", [frozenset({"a", "b"})], ids=["shared"], indirect=True)
async def test_shared_cache_tenants_share_cached_prompts(tenanted: Tenanted) -> None:
    assert cached_tokens(await complete(tenanted, KEY_A, PROMPT)) == 0
    assert cached_tokens(await complete(tenanted, KEY_B, PROMPT)) >= 96
    # A tenant outside the shared set keeps its own space.
    assert cached_tokens(await complete(tenanted, KEY_ADMIN, PROMPT)) == 0
