"""Tenants' cache spaces: the tenant joins the cache salt, so the same prompt hashes apart
under two tenants (the KV router credits neither with the other's blocks), alike under one,
and a client's own salt partitions within its tenant's space without ever naming another's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from turnout.errors import RequestError
from turnout.llm.cache_salt import TENANT_SALT_PREFIX, tenant_cache_salt
from turnout.llm.chat_template import ChatTemplate
from turnout.llm.model_card import load_model_card
from turnout.llm.preprocessor import Preprocessor
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.block_hashing import compute_seq_hashes
from turnout.protocols.kv import SequenceHash
from turnout.protocols.llm import PreprocessedRequest
from turnout.protocols.model import EndpointId
from turnout.protocols.openai import ChatCompletionRequest, CompletionRequest
from turnout.router.kv.approx import ApproxIndexer
from turnout.router.kv.base import WorkerKey

BLOCK = 4
# Long enough for several full blocks.
PROMPT = "The quarterly price list for the northern warehouse: bolts 3.10, nuts 0.45, washers 0.12."


@pytest.fixture(scope="module")
def pre(gguf_path: Path, smol_tokenizer: Tokenizer) -> Preprocessor:
    ep = EndpointId(namespace="ns", component="c", name="generate")
    card = load_model_card(gguf_path, endpoint=ep, context_length=512, display_name="smol")
    assert card.chat_template is not None
    template = ChatTemplate(card.chat_template, card.bos_token, card.eos_token)
    return Preprocessor(card, smol_tokenizer, template)


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "smol", "messages": [{"role": "user", "content": PROMPT}], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


def completion(**fields: Any) -> CompletionRequest:
    return msgspec.convert({"model": "smol", "prompt": PROMPT, **fields}, CompletionRequest)


def hashes(req: PreprocessedRequest) -> list[SequenceHash]:
    return compute_seq_hashes(
        req.token_ids, BLOCK, lora_name=req.lora_name, cache_salt=req.cache_salt
    )


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_two_tenants_hash_apart_and_one_tenant_alike(pre: Preprocessor, kind: str) -> None:
    async def run(tenant: str | None, **fields: Any) -> PreprocessedRequest:
        if kind == "chat":
            return await pre.preprocess_chat(chat(**fields), tenant)
        return await pre.preprocess_completion(completion(**fields), tenant)

    alice, alice_again, bob, untenanted = (
        await run("alice"), await run("alice"), await run("bob"), await run(None)
    )  # fmt: skip
    assert alice.token_ids == bob.token_ids == untenanted.token_ids
    assert len(hashes(alice)) >= 4
    assert hashes(alice) == hashes(alice_again)
    assert not set(hashes(alice)) & set(hashes(bob))
    assert not set(hashes(alice)) & set(hashes(untenanted))
    assert untenanted.cache_salt is None
    # A client's own salt partitions within its tenant, and never reaches another tenant.
    alice_salted = await run("alice", cache_salt="s1")
    assert not set(hashes(alice_salted)) & set(hashes(alice))
    assert hashes(alice_salted) == hashes(await run("alice", nvext={"cache_salt": "s1"}))
    assert not set(hashes(alice_salted)) & set(hashes(await run("bob", cache_salt="s1")))
    assert (await run(None, cache_salt="s1")).cache_salt == "s1"


async def test_the_kv_router_credits_no_tenant_with_anothers_blocks(pre: Preprocessor) -> None:
    worker = WorkerKey(7)
    index = ApproxIndexer(ttl_s=60.0)
    alice = hashes(await pre.preprocess_chat(chat(), "alice"))
    index.record_routed(worker, alice, now=0.0)
    assert index.find_matches(alice).get(worker) == len(alice)
    assert index.find_matches(hashes(await pre.preprocess_chat(chat(), "alice"))).get(worker)
    assert index.find_matches(hashes(await pre.preprocess_chat(chat(), "bob"))).get(worker) == 0
    assert index.find_matches(hashes(await pre.preprocess_chat(chat(), None))).get(worker) == 0


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # The length prefix keeps a tenant's name apart from a client's salt.
        (("a:b", None), ("a", "b")),
        (("a", "b:c"), ("a:b", "c")),
        (("ab", None), ("a", "b")),
        (("", "x"), (None, "x")),
        (("t", None), (None, None)),
    ],
)
def test_no_two_spaces_share_a_salt(
    a: tuple[str | None, str | None], b: tuple[str | None, str | None]
) -> None:
    assert tenant_cache_salt(*a) != tenant_cache_salt(*b)


@pytest.mark.parametrize("field", ["cache_salt", "nvext"])
async def test_a_client_salt_cannot_name_a_tenants_space(pre: Preprocessor, field: str) -> None:
    """Else a client of the un-tenanted space could send a tenant's salt and be credited with,
    or time, that tenant's cached prefixes."""
    forged = tenant_cache_salt("alice", None)
    assert forged is not None and forged.startswith(TENANT_SALT_PREFIX)
    fields: dict[str, Any] = (
        {"cache_salt": forged} if field == "cache_salt" else {"nvext": {"cache_salt": forged}}
    )
    for tenant in (None, "bob"):
        with pytest.raises(RequestError, match="tenants' cache spaces") as caught:
            await pre.preprocess_chat(chat(**fields), tenant)
        assert caught.value.param == ("cache_salt" if field == "cache_salt" else "nvext.cache_salt")
