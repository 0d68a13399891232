"""The response store by tenant, through the official ``openai`` client and raw HTTP against
real stacks with API keys: a tenant's stored responses and conversations are missing to every
other tenant (the same 404, byte for byte, as an id that never existed) on every store route,
for ``previous_response_id`` and for ``conversation``, while their owner reads them; records a
frontend without credentials wrote belong to the ``default`` tenant (``--api-key`` keys). And
each backend keeps tenants apart whatever their names spell with the ids (Redis's keys join
them with colons)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tests.frontend.stack import Stack, WholePromptEcho, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.frontend.responses.store import make_response_store

KEY_A = "sk-turnout-test-store-tenant-a-3e1b"
KEY_B = "sk-turnout-test-store-tenant-b-c47a"
KEY_DEFAULT = "sk-turnout-test-store-default-09f5"
MODEL = "echo"

MakeStack = Callable[..., Awaitable[Stack]]


def keys_file(folder: Path) -> str:
    """A keys file of tenants ``a`` and ``b``, one key each."""
    path = folder / "keys.toml"
    path.write_text(
        f'[[keys]]\nkey = "{KEY_A}"\ntenant = "a"\n\n[[keys]]\nkey = "{KEY_B}"\ntenant = "b"\n'
    )
    return str(path)


@pytest.fixture
async def stacks(gguf_path: str) -> AsyncIterator[MakeStack]:
    """Makes stacks with one echo worker (model ``echo``, answering with the whole
    conversation) and the given frontend settings; closes them and checks for leaks."""
    before = set(asyncio.all_tasks())
    made: list[Stack] = []

    async def make(**config: Any) -> Stack:
        stack = await make_stack(**config)
        made.append(stack)
        await stack.add_worker(WholePromptEcho(gguf_path), model_name=MODEL)
        await stack.wait_for_model(MODEL)
        return stack

    yield make
    for stack in made:
        await stack.close()
    await assert_no_leaked_tasks(before)


@pytest.fixture
async def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A ``--response-store`` of the parametrized kind, empty."""
    kind = request.param
    if kind == "memory":
        return "memory:"
    if kind == "sqlite":
        return f"sqlite:{tmp_path / 'responses.db'}"
    if kind == "postgres":
        return str(await request.getfixturevalue("postgres_server").create_database())
    server = request.getfixturevalue("redis_server")
    import redis.asyncio as aioredis

    client = aioredis.from_url(server.url(12))
    await client.flushdb()
    await client.aclose()
    return str(server.url(12))


