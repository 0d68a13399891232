"""Tenants' accounts on the routes that do not run a Tokens-input generation: a Text-input
model's relayed response charges its tenant the usage its worker reports (so
``tokens_per_minute`` binds and ``/admin/usage`` counts it), and the response store's routes
are admitted by the tenant's limits (429 with ``Retry-After`` in OpenAI's shape)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
from tests.frontend.stack import Stack, make_stack
from tests.frontend.test_text_models import TEXT_ENDPOINT, shouting_worker
from tests.helpers import assert_no_leaked_tasks

from turnout.protocols.model import ModelDeploymentCard, ModelInput, ModelType, mdc_key

KEY_A = "sk-turnout-test-charging-a-0a1b"
KEY_SLOW = "sk-turnout-test-charging-slow-2c3d"
KEY_THRIFTY = "sk-turnout-test-charging-thrifty-4e5f"
KEY_ADMIN = "sk-turnout-test-charging-admin-6a7b"
MODEL = "shout"

KEYS = f"""
[[keys]]
key = "{KEY_A}"
tenant = "a"
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


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    """A frontend with the keys above and a Text+Chat worker (``shouting_worker``: 3 prompt
    tokens, one output token per word) serving ``shout``."""
    before = set(asyncio.all_tasks())
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(KEYS)
    stack = await make_stack(api_keys_file=str(keys_file))

    def records(instance_id: int) -> list[tuple[str, bytes]]:
        card = ModelDeploymentCard(
            display_name=MODEL, endpoint=TEXT_ENDPOINT, instance_id=instance_id,
            model_type=ModelType.Chat, model_input=ModelInput.Text,
        )  # fmt: skip
        return [(mdc_key(TEXT_ENDPOINT, instance_id), msgspec.json.encode(card))]

    serving = await stack.runtime.endpoint(TEXT_ENDPOINT).serve(shouting_worker, records=records)
    await stack.wait_for_model(MODEL)
    yield stack
    await serving.stop(drain_timeout=0.5)
    await stack.close()
    await assert_no_leaked_tasks(before)


def client(stack: Stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


async def shout(stack: Stack, key: str, text: str, *, stream: bool = False) -> str:
    messages = [{"role": "user", "content": text}]
    async with client(stack, key) as api:
        if not stream:
            whole = await api.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
            return whole.choices[0].message.content or ""
        chunks = await api.chat.completions.create(model=MODEL, messages=messages, stream=True)  # type: ignore[arg-type]
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


async def usage_of(stack: Stack, tenant: str) -> dict[str, int]:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        got = await http.get("/admin/usage", headers={"authorization": f"Bearer {KEY_ADMIN}"})
    assert got.status_code == 200
    return dict(got.json()["tenants"][tenant])


async def test_text_model_usage_is_charged(stack: Stack) -> None:
    assert await shout(stack, KEY_A, "one two three") == "ONE TWO THREE"
    after_whole = await usage_of(stack, "a")
    assert after_whole["requests"] == 1
    assert after_whole["prompt_tokens"] == 3 and after_whole["output_tokens"] == 3
    assert await shout(stack, KEY_A, "four five", stream=True) == "FOUR FIVE"
    after_stream = await usage_of(stack, "a")
    assert after_stream["requests"] == 2
    assert after_stream["prompt_tokens"] == 6 and after_stream["output_tokens"] == 5


async def test_text_model_tokens_per_minute_binds(stack: Stack) -> None:
    # The worker reports its tokens once it streams: the first request is not cut, its
    # tokens overdraw the budget, and the next one is refused.
    assert await shout(stack, KEY_THRIFTY, "spend it all", stream=True) == "SPEND IT ALL"
    with pytest.raises(openai.RateLimitError) as caught:
        await shout(stack, KEY_THRIFTY, "again")
    assert caught.value.code == "tenant_tokens_per_minute_limit"
    assert int(caught.value.response.headers["retry-after"]) >= 1


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/responses/resp_missing"),
        ("DELETE", "/v1/responses/resp_missing"),
        ("GET", "/v1/responses/resp_missing/input_items"),
        ("GET", "/v1/conversations/conv_missing"),
        ("POST", "/v1/conversations"),
    ],
)
async def test_store_routes_are_admitted_by_the_tenants_limits(
    stack: Stack, method: str, path: str
) -> None:
    headers = {"authorization": f"Bearer {KEY_SLOW}"}
    body = b"{}" if method == "POST" else None
    async with httpx.AsyncClient(base_url=stack.url) as http:
        first = await http.request(method, path, headers=headers, content=body)
        assert first.status_code in (200, 404)  # admitted: the store answers
        refused = await http.request(method, path, headers=headers, content=body)
        assert refused.status_code == 429
        assert refused.headers["retry-after"].isdigit()
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "tenant_rps_limit" and "'slow'" in error["message"]
        other = await http.request(
            method, path, headers={"authorization": f"Bearer {KEY_A}"}, content=body
        )
        assert other.status_code == first.status_code  # other tenants are not held back
    usage = await usage_of(stack, "slow")
    assert usage["requests"] == 2  # the admitted one and the refused one
