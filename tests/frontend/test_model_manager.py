"""ModelManager: engine registries, per-instance entries, clients and their instances."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest

from turnout.errors import ModelNotFound
from turnout.frontend.models.manager import ModelAlreadyExists, ModelManager
from turnout.protocols.model import (
    EndpointId,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
    mdc_key,
)
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery.memory import MemoryStore

EP = EndpointId(namespace="ns", component="backend", name="generate")


def card(name: str, instance_id: int = 1) -> ModelDeploymentCard:
    return ModelDeploymentCard(
        display_name=name,
        endpoint=EP,
        instance_id=instance_id,
        model_type=ModelType.Chat,
        model_input=ModelInput.Tokens,
    )


KINDS = ["chat", "completions", "embeddings", "tensor"]


def ops(m: ModelManager, kind: str) -> tuple[Callable[..., Any], ...]:
    """add, remove, list, get for one kind of request."""
    return (
        getattr(m, f"add_{kind}_model"),
        getattr(m, f"remove_{kind}_model"),
        getattr(m, f"list_{kind}_models"),
        getattr(m, f"get_{kind}_engine"),
    )


@pytest.mark.parametrize("kind", KINDS)
def test_registry_add_get_list_remove(kind: str) -> None:
    m = ModelManager()
    add, remove, list_, get = ops(m, kind)
    add("b", "engine-b")
    add("a", "engine-a")
    assert list_() == ["a", "b"]
    assert get("a") == "engine-a"
    assert m.has_model_any("a")
    with pytest.raises(ModelAlreadyExists, match="'a'"):
        add("a", "again")
    remove("a")
    assert list_() == ["b"]
    assert not m.has_model_any("a")
    with pytest.raises(ModelNotFound, match="'a'"):
        remove("a")
    with pytest.raises(ModelNotFound, match="'a' does not exist"):
        get("a")
    # Other kinds' registries are untouched.
    for other in KINDS:
        if other != kind:
            assert ops(m, other)[2]() == []


def test_seed_name_for_the_chat_engine() -> None:
    m = ModelManager()
    m.add_chat_model("llama", "engine")
    assert m.get_chat_completions_engine("llama") == "engine"
    with pytest.raises(ModelNotFound):
        m.get_chat_completions_engine("qwen")


def test_get_names_the_kinds_a_model_does_serve() -> None:
    m = ModelManager()
    m.add_completions_model("llama", object())
    with pytest.raises(ModelNotFound, match="'llama' does not serve chat completions; it serves"):
        m.get_chat_engine("llama")


def test_a_falsy_engine_is_still_an_engine() -> None:
    m = ModelManager()
    m.add_tensor_model("zero", 0)
    assert m.get_tensor_engine("zero") == 0


def test_list_models_is_the_sorted_union() -> None:
    m = ModelManager()
    m.add_chat_model("c", 1)
    m.add_completions_model("c", 2)
    m.add_embeddings_model("a", 3)
    m.add_tensor_model("b", 4)
    assert m.list_models() == ["a", "b", "c"]


def test_created_is_when_the_name_became_served_by_any_kind() -> None:
    now = [1000.0]
    manager = ModelManager(clock=lambda: now[0])
    assert manager.created("m") == 0
    manager.add_completions_model("m", object())
    now[0] = 2000.0
    manager.add_chat_model("m", object())
    assert manager.created("m") == 1000
    manager.remove_completions_model("m")
    assert manager.created("m") == 2000
    manager.remove_chat_model("m")
    assert manager.created("m") == 0


def test_entries_by_key_and_by_model() -> None:
    m = ModelManager()
    m.save_model_entry("k1", card("llama", 1))
    m.save_model_entry("k2", card("llama", 2))
    m.save_model_entry("k3", card("qwen", 3))
    assert [c.instance_id for c in m.entries_for_model("llama")] == [1, 2]
    assert set(m.model_cards("llama")) == {"k1", "k2"}
    assert m.entries_for_model("nobody") == []

    removed = m.remove_model_entry("k1")
    assert removed is not None and removed.instance_id == 1
    assert m.remove_model_entry("k1") is None
    assert [c.instance_id for c in m.entries_for_model("llama")] == [2]
    # Entries are not engines: listing served models only looks at the registries.
    assert m.list_models() == []


def test_resaving_a_key_under_another_name_moves_it() -> None:
    m = ModelManager()
    m.save_model_entry("k", card("old"))
    m.save_model_entry("k", card("new"))
    assert m.entries_for_model("old") == []
    assert [c.display_name for c in m.entries_for_model("new")] == ["new"]


def test_model_cards_is_a_copy() -> None:
    m = ModelManager()
    m.save_model_entry("k", card("llama"))
    cards = m.model_cards("llama")
    assert isinstance(cards, dict)
    cards.clear()
    assert list(m.model_cards("llama")) == ["k"]


async def _echo(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield payload


async def test_model_instances_follow_the_client() -> None:
    store = MemoryStore()
    runtime = await DistributedRuntime.create(store=store, request_plane="local")
    try:
        m = ModelManager()
        assert m.model_instances("llama") == []
        a = await runtime.endpoint(EP).serve(
            _echo, records=lambda iid: [(mdc_key(EP, iid), msgspec.json.encode(card("llama")))]
        )
        client = await runtime.endpoint(EP).client()
        m.add_model_client("llama", client)
        assert m.model_instances("llama") == [a.instance_id]

        b = await runtime.endpoint(EP).serve(_echo)
        await client.wait_for_instances(2, timeout=2)
        assert m.model_instances("llama") == sorted([a.instance_id, b.instance_id])

        other = await runtime.endpoint(EP).client()
        m.add_model_client("qwen", other)
        assert m.take_model_clients("llama") == [client]
        assert m.model_instances("llama") == []
        assert m.take_model_clients("llama") == []
        assert m.take_all_clients() == [other]
        assert m.take_all_clients() == []
        await client.close()
        await other.close()

        # close() closes what is left and forgets it.
        last = await runtime.endpoint(EP).client()
        m.add_model_client("llama", last)
        await m.close()
        assert m.model_instances("llama") == []
        assert last not in runtime._endpoint_clients
    finally:
        await runtime.shutdown()
        await store.close()