def api(stack: Stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def unknown_like(ident: str) -> str:
    """An id of the same kind and length as ``ident`` that no record has."""
    prefix, _, rest = ident.partition("_")
    return f"{prefix}_{'0' * len(rest)}"


async def assert_missing(
    http: httpx.AsyncClient,
    key: str,
    method: str,
    path: str,
    ids: list[str],
    body: dict[str, Any] | None = None,
) -> None:
    """``method path`` (with ``body``) as ``key`` answers as it does when the ``ids`` in it
    never existed: the same 404 and the same body, the ids aside."""
    headers = bearer(key)
    got = await http.request(method, path, json=body, headers=headers)
    fake_path, fake_body = path, json.dumps(body)
    for ident in ids:
        fake_path = fake_path.replace(ident, unknown_like(ident))
        fake_body = fake_body.replace(ident, unknown_like(ident))
    missing = await http.request(method, fake_path, json=json.loads(fake_body), headers=headers)
    assert got.status_code == 404, (method, path, got.text)
    assert missing.status_code == 404, (method, fake_path, missing.text)
    text = got.text
    for ident in ids:
        text = text.replace(ident, unknown_like(ident))
    assert text == missing.text, (method, path)
    assert got.headers["content-type"] == missing.headers["content-type"]


@pytest.mark.parametrize("store_spec", ["memory", "sqlite", "postgres", "redis"], indirect=True)
async def test_another_tenants_records_are_missing(
    stacks: MakeStack, store_spec: str, tmp_path: Path
) -> None:
    stack = await stacks(response_store=store_spec, api_keys_file=keys_file(tmp_path))
    a, b = api(stack, KEY_A), api(stack, KEY_B)
    first = await a.responses.create(model=MODEL, input="a's secret question")
    second = await a.responses.create(
        model=MODEL, input="a's follow-up", previous_response_id=first.id
    )
    conversation = await a.conversations.create(
        metadata={"owner": "a"},
        items=[{"type": "message", "role": "user", "content": "a's conversation"}],
    )
    in_conv = await a.responses.create(
        model=MODEL, input="asked in a's conversation", conversation=conversation.id
    )
    item_id = (await a.conversations.items.list(conversation.id, order="asc")).data[0].id
    assert item_id is not None
    conv = f"/v1/conversations/{conversation.id}"
    item_ids = [conversation.id, item_id]
    async with httpx.AsyncClient(base_url=stack.url) as http:
        for response_id in (first.id, second.id, in_conv.id):
            for method, path in (
                ("GET", f"/v1/responses/{response_id}"),
                ("GET", f"/v1/responses/{response_id}/input_items"),
                ("DELETE", f"/v1/responses/{response_id}"),
            ):
                await assert_missing(http, KEY_B, method, path, [response_id])
            await assert_missing(
                http, KEY_B, "POST", "/v1/responses", [response_id],
                {"model": MODEL, "input": "b tries", "previous_response_id": response_id},
            )  # fmt: skip
        for method, path, body, ids in (
            ("GET", conv, None, [conversation.id]),
            ("POST", conv, {"metadata": {"owner": "b"}}, [conversation.id]),
            ("GET", f"{conv}/items", None, [conversation.id]),
            ("POST", f"{conv}/items", {"items": [{"role": "user", "content": "b's"}]},
             [conversation.id]),
            ("GET", f"{conv}/items/{item_id}", None, item_ids),
            ("DELETE", f"{conv}/items/{item_id}", None, item_ids),
            ("DELETE", conv, None, [conversation.id]),
            ("POST", "/v1/responses", {"model": MODEL, "input": "b tries",
                                       "conversation": conversation.id}, [conversation.id]),
        ):  # fmt: skip
            await assert_missing(http, KEY_B, method, path, ids, body)
    # Tenant a's records are whole: b deleted, changed and added nothing.
    assert (await a.responses.retrieve(second.id)).output_text == second.output_text
    said = [i async for i in a.responses.input_items.list(second.id, order="asc")]
    assert len(said) == 3  # first's input and output, then second's input
    kept = await a.conversations.retrieve(conversation.id)
    assert kept.metadata == {"owner": "a"}
    items = (await a.conversations.items.list(conversation.id, order="asc")).data
    assert len(items) == 3 and items[0].id == item_id  # its item, in_conv's input and output
    third = await a.responses.create(model=MODEL, input="a's third", previous_response_id=second.id)
    assert "a's secret question" in third.output_text
    # b's own records, under the same routes, stay b's.
    own = await b.responses.create(model=MODEL, input="b's question")
    assert (await b.responses.retrieve(own.id)).id == own.id
    with pytest.raises(openai.NotFoundError):
        await a.responses.retrieve(own.id)
    await a.responses.delete(first.id)
    await a.conversations.delete(conversation.id)
    await a.close()
    await b.close()


async def test_records_without_credentials_are_the_default_tenants(
    stacks: MakeStack, tmp_path: Path
) -> None:
    """A frontend without credentials writes a store; the same store behind keys: an
    ``--api-key`` key (tenant ``default``) reads its records, tenant ``a`` does not."""
    spec = f"sqlite:{tmp_path / 'responses.db'}"
    open_stack = await stacks(response_store=spec)
    anonymous = api(open_stack, "unused")
    before = await anonymous.responses.create(model=MODEL, input="asked before keys")
    conversation = await anonymous.conversations.create(metadata={"owner": "anyone"})
    await anonymous.close()
    await open_stack.close()

    keyed = await stacks(
        response_store=spec, api_keys=[KEY_DEFAULT], api_keys_file=keys_file(tmp_path)
    )
    default, a = api(keyed, KEY_DEFAULT), api(keyed, KEY_A)
    assert (await default.responses.retrieve(before.id)).output_text == before.output_text
    assert (await default.conversations.retrieve(conversation.id)).metadata == {"owner": "anyone"}
    later = await default.responses.create(
        model=MODEL, input="asked after keys", previous_response_id=before.id
    )
    assert "asked before keys" in later.output_text
    with pytest.raises(openai.NotFoundError):
        await a.responses.retrieve(before.id)
    with pytest.raises(openai.NotFoundError):
        await a.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        await a.responses.create(model=MODEL, input="a tries", previous_response_id=before.id)
    await default.close()
    await a.close()


@pytest.mark.parametrize("store_spec", ["memory", "sqlite", "postgres", "redis"], indirect=True)
async def test_tenant_and_id_never_spell_another_tenants_key(store_spec: str) -> None:
    """Tenant names may hold colons, and clients name ids: ``a:b`` + ``c`` and ``a`` +
    ``b:c`` (or ``a:`` + ``c`` and ``a`` + ``:c``) are different records everywhere."""
    store = make_response_store(store_spec)
    assert store is not None
    await store.open()
    try:
        later = time.time() + 3600
        await store.put_response("a:b", "c", b"a:b's", later)
        await store.put_response("a:", "c", b"a:'s", later)
        await store.put_conversation("a:b", "c", b"a:b's conversation", later)
        assert await store.add_items("a:b", "c", [("i", b"item")], later)
        assert await store.get_responses("a", ["b:c", ":c"]) == {}
        assert await store.get_responses("", ["a:b:c", "a::c"]) == {}
        assert await store.get_conversation("a", "b:c") is None
        assert await store.list_items("a", "b:c") == []
        assert not await store.delete_item("a", "b:c", "i")
        assert not await store.delete_response("a", "b:c")
        assert not await store.delete_conversation("a", "b:c")
        assert await store.get_responses("a:b", ["c"]) == {"c": b"a:b's"}
        assert await store.get_responses("a:", ["c"]) == {"c": b"a:'s"}
        assert await store.list_items("a:b", "c") == [("i", b"item")]
    finally:
        await store.close()
