"""LoRA-aware routing: the start-up validation (Dynamo's matrix), the registry fed by model
cards, holders-only selection, and rendezvous hashing when no instance holds the adapter."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from turnout.errors import ConfigError, NoInstanceAvailable
from turnout.protocols.llm import PreprocessedRequest, StopConditions
from turnout.protocols.model import (
    EndpointId,
    LoraInfo,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
    mdc_key,
)
from turnout.router.lora import LoraRegistry, LoraSelector, rendezvous_pick
from turnout.router.mode import RouterMode, validate_router_mode_for_lora
from turnout.router.selectors import RandomSelector, RoundRobinSelector

ENDPOINT = EndpointId(namespace="ns", component="backend", name="generate")
LORA_MODES = {RouterMode.KV, RouterMode.RANDOM, RouterMode.ROUND_ROBIN}


# -- start-up validation: every mode x LoRA on/off x session affinity on/off ------------------


@pytest.mark.parametrize("affinity", [False, True])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("mode", list(RouterMode))
def test_validate_router_mode_for_lora(mode: RouterMode, lora: bool, affinity: bool) -> None:
    def check() -> None:
        validate_router_mode_for_lora(mode, lora_enabled=lora, session_affinity_enabled=affinity)

    if not lora:
        check()  # LoRA off: every mode, with or without affinity, is the unmodified path
    elif mode not in LORA_MODES:
        with pytest.raises(ConfigError, match="not supported with router mode"):
            check()
    elif affinity and mode in (RouterMode.RANDOM, RouterMode.ROUND_ROBIN):
        with pytest.raises(ConfigError, match="session affinity"):
            check()
    else:
        check()  # kv (with or without affinity), random and round-robin without


# -- the registry -------------------------------------------------------------------------------


def base_card(instance_id: int, adapters: list[str], model: str = "base") -> ModelDeploymentCard:
    return ModelDeploymentCard(
        display_name=model,
        endpoint=ENDPOINT,
        instance_id=instance_id,
        model_type=ModelType.Chat,
        model_input=ModelInput.Tokens,
        lora_adapters=adapters,
    )


def adapter_card(instance_id: int, name: str) -> ModelDeploymentCard:
    card = base_card(instance_id, [])
    card.display_name = name
    card.lora = LoraInfo(name=name)
    return card


def registry_of(instances: list[int], adapters: list[str]) -> LoraRegistry:
    registry = LoraRegistry()
    for i in instances:
        assert not registry.on_card(mdc_key(ENDPOINT, i), base_card(i, adapters))
    return registry


def load(registry: LoraRegistry, instance_id: int, name: str) -> str:
    key = mdc_key(ENDPOINT, instance_id, name)
    assert registry.on_card(key, adapter_card(instance_id, name))
    return key


def test_holders_come_and_go_with_adapter_cards() -> None:
    registry = registry_of([1, 2, 3], ["a", "b"])
    assert registry.base_model("a") == "base" and registry.base_model("zzz") is None
    assert registry.loaded_adapters() == []
    key = load(registry, 2, "a")
    assert registry.holders("a") == {2}
    assert registry.loaded_adapters() == [("a", "base")]
    assert registry.allowed("a", [1, 2, 3]) == [2]
    assert registry.on_delete(key)
    assert registry.holders("a") == set()
    # A base card's DELETE is not an adapter's: the watcher handles it too.
    assert not registry.on_delete(mdc_key(ENDPOINT, 3))
    assert registry.allowed("a", [3]) == []  # 3 no longer says it can load a


def test_a_holder_that_is_not_a_candidate_falls_back_to_rendezvous() -> None:
    registry = registry_of([1, 2, 3], ["a"])
    load(registry, 9, "a")  # a holder outside the candidates (set aside, or another model)
    assert registry.allowed("a", [1, 2, 3]) == [rendezvous_pick("a", [1, 2, 3])]


def test_rendezvous_is_stable_and_spreads_adapters() -> None:
    instances = [0x1000 + 17 * i for i in range(8)]
    adapters = [f"adapter-{n}" for n in range(64)]
    registry = registry_of(instances, adapters)
    picks = {a: registry.allowed(a, instances) for a in adapters}
    assert all(len(p) == 1 for p in picks.values())
    for _ in range(3):  # the same instance every time, whatever the candidates' order
        assert {a: registry.allowed(a, instances[::-1]) for a in adapters} == picks
    spread = Counter(p[0] for p in picks.values())
    assert len(spread) >= 6, spread  # 64 adapters over 8 instances
    # An instance leaving moves only the adapters it won.
    gone = instances[0]
    rest = instances[1:]
    for a in adapters:
        if picks[a][0] != gone:
            assert registry.allowed(a, rest) == picks[a]


def request(lora: str | None) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m", token_ids=[1, 2, 3], stop_conditions=StopConditions(), lora_name=lora
    )


@pytest.mark.parametrize("make", [RoundRobinSelector, lambda: RandomSelector(seed=7)])
def test_adapter_requests_go_only_to_holders(make: object) -> None:
    registry = registry_of([1, 2, 3, 4], ["a"])
    load(registry, 2, "a")
    load(registry, 4, "a")
    selector = LoraSelector(make(), registry)  # type: ignore[operator]
    chosen = Counter(selector.select([1, 2, 3, 4], request("a")) for _ in range(400))
    assert set(chosen) == {2, 4}
    assert min(chosen.values()) > 100  # spread among the holders
    # Base-model requests still use every instance.
    base = {selector.select([1, 2, 3, 4], request(None)) for _ in range(400)}
    assert base == {1, 2, 3, 4}


def test_no_instance_can_load_the_adapter() -> None:
    selector = LoraSelector(RoundRobinSelector(), registry_of([1, 2], ["a"]))
    with pytest.raises(NoInstanceAvailable, match="'b'"):
        selector.select([1, 2], request("b"))


def test_kv_routing_is_restricted_to_allowed() -> None:
    """The KV router's candidates are only the allowed workers (every rank of each)."""
    from turnout.router.kv.config import KvRouterConfig
    from turnout.router.kv.router import KvRouter
    from turnout.runtime.event_plane.local import LocalEventPlane

    class Client:
        def instance_ids(self) -> list[int]:
            return [1, 2, 3]

    router = KvRouter(
        KvRouterConfig(block_size=4),
        Client(),  # type: ignore[arg-type]
        LocalEventPlane(),
        ENDPOINT,
        dp_size=2,
        share_active=False,
    )
    keys = router.candidates(excluded=[3], allowed={2, 3})
    assert [(k.worker_id, k.dp_rank) for k in keys] == list(itertools.product([2], [0, 1]))
    for n in range(20):
        selection = router.route(f"r{n}", list(range(16)), lora_name="a", allowed={3})
        assert selection.worker_id == 3
