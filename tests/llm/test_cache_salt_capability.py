"""The card's ``cache_salt`` capability: a salted request (the client's own salt, or its
tenant's space) to a model whose engine cannot partition its prefix cache is refused by the
preprocessor, before routing, with a message that says whose salt it is; cards written
before the capability existed decode as partitioning (the worker's refusal stays the
backstop); and each engine declares what it does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from turnout.engines.attach.llamacpp_api import LlamaCppApi
from turnout.engines.attach.sglang_api import SglangApi
from turnout.engines.attach.vllm_api import VllmApi
from turnout.engines.mocker.config import MockerConfig
from turnout.engines.mocker.engine import MockerEngine
from turnout.errors import RequestError
from turnout.llm.chat_template import ChatTemplate
from turnout.llm.model_card import load_model_card
from turnout.llm.preprocessor import Preprocessor
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.llm import PreprocessedRequest
from turnout.protocols.model import EndpointId, ModelCapabilities, ModelDeploymentCard
from turnout.protocols.openai import ChatCompletionRequest, CompletionRequest

MODEL = "unpartitioned-model"


@pytest.fixture(scope="module")
def card(gguf_path: Path) -> ModelDeploymentCard:
    ep = EndpointId(namespace="ns", component="c", name="generate")
    return load_model_card(gguf_path, endpoint=ep, context_length=512, display_name=MODEL)


def preprocessor(card: ModelDeploymentCard, tokenizer: Tokenizer, partitions: bool) -> Preprocessor:
    caps = ModelCapabilities(cache_salt=partitions)
    card = msgspec.structs.replace(card, capabilities=caps)
    assert card.chat_template is not None
    template = ChatTemplate(card.chat_template, card.bos_token, card.eos_token)
    return Preprocessor(card, tokenizer, template)


@pytest.fixture(scope="module")
def unpartitioned(card: ModelDeploymentCard, smol_tokenizer: Tokenizer) -> Preprocessor:
    return preprocessor(card, smol_tokenizer, partitions=False)


async def run(
    pre: Preprocessor, kind: str, tenant: str | None, **fields: Any
) -> PreprocessedRequest:
    if kind == "chat":
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
        return await pre.preprocess_chat(msgspec.convert(body, ChatCompletionRequest), tenant)
    body = {"model": MODEL, "prompt": "hi", **fields}
    return await pre.preprocess_completion(msgspec.convert(body, CompletionRequest), tenant)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"cache_salt": "s1"}, "cache_salt"),
        ({"nvext": {"cache_salt": "s1"}}, "nvext.cache_salt"),
    ],
)
@pytest.mark.parametrize("tenant", [None, "alice"])
async def test_a_clients_salt_is_refused_naming_the_field_and_the_model(
    unpartitioned: Preprocessor, kind: str, fields: dict[str, Any], param: str, tenant: str | None
) -> None:
    with pytest.raises(RequestError) as caught:
        await run(unpartitioned, kind, tenant, **fields)
    assert caught.value.param == param
    message = str(caught.value)
    assert f"'{param}'" in message and f"'{MODEL}'" in message
    assert "partition" in message


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_a_tenants_space_is_refused_with_the_operators_remedy(
    unpartitioned: Preprocessor, kind: str
) -> None:
    tenant = "tenant-with-a-distinctive-name"
    with pytest.raises(RequestError) as caught:
        await run(unpartitioned, kind, tenant)
    assert caught.value.param == "model"
    message = str(caught.value)
    assert f"'{MODEL}'" in message
    assert "cannot keep tenants' prefix caches apart" in message
    assert "--shared-cache-tenants" in message
    # The client never sent a salt: the message does not blame a field it did not send, and
    # names no tenant (tenants' names are the operator's).
    assert "cache_salt" not in message and tenant not in message


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_unsalted_requests_run_and_partitioning_models_take_every_salt(
    card: ModelDeploymentCard, smol_tokenizer: Tokenizer, unpartitioned: Preprocessor, kind: str
) -> None:
    # The un-tenanted space (no tenant, or a shared one) with no salt of the client's.
    assert (await run(unpartitioned, kind, None)).cache_salt is None
    partitioned = preprocessor(card, smol_tokenizer, partitions=True)
    assert (await run(partitioned, kind, None, cache_salt="s1")).cache_salt == "s1"
    salted = await run(partitioned, kind, "alice", cache_salt="s1")
    assert salted.cache_salt is not None and salted.cache_salt.endswith(":s1")
    assert (await run(partitioned, kind, "alice")).cache_salt is not None


def test_a_card_without_the_capability_decodes_as_partitioning(
    card: ModelDeploymentCard,
) -> None:
    """A card written before the field existed (a worker of an older version, mid-upgrade)
    decodes as partitioning: its salted requests reach the worker, which refuses them itself
    if its engine cannot partition (as older workers always did). A partitioning engine's
    card writes no field, so its checksum is an older card's."""
    caps = ModelCapabilities(logprobs=True, max_top_logprobs=20, min_tokens=True)
    new = msgspec.structs.replace(card, capabilities=caps)
    doc = msgspec.json.decode(msgspec.json.encode(new))
    assert "cache_salt" not in doc["capabilities"]
    old = msgspec.json.decode(msgspec.json.encode(doc), type=ModelDeploymentCard)
    assert old.capabilities.cache_salt is True
    assert old.checksum() == new.checksum()
    # An engine that cannot partition says so on the wire, and that is another card.
    refusing = msgspec.structs.replace(
        card, capabilities=msgspec.structs.replace(caps, cache_salt=False)
    )
    doc = msgspec.json.decode(msgspec.json.encode(refusing))
    assert doc["capabilities"]["cache_salt"] is False
    decoded = msgspec.json.decode(msgspec.json.encode(doc), type=ModelDeploymentCard)
    assert decoded.capabilities.cache_salt is False
    assert decoded.checksum() != new.checksum()
    # The msgpack form (the discovery store's) alike.
    packed = msgspec.msgpack.decode(msgspec.msgpack.encode(refusing), type=ModelDeploymentCard)
    assert packed.capabilities.cache_salt is False


def test_engines_declare_whether_they_partition(gguf_path: Path) -> None:
    url = "http://127.0.0.1:1"
    assert VllmApi(url).capabilities().cache_salt is True
    assert SglangApi(url).capabilities().cache_salt is False
    assert LlamaCppApi(url).capabilities().cache_salt is False
    mocker = MockerEngine(MockerConfig(), model_path=gguf_path)
    assert mocker.model_card_template().capabilities.cache_salt is True
