"""A model whose engine cannot partition its prefix cache (its card says ``cache_salt`` false,
as attached SGLang and llama.cpp servers' do), over HTTP with keys: an isolated tenant's
request is a 400 from the frontend, before any worker sees it, saying why and what an
operator can do; a tenant that shares the common cache is served; a client's own salt is a
400 naming the field and the model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import anthropic
import msgspec
import openai
import pytest
from tests.frontend.stack import Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.echo import EchoEngine
from turnout.protocols.llm import LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import ModelCapabilities, ModelDeploymentCard
from turnout.runtime.context import RequestContext

KEY_ISOLATED = "sk-turnout-test-isolated-7a1b"
KEY_SHARED = "sk-turnout-test-shared-9c2d"
ISOLATED_TENANT = "tenant-kept-apart"
MODEL = "unpartitioned"

KEYS = f"""
[[keys]]
key = "{KEY_ISOLATED}"
tenant = "{ISOLATED_TENANT}"
[[keys]]
key = "{KEY_SHARED}"
tenant = "sharer"
"""


class UnpartitionedEcho(EchoEngine):
    """An echo whose card says its engine cannot partition its cache; counts what it runs."""

    served = 0

    def model_card_template(self) -> ModelDeploymentCard:
        card = super().model_card_template()
        return msgspec.structs.replace(card, capabilities=ModelCapabilities(cache_salt=False))

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[LLMEngineOutput]:
        self.served += 1
        async for out in super().generate(request, ctx):
            yield out


@pytest.fixture
async def stack(gguf_path: str, tmp_path: Path) -> AsyncIterator[tuple[Stack, UnpartitionedEcho]]:
    before = set(asyncio.all_tasks())
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(KEYS)
    stack = await make_stack(
        api_keys_file=str(keys_file), shared_cache_tenants=frozenset({"sharer"})
    )
    engine = UnpartitionedEcho(gguf_path)
    await stack.add_worker(engine, model_name=MODEL)
    await stack.wait_for_model(MODEL)
    yield stack, engine
    await stack.close()
    await assert_no_leaked_tasks(before)


async def test_an_isolated_tenant_is_refused_before_routing(
    stack: tuple[Stack, UnpartitionedEcho],
) -> None:
    frontend, engine = stack
    async with openai.AsyncOpenAI(
        base_url=frontend.url + "/v1", api_key=KEY_ISOLATED, max_retries=0
    ) as api:
        with pytest.raises(openai.BadRequestError) as caught:
            await api.chat.completions.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
    error = caught.value
    assert error.status_code == 400
    assert f"'{MODEL}'" in error.message
    assert "cannot keep tenants' prefix caches apart" in error.message
    assert "--shared-cache-tenants" in error.message
    assert "cache_salt" not in error.message and ISOLATED_TENANT not in error.message
    assert isinstance(error.body, dict) and error.body.get("param") == "model"
    async with anthropic.AsyncAnthropic(
        base_url=frontend.url, api_key=KEY_ISOLATED, max_retries=0
    ) as claude:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
    assert "--shared-cache-tenants" in refused.value.message
    assert engine.served == 0


async def test_a_sharing_tenant_is_served_and_its_own_salt_refused(
    stack: tuple[Stack, UnpartitionedEcho],
) -> None:
    frontend, engine = stack
    async with openai.AsyncOpenAI(
        base_url=frontend.url + "/v1", api_key=KEY_SHARED, max_retries=0
    ) as api:
        done = await api.completions.create(model=MODEL, prompt="a b c", max_tokens=3)
        assert done.usage is not None and done.usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError) as caught:
            await api.completions.create(
                model=MODEL, prompt="a b c", max_tokens=3, extra_body={"cache_salt": "mine"}
            )
    error = caught.value
    assert "'cache_salt'" in error.message and f"'{MODEL}'" in error.message
    assert isinstance(error.body, dict) and error.body.get("param") == "cache_salt"
    assert engine.served == 1
