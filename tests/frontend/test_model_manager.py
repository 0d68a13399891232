"""ModelManager: engine registries, per-instance entries, clients and their instances."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest

from turnout.errors import ModelNotFound
from turnout.frontend.models.manager import ModelAlreadyExists, ModelKind, ModelManager
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


@pytest.mark.parametrize("kind", list(ModelKind))
def test_registry_add_get_list_remove(kind: ModelKind) -> None:
    m = ModelManager()
    m.add_engine(kind, "b", "engine-b")
    m.add_engine(kind, "a", "engine-a")
    assert m.list_models_of(kind) == ["a", "b"]
    assert m.get_engine(kind, "a") == "engine-a"
    assert m.has_model_any("a")
    with pytest.raises(ModelAlreadyExists, match="'a'"):
        m.add_engine(kind, "a", "again")
    m.remove_engine(kind, "a")
    assert m.list_models_of(kind) == ["b"]
    assert not m.has_model_any("a")
    with pytest.raises(ModelNotFound, match="'a'"):
        m.remove_engine(kind, "a")
    with pytest.raises(ModelNotFound, match="'a' does not exist"):
        m.get_engine(kind, "a")
    # Other kinds' registries are untouched.
    for other in ModelKind:
        if other is not kind:
            assert m.list_models_of(other) == []


def test_get_names_the_kinds_a_model_does_serve() -> None:
    m = ModelManager()
    m.add_engine(ModelKind.COMPLETIONS, "llama", object())
    with pytest.raises(ModelNotFound, match="'llama' does not serve chat completions; it serves"):
        m.get_engine(ModelKind.CHAT, "llama")


def test_a_falsy_engine_is_still_an_engine() -> None:
    m = ModelManager()
    m.add_engine(ModelKind.TENSOR, "zero", 0)
    assert m.get_engine(ModelKind.TENSOR, "zero") == 0


def test_list_models_is_the_sorted_union() -> None:
    m = ModelManager()
    m.add_engine(ModelKind.CHAT, "c", 1)
    m.add_engine(ModelKind.COMPLETIONS, "c", 2)
    m.add_engine(ModelKind.EMBEDDINGS, "a", 3)
    m.add_engine(ModelKind.TENSOR, "b", 4)
    assert m.list_models() == ["a", "b", "c"]


def test_created_is_when_the_name_became_served_by_any_kind() -> None:
    now = [1000.0]
    manager = ModelManager(clock=lambda: now[0])
    assert manager.created("m") == 0
    manager.add_engine(ModelKind.COMPLETIONS, "m", object())
    now[0] = 2000.0
    manager.add_engine(ModelKind.CHAT, "m", object())
    assert manager.created("m") == 1000
    manager.remove_engine(ModelKind.COMPLETIONS, "m")
    assert manager.created("m") == 2000
    manager.remove_engine(ModelKind.CHAT, "m")
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
