"""The frontend over HTTPS (``--tls-cert``/``--tls-key``), with the ``openai`` client trusting
a private CA; a client that does not trust it, or speaks plain HTTP, gets nothing."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import httpx
import openai
import pytest
from tests.certs import TestCa
from tests.frontend.stack import echo_engine, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.errors import ConfigError
from turnout.frontend.service import Frontend, FrontendConfig

KEY = "sk-turnout-test-tls-4a1b"


async def test_openai_client_over_tls(gguf_path: str, tmp_path: Path) -> None:
    before = set(asyncio.all_tasks())
    ca = TestCa(tmp_path)
    leaf = ca.issue("frontend", hosts=("127.0.0.1",))
    stack = await make_stack(tls_cert=leaf.cert, tls_key=leaf.key, api_keys=(KEY,))
    try:
        await stack.add_worker(echo_engine(gguf_path), model_name="echo")
        await stack.wait_for_model("echo")
        assert stack.url.startswith("https://127.0.0.1:")
        trust = ssl.create_default_context(cafile=leaf.ca)
        async with (
            httpx.AsyncClient(verify=trust) as http,
            openai.AsyncOpenAI(
                base_url=stack.url + "/v1", api_key=KEY, http_client=http, max_retries=0
            ) as api,
        ):
            out = await api.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert out.choices[0].message.content
            stream = await api.completions.create(
                model="echo", prompt="a b c", max_tokens=3, stream=True
            )
            assert [chunk async for chunk in stream]
        other = TestCa(tmp_path, name="other")
        async with httpx.AsyncClient(
            verify=ssl.create_default_context(cafile=str(other.ca_path))
        ) as untrusting:
            with pytest.raises(httpx.ConnectError):
                await untrusting.get(stack.url + "/live")
        async with httpx.AsyncClient() as plain:
            with pytest.raises(httpx.HTTPError):
                await plain.get(stack.url.replace("https://", "http://") + "/live")
    finally:
        await stack.close()
    await assert_no_leaked_tasks(before)


def test_tls_flags_are_checked_at_start(tmp_path: Path) -> None:
    leaf = TestCa(tmp_path).issue("frontend")
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key go together"):
        Frontend(FrontendConfig(tls_cert=leaf.cert))
    with pytest.raises(ConfigError, match="--tls-cert"):
        Frontend(FrontendConfig(tls_cert=leaf.key, tls_key=leaf.key))
    with pytest.raises(ConfigError, match="--tls-cert"):
        Frontend(FrontendConfig(tls_cert=str(tmp_path / "missing.pem"), tls_key=leaf.key))
