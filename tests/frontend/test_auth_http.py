"""Authentication over HTTP, through the official ``openai`` and ``anthropic`` clients: 401
on every generation route without a valid key (missing, wrong, revoked by a reload), 200 with
one, open and public routes, the control routes' admin key and their audit lines, JWTs."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from tests.frontend.jwt_issuer import JwtIssuer
from tests.frontend.stack import Stack, echo_engine, make_stack
from tests.helpers import assert_no_leaked_tasks
from tests.polling import eventually

from turnout.frontend.access.jwt import JwtConfig
from turnout.router.mode import RouterMode

KEY_A = "sk-turnout-test-tenant-a-5f2c"
KEY_B = "sk-turnout-test-tenant-b-91d0"
KEY_ADMIN = "sk-turnout-test-admin-77e3"
WRONG = "sk-turnout-test-wrong-0000"
MODEL = "echo"


def keys_toml(*entries: tuple[str, str, bool]) -> str:
    return "".join(
        f'[[keys]]\nkey = "{key}"\ntenant = "{tenant}"\nadmin = {str(admin).lower()}\n'
        for key, tenant, admin in entries
    )


@dataclass
class Secured:
    stack: Stack
    keys_file: Path
    jwt: JwtIssuer

    @property
    def url(self) -> str:
        return self.stack.url

    def openai(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def anthropic(self, key: str) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.url, api_key=key, max_retries=0)


@pytest.fixture
async def secured(gguf_path: str, tmp_path: Path) -> AsyncIterator[Secured]:
    """A frontend in kv mode with a keys file (tenants a and b, an admin), JWTs of a test
    issuer, and one echo worker (model ``echo``)."""
    before = set(asyncio.all_tasks())
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(
        keys_toml((KEY_A, "a", False), (KEY_B, "b", False), (KEY_ADMIN, "ops", True))
    )
    issuer = JwtIssuer(tmp_path / "idp")
    jwt = JwtConfig(issuer=issuer.issuer, audience="turnout", jwks_file=issuer.jwks_file)
    stack = await make_stack(router_mode=RouterMode.KV, api_keys_file=str(keys_file), jwt=jwt)
    await stack.add_worker(echo_engine(gguf_path), model_name=MODEL)
    await stack.wait_for_model(MODEL)
    yield Secured(stack, keys_file, issuer)
    await stack.close()
    await assert_no_leaked_tasks(before)


Call = Callable[["Secured", str], Awaitable[object]]


async def chat(s: Secured, key: str) -> object:
    async with s.openai(key) as api:
        return await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


async def chat_stream(s: Secured, key: str) -> object:
    async with s.openai(key) as api:
        stream = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
        return [chunk async for chunk in stream]


async def completions(s: Secured, key: str) -> object:
    async with s.openai(key) as api:
        return await api.completions.create(model=MODEL, prompt="hi", max_tokens=2)


async def embeddings(s: Secured, key: str) -> object:
    async with s.openai(key) as api:
        return await api.embeddings.create(model=MODEL, input="hi")


async def responses(s: Secured, key: str) -> object:
    async with s.openai(key) as api:
        return await api.responses.create(model=MODEL, input="hi", max_output_tokens=2)


async def models(s: Secured, key: str) -> object:
    async with s.openai(key) as api:
        return await api.models.list()


async def messages(s: Secured, key: str) -> object:
    async with s.anthropic(key) as api:
        return await api.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )


async def count_tokens(s: Secured, key: str) -> object:
    async with s.anthropic(key) as api:
        return await api.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )


OPENAI_ROUTES = [chat, chat_stream, completions, embeddings, responses, models]
ANTHROPIC_ROUTES = [messages, count_tokens]


@pytest.mark.parametrize("call", OPENAI_ROUTES, ids=lambda c: c.__name__)
async def test_openai_routes_refuse_a_wrong_key(secured: Secured, call: Call) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        await call(secured, WRONG)
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    assert caught.value.response.headers["www-authenticate"].startswith("Bearer")
    assert WRONG not in caught.value.response.text


@pytest.mark.parametrize("call", ANTHROPIC_ROUTES, ids=lambda c: c.__name__)
async def test_anthropic_routes_refuse_a_wrong_key(secured: Secured, call: Call) -> None:
    with pytest.raises(anthropic.AuthenticationError) as caught:
        await call(secured, WRONG)
    assert caught.value.status_code == 401
    body = caught.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
        "/v1/messages", "/v1/messages/count_tokens", "/v1/tensor", "/v1/conversations",
    ],
)  # fmt: skip
async def test_every_generation_route_refuses_a_missing_key(secured: Secured, path: str) -> None:
    async with httpx.AsyncClient(base_url=secured.url) as http:
        response = await http.post(path, json={"model": MODEL})
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == 'Bearer realm="turnout"'
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["error"]["type"] == "authentication_error"
    else:
        assert body["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("call", [*OPENAI_ROUTES[:3], responses, models, *ANTHROPIC_ROUTES],
                         ids=lambda c: c.__name__)  # fmt: skip
async def test_a_good_key_is_served(secured: Secured, call: Call) -> None:
    await call(secured, KEY_A)


async def test_x_api_key_is_accepted(secured: Secured) -> None:
    async with httpx.AsyncClient(base_url=secured.url) as http:
        response = await http.post(
            "/v1/chat/completions",
            headers={"x-api-key": KEY_B},
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        )
    assert response.status_code == 200, response.text


async def test_sighup_reload_revokes_a_key(secured: Secured) -> None:
    await chat(secured, KEY_B)
    secured.keys_file.write_text(keys_toml((KEY_A, "a", False), (KEY_ADMIN, "ops", True)))
    os.kill(os.getpid(), signal.SIGHUP)
    auth = secured.stack.frontend.auth
    assert auth is not None
    await eventually(lambda: auth.ring.lookup(KEY_B) is None, what="the reloaded ring")
    with pytest.raises(openai.AuthenticationError):
        await chat(secured, KEY_B)
    with pytest.raises(anthropic.AuthenticationError):
        await messages(secured, KEY_B)
    await chat(secured, KEY_A)


async def test_open_and_keyed_routes(secured: Secured) -> None:
    async with httpx.AsyncClient(base_url=secured.url) as http:
        assert (await http.get("/live")).status_code == 200
        assert (await http.get("/health")).status_code == 200
        for path in ("/metrics", "/openapi.json", "/v1/models", "/no/such/route"):
            assert (await http.get(path)).status_code == 401, path
        ok = await http.get("/metrics", headers={"authorization": f"Bearer {KEY_A}"})
        assert ok.status_code == 200
        document = (
            await http.get("/openapi.json", headers={"authorization": f"Bearer {KEY_A}"})
        ).json()
    paths = document["paths"]
    assert "401" in paths["/v1/chat/completions"]["post"]["responses"]
    assert "401" not in paths["/health"]["get"]["responses"]
    assert "403" in paths["/busy_threshold"]["post"]["responses"]
    assert "bearer" in document["components"]["securitySchemes"]


async def test_public_routes_open_without_a_key(gguf_path: str, tmp_path: Path) -> None:
    stack = await make_stack(api_keys=(KEY_A,), public_routes=("/metrics", "/v1/models"))
    try:
        async with httpx.AsyncClient(base_url=stack.url) as http:
            assert (await http.get("/metrics")).status_code == 200
            assert (await http.get("/v1/models")).status_code == 200
            assert (await http.get("/openapi.json")).status_code == 401
    finally:
        await stack.close()


def audit_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    out = []
    for record in caplog.records:
        if record.name == "turnout.audit":
            message = record.getMessage()
            assert message.startswith("audit ")
            out.append(json.loads(message.removeprefix("audit ")))
    return out


async def test_busy_threshold_needs_an_admin_key_and_is_audited(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="turnout.audit")
    change = {"model": MODEL, "kv_usage": 0.5}
    async with httpx.AsyncClient(base_url=secured.url) as http:
        assert (await http.get("/busy_threshold")).status_code == 401
        assert (await http.post("/busy_threshold", json=change)).status_code == 401
        refused = await http.post(
            "/busy_threshold", json=change, headers={"authorization": f"Bearer {KEY_A}"}
        )
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "admin_key_required"
        admin = {"authorization": f"Bearer {KEY_ADMIN}"}
        assert (await http.get("/busy_threshold", headers=admin)).status_code == 200
        changed = await http.post("/busy_threshold", json=change, headers=admin)
        assert changed.status_code == 200, changed.text
        assert changed.json()["kv_usage"] == 0.5
    denied, allowed = audit_lines(caplog)
    assert denied["outcome"] == "denied" and denied["tenant"] == "a"
    assert "before" not in denied
    assert allowed["outcome"] == "allowed"
    assert allowed["tenant"] == "ops" and allowed["route"] == "/busy_threshold"
    assert allowed["method"] == "POST" and allowed["client"].startswith("127.0.0.1:")
    assert len(allowed["key_id"]) == 12 and KEY_ADMIN not in caplog.text
    assert allowed["before"]["thresholds"][0]["kv_usage"] is None
    assert allowed["after"]["thresholds"][0]["kv_usage"] == 0.5


async def test_jwt_bearer_tokens(secured: Secured) -> None:
    token = secured.jwt.token(tenant="team-j")
    await chat(secured, token)
    async with secured.anthropic(token) as api:  # x-api-key carries a JWT as well
        await api.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "x"}])
    for bad in (
        secured.jwt.token(iss="https://elsewhere.example"),
        secured.jwt.token(aud="another-service"),
        secured.jwt.token(exp=1),
    ):
        with pytest.raises(openai.AuthenticationError):
            await chat(secured, bad)
    async with httpx.AsyncClient(base_url=secured.url) as http:
        refused = await http.get("/busy_threshold", headers={"authorization": f"Bearer {token}"})
    assert refused.status_code == 403


async def test_without_credentials_the_frontend_is_open(echo_stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=echo_stack.url) as http:
        assert (await http.get("/metrics")).status_code == 200
        assert (await http.get("/busy_threshold")).status_code == 200
