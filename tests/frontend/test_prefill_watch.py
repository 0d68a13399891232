"""Prefill instances' cards activate and deactivate their model's prefill router, as
Dynamo's watcher does: the first prefill instance activates it (whether the model's decode
side is served yet or not), the last one leaving deactivates it. Real store, real served
instances (their cards under their leases); pipelines come from a recording factory."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest

from turnout.frontend.models.accepted_instances import ModelClient
from turnout.frontend.models.manager import ModelManager
from turnout.frontend.models.watcher import ModelWatcher
from turnout.protocols.card_bounds import DEFAULT_MAX_ARTIFACT_BYTES
from turnout.protocols.model import (
    EndpointId,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
    WorkerRole,
    mdc_key,
)
from turnout.router.prefill_slots import PrefillPool, PrefillSlots
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery.memory import MemoryStore
from turnout.runtime.serving import ServingInstance

TIMEOUT = 2.0
DECODE = EndpointId(namespace="ns", component="backend", name="generate")
PREFILL = EndpointId(namespace="ns", component="prefill", name="generate")


class Factory:
    """Builds nothing real: records pools and pipelines."""

    max_artifact_bytes = DEFAULT_MAX_ARTIFACT_BYTES
    metrics = None

    def __init__(self) -> None:
        self.prefill_slots = PrefillSlots()
        self.pools: list[PrefillPool] = []
        self.closed: list[PrefillPool] = []
        self.built: list[str] = []

    async def build_prefill_pool(self, card: ModelDeploymentCard, client: Any) -> PrefillPool:
        factory = self

        class Pool(PrefillPool):
            async def close(self) -> None:
                factory.closed.append(self)

        pool = Pool(card.endpoint, client, _never, card.checksum())
        self.pools.append(pool)
        return pool

    async def build_chat(self, card: ModelDeploymentCard, client: Any) -> object:
        self.built.append(card.display_name)
        return object()

    async def build_completions(self, card: ModelDeploymentCard, client: Any) -> object:
        return object()

    async def build_text_chat(self, card: ModelDeploymentCard, client: Any) -> object:
        raise AssertionError("not built in these tests")

    async def build_text_completions(self, card: ModelDeploymentCard, client: Any) -> object:
        raise AssertionError("not built in these tests")

    async def build_embeddings(self, card: ModelDeploymentCard, client: Any) -> object:
        raise AssertionError("not built in these tests")

    async def build_tensor(self, card: ModelDeploymentCard, client: Any) -> object:
        raise AssertionError("not built in these tests")

    def serving(self, card: ModelDeploymentCard, client: ModelClient) -> None:
        pass

    async def release(self, card: ModelDeploymentCard, client: ModelClient) -> None:
        pass


async def _never(*_: Any) -> AsyncIterator[Any]:
    raise AssertionError("not routed in these tests")
    yield


async def _handler(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield payload


def card(name: str, ep: EndpointId, instance_id: int, *, prefill: bool) -> ModelDeploymentCard:
    return ModelDeploymentCard(
        display_name=name,
        endpoint=ep,
        instance_id=instance_id,
        model_type=ModelType.Prefill if prefill else ModelType.Chat | ModelType.Completions,
        model_input=ModelInput.Tokens,
        worker_role=WorkerRole.PREFILL if prefill else WorkerRole.DECODE,
    )


class Harness:
    def __init__(self, runtime: DistributedRuntime, watcher: ModelWatcher, factory: Factory):
        self.runtime = runtime
        self.watcher = watcher
        self.factory = factory
        self.manager = watcher.manager

    async def serve(self, name: str, ep: EndpointId, *, prefill: bool) -> ServingInstance:
        def records(instance_id: int) -> list[tuple[str, bytes]]:
            c = card(name, ep, instance_id, prefill=prefill)
            return [(mdc_key(ep, instance_id), msgspec.json.encode(c))]

        return await self.runtime.endpoint(ep).serve(_handler, records=records)

    def active(self, name: str) -> bool:
        return self.factory.prefill_slots.active(name) is not None


async def until(cond: Callable[[], bool]) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not cond():
            await asyncio.sleep(0.001)


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    store = MemoryStore()
    runtime = await DistributedRuntime.create(store=store, request_plane="local")
    factory = Factory()
    watcher = ModelWatcher(runtime, ModelManager(), factory)
    task = asyncio.create_task(watcher.watch())
    yield Harness(runtime, watcher, factory)
    task.cancel()
    await asyncio.wait([task])
    await watcher.close()
    await runtime.shutdown()
    await store.close()


async def test_first_prefill_instance_activates_last_one_deactivates(h: Harness) -> None:
    decode = await h.serve("m", DECODE, prefill=False)
    await until(lambda: "m" in h.manager.list_models())
    assert not h.active("m")

    p1 = await h.serve("m", PREFILL, prefill=True)
    await until(lambda: h.active("m"))
    pool = h.factory.prefill_slots.active("m")
    assert pool is not None and pool.endpoint == PREFILL
    await until(lambda: h.watcher.prefill.instances("m") == [p1.instance_id])  # type: ignore[union-attr]

    p2 = await h.serve("m", PREFILL, prefill=True)
    prefill = h.watcher.prefill
    assert prefill is not None
    await until(
        lambda: sorted(prefill.instances("m") or []) == sorted([p1.instance_id, p2.instance_id])
    )
    assert len(h.factory.pools) == 1  # one pool per model, shared by its instances

    await p1.stop()
    await until(lambda: h.watcher.prefill.instances("m") == [p2.instance_id])  # type: ignore[union-attr]
    assert h.active("m")
    await p2.stop()
    await until(lambda: not h.active("m"))
    assert h.factory.closed == h.factory.pools
    # The decode side was never touched: still served, its pipelines built once.
    assert h.manager.list_models() == ["m"] and h.factory.built == ["m"]
    await decode.stop()


async def test_prefill_before_the_model_is_served(h: Harness) -> None:
    p = await h.serve("m", PREFILL, prefill=True)
    await until(lambda: h.active("m"))
    # A prefill card is not a model: nothing is listed for it.
    assert h.manager.list_models() == [] and h.factory.built == []
    d = await h.serve("m", DECODE, prefill=False)
    await until(lambda: "m" in h.manager.list_models())
    assert h.active("m")
    await p.stop()
    await until(lambda: not h.active("m"))
    await d.stop()


async def test_prefill_instances_on_a_second_endpoint_are_refused(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    p = await h.serve("m", PREFILL, prefill=True)
    await until(lambda: h.active("m"))
    other = EndpointId(namespace="ns", component="prefill2", name="generate")
    with caplog.at_level(logging.ERROR, logger="turnout.frontend.models.prefill_watch"):
        q = await h.serve("m", other, prefill=True)
        await until(lambda: "prefill instance refused" in caplog.text)
    assert h.watcher.prefill.instances("m") == [p.instance_id]  # type: ignore[union-attr]
    await q.stop()
    await p.stop()
    await until(lambda: not h.active("m"))


async def test_models_keep_separate_slots(h: Harness) -> None:
    a = await h.serve("a", PREFILL, prefill=True)
    await until(lambda: h.active("a"))
    assert not h.active("b")
    await a.stop()
    await until(lambda: not h.active("a"))
