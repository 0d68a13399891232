"""Tenants' cache spaces on text-input models (relayed OpenAI bodies): an attached text-mode
server's card says it partitions its prefix cache by ``cache_salt`` only when it is vLLM's,
and the text pipeline refuses a salt, the tenant's or the client's, to a model whose card
says it cannot, with the preprocessor's own messages; over HTTP with keys, before any worker
sees the request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import msgspec
import openai
import pytest
from tests.engines.attach.fake_server import FakeServer, Reply
from tests.frontend.stack import Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.attach.cards import text_card
from turnout.engines.attach.text_relay import OpenAiApi
from turnout.engines.attach.upstream import Deadlines, Upstream
from turnout.errors import RequestError
from turnout.frontend.access.cache_space import CacheSpaces
from turnout.frontend.access.limits import PRINCIPAL_METADATA
from turnout.frontend.access.principal import Principal
from turnout.frontend.models.pipeline import TextPipeline
from turnout.llm.cache_salt import request_cache_salt, tenant_cache_salt
from turnout.protocols.model import (
    EndpointId,
    ModelCapabilities,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
    mdc_key,
)
from turnout.protocols.openai import ChatCompletionRequest
from turnout.runtime.context import RequestContext

ENDPOINT = EndpointId(namespace="t", component="text", name="generate")
FAST = Deadlines(connect=1.0, first_byte=2.0, idle=1.0, probe=1.0)


def card_of(name: str, *, partitions: bool) -> ModelDeploymentCard:
    return ModelDeploymentCard(
        display_name=name, endpoint=ENDPOINT, instance_id=1,
        model_type=ModelType.Chat | ModelType.Completions, model_input=ModelInput.Text,
        capabilities=ModelCapabilities(cache_salt=partitions),
    )  # fmt: skip


# ---------------------------------------------------------------- the text-mode card


@pytest.mark.parametrize(
    ("owner", "partitions"),
    [("vllm", True), ("sglang", False), ("llamacpp", False), (None, False), (7, False)],
)
async def test_a_text_card_says_cache_salt_only_for_vllm(owner: object, partitions: bool) -> None:
    server = await FakeServer().start()
    entry: dict[str, object] = {"id": "m", "max_model_len": 4096}
    if owner is not None:
        entry["owned_by"] = owner
    server.route("GET", "/v1/models", Reply(json={"object": "list", "data": [entry]}))
    up = Upstream(server.url, FAST)
    await up.open()
    try:
        info = await OpenAiApi(server.url).describe(up)
    finally:
        await up.close()
        await server.stop()
    card = text_card(info, name="m", endpoint=ENDPOINT)
    assert card.capabilities.cache_salt is partitions
    # The card travels as JSON to frontends: the declaration survives the trip.
    again = msgspec.json.decode(msgspec.json.encode(card), type=ModelDeploymentCard)
    assert again.capabilities.cache_salt is partitions


# ---------------------------------------------------------------- the text pipeline

SPACES = CacheSpaces(["sharer"])


def ctx_of(tenant: str | None) -> RequestContext:
    ctx = RequestContext()
    if tenant is not None:
        ctx.metadata[PRINCIPAL_METADATA] = Principal(tenant=tenant, key_id=f"{tenant}-key")
    return ctx


class RecordingRouter:
    """A router that records the bodies it is given and streams nothing."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def generate(self, body: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        self.bodies.append(body)

        async def nothing() -> AsyncIterator[bytes]:
            return
            yield b""

        return nothing()


def pipeline(*, partitions: bool) -> tuple[TextPipeline, RecordingRouter]:
    router = RecordingRouter()
    unused = cast(Any, None)
    card = card_of("m", partitions=partitions)
    return TextPipeline(
        "m", card, cast(Any, router), unused, is_chat=True, cache_spaces=SPACES
    ), router


def body_of(**fields: Any) -> bytes:
    return msgspec.json.encode({"model": "m", "messages": [], **fields})


def preprocessor_refusal(fields: dict[str, Any], tenant: str | None) -> RequestError:
    """What the tokens path says of the same request to the same card."""
    req = msgspec.convert({"model": "m", "messages": [], **fields}, ChatCompletionRequest)
    with pytest.raises(RequestError) as caught:
        request_cache_salt(req, tenant, card_of("m", partitions=False))
    return caught.value


@pytest.mark.parametrize(
    ("fields", "tenant", "param"),
    [
        ({}, "alice", "model"),  # the tenant's space cannot be kept
        ({"cache_salt": "mine"}, "alice", "cache_salt"),
        ({"cache_salt": "mine"}, None, "cache_salt"),  # a client's own salt, un-tenanted
        ({"cache_salt": "mine"}, "sharer", "cache_salt"),
        ({"nvext": {"cache_salt": "ext"}}, None, "nvext.cache_salt"),
    ],
)
def test_an_unpartitioned_text_model_refuses_every_salt_as_the_preprocessor_does(
    fields: dict[str, Any], tenant: str | None, param: str
) -> None:
    text, router = pipeline(partitions=False)
    with pytest.raises(RequestError) as caught:
        text.generate(body_of(**fields), ctx_of(tenant))
    expected = preprocessor_refusal(fields, SPACES.tenant_of(ctx_of(tenant)))
    assert str(caught.value) == str(expected)
    assert caught.value.param == expected.param == param
    assert "alice" not in str(caught.value)
    assert router.bodies == []


@pytest.mark.parametrize("tenant", [None, "sharer"])
def test_an_unpartitioned_text_model_relays_unsalted_requests_untouched(
    tenant: str | None,
) -> None:
    text, router = pipeline(partitions=False)
    body = body_of(nvext={"ignore_eos": True})
    text.generate(body, ctx_of(tenant))
    assert router.bodies == [body] and router.bodies[0] is body


