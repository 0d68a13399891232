"""Cache spaces by tenant at the frontend: the principal in a request's context picks the
space its tokens pipeline salts with, or the ``cache_salt`` a text pipeline relays;
``--shared-cache-tenants`` and a frontend without credentials use the un-tenanted space."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest

from turnout.errors import RequestError
from turnout.frontend.access.cache_space import CacheSpaces
from turnout.frontend.access.limits import PRINCIPAL_METADATA
from turnout.frontend.access.principal import ANONYMOUS, Principal
from turnout.frontend.models.pipeline import TextPipeline, TokensPipeline
from turnout.llm.cache_salt import tenant_cache_salt
from turnout.llm.chat_template import ChatTemplate
from turnout.llm.model_card import load_model_card
from turnout.llm.preprocessor import Preprocessor
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.model import EndpointId, ModelDeploymentCard, ModelInput, ModelType
from turnout.protocols.openai import ChatCompletionRequest
from turnout.runtime.context import RequestContext

SPACES = CacheSpaces(["team-x", "team-y"])


def ctx_of(principal: Principal | None) -> RequestContext:
    ctx = RequestContext()
    if principal is not None:
        ctx.metadata[PRINCIPAL_METADATA] = principal
    return ctx


def tenant(name: str) -> Principal:
    return Principal(tenant=name, key_id=f"{name}-key")


@pytest.mark.parametrize(
    ("principal", "space"),
    [
        (None, None),  # no credentials: nothing put a principal in the context
        (ANONYMOUS, None),
        (tenant("alice"), "alice"),
        # --api-key keys: the one tenant of a deployment without a keys file salts nothing
        (tenant("default"), None),
        (tenant("team-x"), None),
        (tenant("team-y"), None),
    ],
)
def test_tenant_of(principal: Principal | None, space: str | None) -> None:
    assert SPACES.tenant_of(ctx_of(principal)) == space


@pytest.fixture
def tokens_pipeline(gguf_path: str) -> TokensPipeline:
    ep = EndpointId(namespace="ns", component="c", name="generate")
    card = load_model_card(Path(gguf_path), endpoint=ep, context_length=256, display_name="m")
    assert card.chat_template is not None
    template = ChatTemplate(card.chat_template, card.bos_token, card.eos_token)
    preprocessor = Preprocessor(card, Tokenizer.from_gguf(Path(gguf_path)), template)
    unused = cast(Any, None)  # preprocess touches neither routing nor decoding
    return TokensPipeline(
        "m", card, preprocessor, unused, unused, unused, is_chat=True, cache_spaces=SPACES
    )


async def test_tokens_pipeline_salts_with_the_tenants_space(
    tokens_pipeline: TokensPipeline,
) -> None:
    request = msgspec.convert(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "mine"},
        ChatCompletionRequest,
    )

    async def salt(principal: Principal | None) -> str | None:
        return (await tokens_pipeline.preprocess(request, ctx_of(principal))).cache_salt

    assert await salt(tenant("alice")) == tenant_cache_salt("alice", "mine")
    assert await salt(tenant("bob")) == tenant_cache_salt("bob", "mine")
    assert await salt(tenant("team-x")) == await salt(tenant("team-y")) == "mine"
    assert await salt(None) == "mine"
    # Counting a prompt's tokens (no context) salts nothing of a tenant's.
    assert (await tokens_pipeline.preprocess(request, None)).cache_salt == "mine"


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


def text_pipeline() -> tuple[TextPipeline, RecordingRouter]:
    router = RecordingRouter()
    unused = cast(Any, None)
    ep = EndpointId(namespace="ns", component="c", name="generate")
    card = ModelDeploymentCard(
        display_name="m", endpoint=ep, instance_id=1, model_type=ModelType.Chat,
        model_input=ModelInput.Text,
    )  # fmt: skip
    pipeline = TextPipeline("m", card, cast(Any, router), unused, is_chat=True, cache_spaces=SPACES)
    return pipeline, router


@pytest.mark.parametrize(
    ("fields", "own"),
    [({}, None), ({"cache_salt": "mine"}, "mine"), ({"nvext": {"cache_salt": "ext"}}, "ext")],
)
def test_text_pipeline_relays_the_tenants_salt(fields: dict[str, Any], own: str | None) -> None:
    pipeline, router = text_pipeline()
    body = msgspec.json.encode({"model": "m", "messages": [], **fields})
    pipeline.generate(body, ctx_of(tenant("alice")))
    relayed = msgspec.json.decode(router.bodies[-1])
    assert relayed["cache_salt"] == tenant_cache_salt("alice", own)
    assert relayed["messages"] == []
    # The un-tenanted space relays the client's own salt only.
    for principal in (None, tenant("team-x")):
        pipeline.generate(body, ctx_of(principal))
        assert msgspec.json.decode(router.bodies[-1]).get("cache_salt") == own


@pytest.mark.parametrize(
    "fields",
    [
        {"cache_salt": tenant_cache_salt("bob", None)},
        {"nvext": {"cache_salt": tenant_cache_salt("bob", None)}},
        {"cache_salt": 5},
        {"cache_salt": ""},
        {"cache_salt": "x" * 257},
    ],
)
def test_text_pipeline_refuses_a_salt_that_could_name_another_space(
    fields: dict[str, Any],
) -> None:
    pipeline, router = text_pipeline()
    body = msgspec.json.encode({"model": "m", "messages": [], **fields})
    with pytest.raises(RequestError, match="cache_salt"):
        pipeline.generate(body, ctx_of(tenant("alice")))
    assert router.bodies == []


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]"])
def test_text_pipeline_leaves_a_body_that_is_no_object_to_the_relay(body: bytes) -> None:
    pipeline, router = text_pipeline()
    pipeline.generate(body, ctx_of(tenant("alice")))
    assert router.bodies == [body]