@pytest.mark.parametrize(
    ("fields", "tenant", "relayed"),
    [
        ({}, "alice", tenant_cache_salt("alice", None)),
        ({"nvext": {"cache_salt": "ext"}}, "alice", tenant_cache_salt("alice", "ext")),
        # The relay drops nvext: an un-tenanted client's nvext salt goes as cache_salt.
        ({"nvext": {"cache_salt": "ext"}}, None, "ext"),
        ({"cache_salt": "mine", "nvext": {"cache_salt": "mine"}}, "sharer", "mine"),
    ],
)
def test_a_partitioning_text_model_relays_the_salt(
    fields: dict[str, Any], tenant: str | None, relayed: str
) -> None:
    text, router = pipeline(partitions=True)
    text.generate(body_of(**fields), ctx_of(tenant))
    assert msgspec.json.decode(router.bodies[-1])["cache_salt"] == relayed


@pytest.mark.parametrize("tenant", [None, "sharer"])
def test_an_un_tenanted_client_cannot_name_a_tenants_space(tenant: str | None) -> None:
    text, router = pipeline(partitions=True)
    forged = tenant_cache_salt("alice", None)
    for fields in ({"cache_salt": forged}, {"nvext": {"cache_salt": forged}}):
        with pytest.raises(RequestError, match="must not start with"):
            text.generate(body_of(**fields), ctx_of(tenant))
    # The key spelled with escapes: the NUL of a tenant's space still shows.
    escaped = b'{"model": "m", "messages": [], "cache\\u005fsalt": "\\u0000tenant:5:alice"}'
    with pytest.raises(RequestError, match="must not start with"):
        text.generate(escaped, ctx_of(tenant))
    assert router.bodies == []


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"cache_salt": 5}, "'cache_salt' must be a string"),
        ({"nvext": {"cache_salt": ["x"]}}, "'nvext.cache_salt' must be a string"),
        ({"cache_salt": "a", "nvext": {"cache_salt": "b"}}, "differ"),
        ({"cache_salt": ""}, "must not be empty"),
        ({"cache_salt": "x" * 257}, "longer than 256"),
    ],
)
def test_a_malformed_salt_is_refused_in_any_space(fields: dict[str, Any], says: str) -> None:
    text, router = pipeline(partitions=True)
    for tenant in (None, "alice"):
        with pytest.raises(RequestError, match=says):
            text.generate(body_of(**fields), ctx_of(tenant))
    assert router.bodies == []


# ---------------------------------------------------------------- over HTTP

KEY_ISOLATED = "sk-turnout-test-text-isolated-3e5f"
KEY_SHARED = "sk-turnout-test-text-shared-8b0a"
KEYS = f"""
[[keys]]
key = "{KEY_ISOLATED}"
tenant = "kept-apart"
[[keys]]
key = "{KEY_SHARED}"
tenant = "sharer"
"""


class TextWorker:
    """A Text+Chat worker that records the bodies it gets and answers "ok"."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def handle(self, payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        request = msgspec.json.decode(payload)
        self.bodies.append(request)
        base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0,
                "model": request["model"]}  # fmt: skip
        delta = {"role": "assistant", "content": "ok"}
        yield msgspec.json.encode(
            {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": "stop"}]}
        )


@pytest.fixture
async def http(tmp_path: Path) -> AsyncIterator[tuple[Stack, TextWorker]]:
    before = set(asyncio.all_tasks())
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(KEYS)
    stack = await make_stack(
        api_keys_file=str(keys_file), shared_cache_tenants=frozenset({"sharer"})
    )
    worker = TextWorker()

    def records(instance_id: int) -> list[tuple[str, bytes]]:
        card = msgspec.structs.replace(
            card_of("sglang-text", partitions=False), instance_id=instance_id
        )
        return [(mdc_key(ENDPOINT, instance_id), msgspec.json.encode(card))]

    serving = await stack.runtime.endpoint(ENDPOINT).serve(worker.handle, records=records)
    await stack.wait_for_model("sglang-text")
    yield stack, worker
    await serving.stop(drain_timeout=0.5)
    await stack.close()
    await assert_no_leaked_tasks(before)


async def test_a_tenant_is_refused_by_an_unpartitioned_text_model_over_http(
    http: tuple[Stack, TextWorker],
) -> None:
    stack, worker = http
    messages: Any = [{"role": "user", "content": "hi"}]
    async with openai.AsyncOpenAI(
        base_url=stack.url + "/v1", api_key=KEY_ISOLATED, max_retries=0
    ) as api:
        with pytest.raises(openai.BadRequestError) as caught:
            await api.chat.completions.create(model="sglang-text", messages=messages)
    assert "cannot keep tenants' prefix caches apart" in caught.value.message
    assert "kept-apart" not in caught.value.message
    async with openai.AsyncOpenAI(
        base_url=stack.url + "/v1", api_key=KEY_SHARED, max_retries=0
    ) as api:
        done = await api.chat.completions.create(model="sglang-text", messages=messages)
        assert done.choices[0].message.content == "ok"
        with pytest.raises(openai.BadRequestError) as own:
            await api.chat.completions.create(
                model="sglang-text", messages=messages, extra_body={"cache_salt": "mine"}
            )
    assert "'cache_salt'" in own.value.message and "'sglang-text'" in own.value.message
    assert len(worker.bodies) == 1 and "cache_salt" not in worker.bodies[0]
