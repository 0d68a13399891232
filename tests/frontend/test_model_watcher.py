"""ModelWatcher against a real MemoryStore and DistributedRuntime (local request plane).

Workers are real served instances (``endpoint.serve`` with their card as a leased record) or,
for malformed entries, raw puts into the store. Pipelines come from a recording factory.
The watcher handles each model's events in store order, different models' concurrently:
``Harness.barrier`` waits for a fresh model to be served (every earlier event has been read),
then for the watcher to settle (every event read has been handled).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from tests.frontend.fake_clock import FakeClock

from turnout.errors import DiscoveryError, ModelNotFound, NoInstanceAvailable
from turnout.frontend.metrics.frontend import FrontendMetrics
from turnout.frontend.models import watcher as model_watcher
from turnout.frontend.models.accepted_instances import AcceptedInstances, ModelClient
from turnout.frontend.models.manager import ModelKind, ModelManager
from turnout.frontend.models.model_updates import ModelAdded, ModelRemoved, ModelUpdate
from turnout.frontend.models.pairs import SUPPORTED_PAIRS
from turnout.frontend.models.watcher import ModelWatcher
from turnout.protocols.card_bounds import DEFAULT_MAX_ARTIFACT_BYTES
from turnout.protocols.frontend import HoldReason, is_global_namespace
from turnout.protocols.model import (
    EndpointId,
    Instance,
    LoraInfo,
    ModelDeploymentCard,
    ModelInput,
    ModelType,
    TransportAddress,
    instance_key,
    mdc_key,
)
from turnout.router.prefill_slots import PrefillPool, PrefillSlots
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery.base import KeyValue, WatchEvent, WatchEventKind
from turnout.runtime.discovery.memory import MemoryStore
from turnout.runtime.serving import ServingInstance

LOGGER = "turnout.frontend.models.watcher"
CHAT_COMPL = ModelType.Chat | ModelType.Completions
TIMEOUT = 2.0
BARRIER = "barrier-"


@dataclass(frozen=True)
class FakeEngine:
    kind: str
    model: str


class RecordingFactory:
    """A PipelineFactory that records its calls and returns a FakeEngine per call."""

    max_artifact_bytes = DEFAULT_MAX_ARTIFACT_BYTES
    prefill_slots: PrefillSlots | None = None

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, AcceptedInstances]] = []
        #: The cards ``serving`` named, and those released, in order.
        self.serving_cards: list[ModelDeploymentCard] = []
        self.released: list[ModelDeploymentCard] = []
        #: What ``release`` raises, once it has recorded the card (None: nothing).
        self.release_error: Exception | None = None
        #: The routing view each card's pipelines were last built with, by checksum.
        self.views: dict[str, AcceptedInstances] = {}
        #: (kind, model) pairs whose build raises.
        self.fail: set[tuple[str, str]] = set()
        #: When set, completions builds wait for it (to catch the watcher mid-build).
        self.gate: asyncio.Event | None = None
        #: Model name -> an event every build of that model waits for (a stalled fetch).
        self.stalled: dict[str, asyncio.Event] = {}
        #: Where the watcher counts card switches.
        self.metrics: FrontendMetrics | None = None

    async def _build(self, kind: str, card: ModelDeploymentCard, client: ModelClient) -> FakeEngine:
        assert isinstance(client, AcceptedInstances)
        self.calls.append((kind, card.display_name, client))
        self.views[card.checksum()] = client
        if self.gate is not None and kind == "completions":
            await self.gate.wait()
        stall = self.stalled.get(card.display_name)
        if stall is not None:
            await stall.wait()
        if (kind, card.display_name) in self.fail:
            raise RuntimeError(f"cannot build {kind} for {card.display_name}")
        return FakeEngine(kind, card.display_name)

    async def build_chat(self, card: ModelDeploymentCard, client: ModelClient) -> FakeEngine:
        return await self._build("chat", card, client)

    async def build_completions(self, card: ModelDeploymentCard, client: ModelClient) -> FakeEngine:
        return await self._build("completions", card, client)

    async def build_text_chat(self, card: ModelDeploymentCard, client: ModelClient) -> FakeEngine:
        return await self._build("text_chat", card, client)

    async def build_text_completions(
        self, card: ModelDeploymentCard, client: ModelClient
    ) -> FakeEngine:
        return await self._build("text_completions", card, client)

    async def build_embeddings(self, card: ModelDeploymentCard, client: ModelClient) -> FakeEngine:
        return await self._build("embeddings", card, client)

    async def build_tensor(self, card: ModelDeploymentCard, client: ModelClient) -> FakeEngine:
        return await self._build("tensor", card, client)

    async def build_prefill_pool(
        self, card: ModelDeploymentCard, client: ModelClient
    ) -> PrefillPool:
        raise AssertionError("prefill cards are not taken here")

    def serving(self, card: ModelDeploymentCard, client: ModelClient) -> None:
        self.serving_cards.append(card)

    async def release(self, card: ModelDeploymentCard, client: ModelClient) -> None:
        self.released.append(card)
        if self.release_error is not None:
            raise self.release_error

    def kinds(self) -> list[tuple[str, str]]:
        return [(kind, model) for kind, model, _ in self.calls]


def endpoint(namespace: str = "ns", component: str = "backend") -> EndpointId:
    return EndpointId(namespace=namespace, component=component, name="generate")


def make_card(
    name: str,
    *,
    ep: EndpointId | None = None,
    instance_id: int = 1,
    model_type: ModelType = CHAT_COMPL,
    model_input: ModelInput = ModelInput.Tokens,
    context_length: int = 4096,
    lora: str | None = None,
) -> ModelDeploymentCard:
    return ModelDeploymentCard(
        display_name=name,
        endpoint=ep or endpoint(),
        instance_id=instance_id,
        model_type=model_type,
        model_input=model_input,
        context_length=context_length,
        lora=LoraInfo(name=lora) if lora else None,
    )


async def _handler(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield payload


@dataclass
class Harness:
    store: MemoryStore
    runtime: DistributedRuntime
    manager: ModelManager
    factory: RecordingFactory
    updates: asyncio.Queue[ModelUpdate]
    watcher: ModelWatcher
    task: asyncio.Task[None]
    num_barriers: int = 0

    async def serve(self, name: str, **card_args: object) -> ServingInstance:
        """A real worker instance publishing ``name``'s card under its lease."""
        ep = card_args.pop("ep", None) or endpoint()
        assert isinstance(ep, EndpointId)

        def records(instance_id: int) -> list[tuple[str, bytes]]:
            card = make_card(name, ep=ep, instance_id=instance_id, **card_args)  # type: ignore[arg-type]
            return [(mdc_key(ep, instance_id), msgspec.json.encode(card))]

        return await self.runtime.endpoint(ep).serve(_handler, records=records)

    async def put_card(
        self, card: ModelDeploymentCard, *, lora: str | None = None, lease_id: int | None = None
    ) -> str:
        key = mdc_key(card.endpoint, card.instance_id, lora)
        await self.store.put(key, msgspec.json.encode(card), lease_id=lease_id)
        return key

    async def next_update(self) -> ModelUpdate:
        return await asyncio.wait_for(self.updates.get(), TIMEOUT)

    async def barrier(self, namespace: str = "ns") -> list[ModelUpdate]:
        """Put a card of a fresh chat model, wait until the watcher serves it (every event
        before it has been read), then until every event read has been handled (models'
        events are handled concurrently). Returns the updates queued, the barrier's own
        left out."""
        self.num_barriers += 1
        name = f"{BARRIER}{self.num_barriers}"
        card = make_card(
            name,
            ep=endpoint(namespace, "barrier"),
            instance_id=self.num_barriers,  # a key of its own: barriers stay served
            model_type=ModelType.Chat,
        )
        await self.put_card(card)
        await until(lambda: self.manager.has_model_any(name))
        await asyncio.wait_for(self.watcher.settled(), TIMEOUT)
        drained = [self.updates.get_nowait() for _ in range(self.updates.qsize())]
        drained.remove(ModelUpdate.Added(ModelType.Chat))  # the barrier's (all are alike)
        return drained

    def served(self) -> set[str]:
        """Served models, barriers left out."""
        return {n for n in self.manager.list_models() if not n.startswith(BARRIER)}

    def built(self) -> list[tuple[str, str]]:
        """The factory's calls, barriers left out."""
        return [(k, m) for k, m in self.factory.kinds() if not m.startswith(BARRIER)]


async def until(cond: Callable[[], bool], within: float = TIMEOUT) -> None:
    """Poll ``cond`` (state of the code under test, which has no event to wait on)."""
    async with asyncio.timeout(within):
        while not cond():
            await asyncio.sleep(0.001)


HarnessFactory = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def make_harness() -> AsyncIterator[HarnessFactory]:
    made: list[Harness] = []

    async def make(
        namespace: str | None = None, store: MemoryStore | None = None, **watcher_args: Any
    ) -> Harness:
        store = store or MemoryStore()
        runtime = await DistributedRuntime.create(store=store, request_plane="local")
        manager = ModelManager()
        factory = RecordingFactory()
        updates: asyncio.Queue[ModelUpdate] = asyncio.Queue()
        watcher = ModelWatcher(
            runtime, manager, factory, namespace=namespace, updates=updates, **watcher_args
        )
        task = asyncio.create_task(watcher.watch(), name="model-watcher")
        h = Harness(store, runtime, manager, factory, updates, watcher, task)
        made.append(h)
        # The watch subscribes on its first step and starts with a snapshot in key order;
        # wait until it is live so that the tests' events arrive in the order they are made,
        # then leave the harness empty again.
        probe = make_card("probe", ep=endpoint(namespace or "ns", "probe"))
        probe_key = await h.put_card(probe)
        assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
        await h.store.delete(probe_key)
        assert await h.next_update() == ModelUpdate.Removed(ModelType.Chat)
        assert await h.next_update() == ModelUpdate.Removed(ModelType.Completions)
        factory.calls.clear()
        factory.released.clear()
        factory.serving_cards.clear()
        return h

    yield make
    for h in made:
        h.task.cancel()
        await asyncio.wait([h.task])
        await h.watcher.close()
        await h.runtime.shutdown()
        await h.store.close()


@pytest.fixture
async def h(make_harness: HarnessFactory) -> Harness:
    return await make_harness()


# -- adding -----------------------------------------------------------------------------------


async def test_card_put_builds_chat_and_completions(h: Harness) -> None:
    inst = await h.serve("llama")

    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    m = h.manager
    assert m.get_engine(ModelKind.CHAT, "llama") == FakeEngine("chat", "llama")
    assert m.get_engine(ModelKind.COMPLETIONS, "llama") == FakeEngine("completions", "llama")
    assert m.list_models() == ["llama"]
    assert [c.instance_id for c in m.entries_for_model("llama")] == [inst.instance_id]
    assert m.model_instances("llama") == [inst.instance_id]
    # One client per model, for the card's endpoint, shared by both pipelines.
    assert h.factory.kinds() == [("chat", "llama"), ("completions", "llama")]
    (_, _, c1), (_, _, c2) = h.factory.calls
    assert c1 is c2
    assert c1.endpoint == endpoint()
    assert await asyncio.wait_for(h.watcher.wait_for_chat_model(), TIMEOUT) == "llama"


EMB = ModelType.Embedding
TENSOR = ModelType.TensorBased


@pytest.mark.parametrize(
    ("model_input", "model_type", "kinds"),
    [
        (ModelInput.Tokens, ModelType.Chat, ["chat"]),
        (ModelInput.Tokens, ModelType.Completions, ["completions"]),
        (ModelInput.Tokens, CHAT_COMPL, ["chat", "completions"]),
        (ModelInput.Tokens, EMB, ["embeddings"]),
        # A model offering several types is served on each.
        (ModelInput.Tokens, CHAT_COMPL | EMB, ["chat", "completions", "embeddings"]),
        (ModelInput.Text, ModelType.Chat, ["text_chat"]),
        (ModelInput.Text, ModelType.Completions, ["text_completions"]),
        # Dynamo serves only chat here; turnout serves both routes the card names.
        (ModelInput.Text, CHAT_COMPL, ["text_chat", "text_completions"]),
        (ModelInput.Tensor, TENSOR, ["tensor"]),
    ],
)
async def test_pipeline_choice_by_input_and_type(
    h: Harness, model_input: ModelInput, model_type: ModelType, kinds: list[str]
) -> None:
    await h.put_card(make_card("m", model_input=model_input, model_type=model_type))
    assert await h.next_update() == ModelUpdate.Added(model_type)
    assert h.factory.kinds() == [(k, "m") for k in kinds]
    served = {kind.value for kind in h.manager.kinds("m")}
    assert served == {k.removeprefix("text_") for k in kinds}
    for kind in ModelKind:
        assert h.manager.list_models_of(kind) == (["m"] if kind.value in served else [])


async def test_second_instance_joins_without_rebuilding(h: Harness) -> None:
    a = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    b = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)

    assert h.factory.kinds() == [("chat", "llama"), ("completions", "llama")]
    entries = h.manager.entries_for_model("llama")
    assert sorted(c.instance_id for c in entries) == sorted([a.instance_id, b.instance_id])
    # The one client sees both instances.
    await until(lambda: len(h.manager.model_instances("llama")) == 2)
    assert h.manager.model_instances("llama") == sorted([a.instance_id, b.instance_id])


async def test_lora_entry_is_an_entry_of_the_same_model(h: Harness) -> None:
    base = make_card("llama", instance_id=7)
    base_key = await h.put_card(base)
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    lora_key = await h.put_card(make_card("llama", instance_id=7, lora="sql"), lora="sql")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)

    assert lora_key == base_key + "/sql"
    assert set(h.manager.model_cards("llama")) == {base_key, lora_key}
    assert h.built() == [("chat", "llama"), ("completions", "llama")]
    await h.store.delete(base_key)
    assert await h.barrier() == []
    assert h.manager.has_model_any("llama")
    assert list(h.manager.model_cards("llama")) == [lora_key]


# -- refusing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        b"{not json",
        b"\xff\xfe binary",
        b'{"display_name": "half"}',  # JSON, but not a card
        b'{"display_name": "bad", "endpoint": {"namespace": "ns", "component": "c", "name": "g"},'
        b' "instance_id": 1, "model_type": 3, "model_input": "pictures"}',
    ],
)
async def test_invalid_entry_is_logged_and_skipped(
    h: Harness, value: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    bad_key = "v1/mdc/ns/backend/generate/99"
    await h.store.put(bad_key, value)
    await h.serve("llama")

    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    assert h.manager.list_models() == ["llama"]
    assert h.factory.kinds() == [("chat", "llama"), ("completions", "llama")]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "invalid model card" in errors[0] and bad_key in errors[0]
    # Its DELETE is expected, not an error.
    await h.store.delete(bad_key)
    assert await h.barrier() == []
    assert not [r for r in caplog.records if "not held" in r.getMessage()]


@pytest.mark.parametrize(
    ("model_input", "model_type", "missing"),
    [
        (ModelInput.Text, EMB, "Embedding"),
        (ModelInput.Text, TENSOR, "TensorBased"),
        (ModelInput.Tokens, TENSOR, "TensorBased"),
        (ModelInput.Tensor, ModelType.Chat, "Chat"),
        (ModelInput.Tensor, ModelType.Completions, "Completions"),
        (ModelInput.Tensor, EMB, "Embedding"),
        (ModelInput.Tokens, ModelType.Prefill, "Prefill"),
        # Never half-served: one unsupported type refuses the whole card.
        (ModelInput.Text, ModelType.Chat | EMB, "Embedding"),
        (ModelInput.Tensor, TENSOR | ModelType.Chat, "Chat"),
    ],
)
async def test_unsupported_pair_is_rejected_with_message(
    h: Harness,
    model_input: ModelInput,
    model_type: ModelType,
    missing: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    key = await h.put_card(make_card("odd", model_input=model_input, model_type=model_type))
    # A second instance of the same card: refused too, not logged again.
    other = await h.put_card(
        make_card("odd", model_input=model_input, model_type=model_type, instance_id=2)
    )
    assert await h.barrier() == []

    assert not h.manager.has_model_any("odd")
    assert h.manager.entries_for_model("odd") == []
    assert h.served() == set()
    assert h.built() == []
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    expected = (
        f"Unsupported model configuration: {model_type.names()} with {model_input.value} input"
    )
    assert "odd" in errors[0] and expected in errors[0] and SUPPORTED_PAIRS in errors[0]
    assert f"{missing} cannot be served" in errors[0]
    assert (
        "Supported combinations: Tokens+(Chat|Completions), Text+Chat, Text+Completions, "
        "Tokens+Embeddings, Tensor+TensorBased" in errors[0]
    )
    await h.store.delete(key)
    await h.store.delete(other)
    assert await h.barrier() == []
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1


async def test_another_card_is_held_back_and_logged_once(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A card of a served model with another checksum is not served (it would get the served
    card's tokenizer and template), but its pipelines are built, unregistered, for a switch."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    good = make_card("llama", instance_id=1)
    other = make_card("llama", instance_id=2, context_length=8192)
    again = make_card("llama", instance_id=3, context_length=8192)
    assert good.checksum() != other.checksum() == again.checksum()
    await h.put_card(good)
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    await h.put_card(other)
    await h.put_card(again)
    assert await h.barrier() == []

    assert [c.instance_id for c in h.manager.entries_for_model("llama")] == [1]
    built = [("chat", "llama"), ("completions", "llama")]
    assert h.built() == built * 2  # the served card's, then the standby card's, once
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "held back" in warning and good.checksum() in warning and other.checksum() in warning


async def test_standby_card_that_cannot_be_built_is_refused(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    good = make_card("llama", instance_id=1)
    other = make_card("llama", instance_id=2, context_length=8192)
    good_key = await h.put_card(good)
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    h.factory.fail.add(("chat", "llama"))
    other_key = await h.put_card(other)
    assert await h.barrier() == []
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "mismatch" in error and other.checksum() in error and "cannot build chat" in error

    # Refused, so its DELETE is expected, and the last served instance removes the model
    # (the barrier still serves chat).
    await h.store.delete(other_key)
    await h.store.delete(good_key)
    assert await h.next_update() == ModelUpdate.Removed(ModelType.Completions)
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1


async def test_last_served_instance_leaving_switches_to_the_largest_standby_card(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    metrics = h.factory.metrics = FrontendMetrics()
    old = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    b1 = await h.serve("llama", context_length=8192)
    small = await h.serve("llama", context_length=2048)  # seen before the second B
    b2 = await h.serve("llama", context_length=8192)
    assert await h.barrier() == []
    client = h.factory.calls[0][2]
    await until(lambda: len(client.announced_ids()) == 4)
    assert list(client.instance_ids()) == [old.instance_id]
    # One view per card, over one client of the endpoint.
    views = h.factory.views
    b_view = views[make_card("llama", context_length=8192).checksum()]
    small_view = views[make_card("llama", context_length=2048).checksum()]
    assert len({id(v) for _, m, v in h.factory.calls if m == "llama"}) == 3
    assert b_view.client is small_view.client is client.client
    b_ids = sorted([b1.instance_id, b2.instance_id])
    await until(lambda: list(b_view.instance_ids()) == b_ids)
    assert list(small_view.instance_ids()) == [small.instance_id]

    await old.stop()
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    assert await h.barrier() == []  # nothing removed, ever
    entries = h.manager.entries_for_model("llama")
    assert sorted(c.instance_id for c in entries) == b_ids
    assert {c.context_length for c in entries} == {8192}
    assert h.manager.get_engine(ModelKind.CHAT, "llama") == FakeEngine("chat", "llama")
    served = [c.context_length for c in h.factory.serving_cards if c.display_name == "llama"]
    assert served == [4096, 8192]
    # The old card's view never lists another card's instances.
    assert list(client.instance_ids()) == []
    assert h.manager.model_instances("llama") == b_ids  # the 2048 card still gets nothing
    # The standby pipelines were built once each, when their card first came; none since.
    assert h.built() == [("chat", "llama"), ("completions", "llama")] * 3
    (record,) = [r for r in caplog.records if "switched card" in r.getMessage()]
    # The expected end of a rolling upgrade: said, not alarmed about (the held-back line was).
    assert record.levelno == logging.INFO
    switch = record.getMessage()
    assert b1.instance_id != small.instance_id
    assert make_card("llama", context_length=8192).checksum() in switch
    assert metrics.card_switches.labels("llama")._value.get() == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

    # The new card's instances leave too: the last remaining card is served next.
    await b1.stop()
    await b2.stop()
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    assert [c.context_length for c in h.manager.entries_for_model("llama")] == [2048]
    assert h.manager.model_instances("llama") == [small.instance_id]
    await small.stop()
    assert await h.next_update() == ModelUpdate.Removed(ModelType.Completions)
    assert h.served() == set()
    assert client.client not in h.runtime._endpoint_clients  # closed
    assert metrics.card_switches.labels("llama")._value.get() == 2
    # Every card's routing state is released with the model.
    released = [c for c in h.factory.released if c.display_name == "llama"]
    assert sorted(c.context_length for c in released) == [2048, 4096, 8192]


async def test_a_failed_release_is_logged_not_lost(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """Releasing a card's routing state runs beside the event that dropped it: a failure
    there is logged as an error (it would otherwise vanish with its task)."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    h.factory.release_error = RuntimeError("the KV router would not close")
    worker = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    await worker.stop()
    # The model is removed all the same: both its kinds are reported gone.
    assert {await h.next_update(), await h.next_update()} == {
        ModelUpdate.Removed(ModelType.Chat),
        ModelUpdate.Removed(ModelType.Completions),
    }

    def logged() -> bool:
        return any(
            r.levelno == logging.ERROR and "would not close" in r.getMessage()
            for r in caplog.records
        )

    await until(logged)


async def test_served_card_unreachable_switches_to_a_reachable_standby(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker that stops taking requests before this frontend sees it leave (a polled
    store) is set aside by the request that found it gone: with no reachable instance of the
    served card left and a standby card up, the model switches at once, so that the next
    request finds an instance. The old card's view still lists only the old card's
    instances: requests tokenized with it never go to the new card's."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    old = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    new = await h.serve("llama", context_length=8192)
    assert await h.barrier() == []
    client = h.factory.calls[0][2]
    await until(lambda: len(client.announced_ids()) == 2)

    client.report_instance_down(old.instance_id)
    # Switched, synchronously.
    assert h.manager.model_instances("llama") == [new.instance_id]
    assert [c.instance_id for c in h.manager.entries_for_model("llama")] == [new.instance_id]
    assert list(client.instance_ids()) == []
    assert any("is reachable" in r.getMessage() for r in caplog.records)
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    # The old card waits on standby; when it leaves, nothing changes for the model.
    await old.stop()
    assert await h.barrier() == []
    assert h.manager.model_instances("llama") == [new.instance_id]


async def test_switch_ties_go_to_the_card_seen_first(h: Harness) -> None:
    """Cards with no instance announced (the card's DELETE is the only signal)."""
    a = await h.put_card(make_card("llama", instance_id=1))
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    await h.put_card(make_card("llama", instance_id=2, context_length=8192))
    await h.put_card(make_card("llama", instance_id=3, context_length=2048))
    await h.store.delete(a)
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    assert [c.instance_id for c in h.manager.entries_for_model("llama")] == [2]


async def test_switch_to_a_card_of_other_kinds_reports_them(h: Harness) -> None:
    a = await h.put_card(make_card("llama", instance_id=1))
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    chat_only = make_card("llama", instance_id=2, model_type=ModelType.Chat, context_length=99)
    await h.put_card(chat_only)
    await h.store.delete(a)
    assert await h.next_update() == ModelUpdate.Added(ModelType.Chat)
    assert await h.next_update() == ModelUpdate.Removed(ModelType.Completions)
    assert h.manager.list_models_of(ModelKind.CHAT)[-1:] == ["llama"]
    assert "llama" not in h.manager.list_models_of(ModelKind.COMPLETIONS)


async def test_standby_card_leaving_is_quiet(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    a = await h.put_card(make_card("llama", instance_id=1))
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    b = await h.put_card(make_card("llama", instance_id=2, context_length=8192))
    await h.store.delete(b)
    assert await h.barrier() == []
    await h.store.delete(a)
    assert await h.next_update() == ModelUpdate.Removed(ModelType.Completions)
    assert h.served() == set()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_card_replaced_under_its_key(h: Harness) -> None:
    """A key that now holds another card: its old entry leaves, the new one is placed."""
    key = await h.put_card(make_card("llama", instance_id=1))
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    await h.put_card(make_card("llama", instance_id=1, context_length=8192))
    assert await h.next_update() == ModelUpdate.Removed(ModelType.Chat)
    assert await h.next_update() == ModelUpdate.Removed(ModelType.Completions)
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    assert [c.context_length for c in h.manager.entries_for_model("llama")] == [8192]
    assert list(h.manager.model_cards("llama")) == [key]


async def test_refused_instance_gets_no_requests(h: Harness) -> None:
    """An instance whose card was refused stays announced in discovery, but the model's
    pipelines never see it among their candidates."""
    good = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    odd = await h.serve("llama", context_length=8192)
    assert await h.barrier() == []
    client = h.factory.calls[0][2]
    await until(lambda: odd.instance_id in client.announced_ids())
    assert list(client.instance_ids()) == [good.instance_id]
    assert [i.instance_id for i in client.instances()] == [good.instance_id]
    assert h.manager.model_instances("llama") == [good.instance_id]

    # A second good instance is a candidate as soon as its card is accepted.
    other = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    await until(lambda: len(client.instance_ids()) == 2)
    assert list(client.instance_ids()) == sorted([good.instance_id, other.instance_id])
    await good.stop()
    await until(lambda: list(client.instance_ids()) == [other.instance_id])


async def test_factory_error_adds_nothing(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    h.factory.fail.add(("completions", "llama"))
    await h.serve("llama")
    assert await h.barrier() == []

    # The chat pipeline was built, then rolled back with the failed completions one.
    assert h.built() == [("chat", "llama"), ("completions", "llama")]
    assert not h.manager.has_model_any("llama")
    assert h.manager.entries_for_model("llama") == []
    assert h.manager.model_instances("llama") == []
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "llama" in error.getMessage() and "namespace ns" in error.getMessage()
    assert "cannot build completions" in error.getMessage()

    # A later instance tries again, and succeeds once the factory does.
    h.factory.fail.clear()
    await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    assert h.served() == {"llama"}


# -- namespaces ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("namespace", "seen"),
    [
        (None, {"m1", "m2"}),
        ("", {"m1", "m2"}),
        ("global", {"m1", "m2"}),
        ("ns1", {"m1"}),
        ("ns2", {"m2"}),
    ],
)
async def test_namespace_filter(
    make_harness: HarnessFactory,
    namespace: str | None,
    seen: set[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    h = await make_harness(namespace)
    k1 = await h.put_card(make_card("m1", ep=endpoint("ns1")))
    k2 = await h.put_card(make_card("m2", ep=endpoint("ns2")))
    added = await h.barrier(namespace or "ns1")
    assert added == [ModelUpdate.Added(CHAT_COMPL)] * len(seen)

    assert h.served() == seen
    assert {m for _, m in h.built()} == seen
    # Deleting a filtered-out key is not an error.
    await h.store.delete(k1)
    await h.store.delete(k2)
    await h.barrier(namespace or "ns1")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_is_global_namespace() -> None:
    assert is_global_namespace(None)
    assert is_global_namespace("")
    assert is_global_namespace("global")
    assert not is_global_namespace("dynamo")
    assert not is_global_namespace("ns1")


# -- removing ---------------------------------------------------------------------------------


async def test_last_instance_leaving_removes_the_model(h: Harness) -> None:
    a = await h.serve("llama")
    b = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    (_, _, client), _ = h.factory.calls

    await a.stop()
    await until(lambda: len(h.manager.entries_for_model("llama")) == 1)
    assert h.manager.get_engine(ModelKind.CHAT, "llama") == FakeEngine("chat", "llama")
    assert h.updates.empty()

    await b.stop()
    assert await h.next_update() == ModelUpdate.Removed(ModelType.Chat)
    assert await h.next_update() == ModelUpdate.Removed(ModelType.Completions)
    assert h.manager.list_models() == []
    assert h.manager.entries_for_model("llama") == []
    assert h.manager.model_instances("llama") == []
    assert client.client not in h.runtime._endpoint_clients  # closed
    with pytest.raises(ModelNotFound, match="llama"):
        h.manager.get_engine(ModelKind.CHAT, "llama")


async def test_removed_only_for_kinds_left_empty(h: Harness) -> None:
    """Removed(t) only when no model serves t any more (Dynamo's watcher's rule)."""
    await h.put_card(make_card("chatty", ep=endpoint("ns", "a"), model_type=ModelType.Chat))
    both = await h.put_card(make_card("both", ep=endpoint("ns", "b")))
    assert await h.next_update() == ModelUpdate.Added(ModelType.Chat)
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)

    await h.store.delete(both)
    assert await h.next_update() == ModelUpdate.Removed(ModelType.Completions)
    assert await h.barrier() == []
    assert "chatty" in h.manager.list_models_of(ModelKind.CHAT)


async def test_unknown_delete_is_harmless(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """A DELETE of a key never held (a store re-listing after a restore reports such keys) is
    a debug line, not an alarm."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    key = "v1/mdc/ns/backend/generate/abc"
    await h.watcher.handle_event(
        WatchEvent(WatchEventKind.DELETE, KeyValue(key=key, value=b"", revision=1))
    )
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    (line,) = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert line == f"model entry not held deleted key={key}"


async def test_expired_lease_removes_the_card(h: Harness) -> None:
    lease_id = await h.store.grant_lease(0.05)  # never kept alive
    await h.put_card(make_card("brief", model_type=ModelType.Chat), lease_id=lease_id)
    assert await h.next_update() == ModelUpdate.Added(ModelType.Chat)
    assert h.manager.list_models_of(ModelKind.CHAT) == ["brief"]

    assert await h.next_update() == ModelUpdate.Removed(ModelType.Chat)
    assert h.manager.list_models() == []


# -- waiting and lifecycle -----------------------------------------------------------------------


async def test_wait_for_chat_model_waits_then_returns(h: Harness) -> None:
    waiter = asyncio.create_task(h.watcher.wait_for_chat_model())
    await asyncio.sleep(0.01)  # time under test: with no chat model, it keeps waiting
    assert not waiter.done()

    await h.put_card(make_card("plain", model_type=ModelType.Completions))
    assert await h.next_update() == ModelUpdate.Added(ModelType.Completions)
    await asyncio.sleep(0.01)  # time under test: it keeps waiting
    assert not waiter.done()  # a completions-only model is not a chat model

    await h.put_card(make_card("talker", ep=endpoint("ns", "t"), model_type=ModelType.Chat))
    assert await asyncio.wait_for(waiter, TIMEOUT) == "talker"


async def test_watch_ends_when_the_store_closes(h: Harness) -> None:
    await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    await h.runtime.shutdown()
    await h.store.close()
    await asyncio.wait_for(h.task, TIMEOUT)
    assert h.task.exception() is None


async def test_cancelled_mid_build_rolls_back(h: Harness) -> None:
    h.factory.gate = asyncio.Event()
    await h.serve("llama")
    await until(lambda: len(h.factory.calls) == 2)  # chat built, completions waiting
    (_, _, client), _ = h.factory.calls
    assert client.client in h.runtime._endpoint_clients

    h.task.cancel()
    await asyncio.wait([h.task])
    assert h.task.cancelled()
    assert not h.manager.has_model_any("llama")
    assert client.client not in h.runtime._endpoint_clients  # closed
    assert h.updates.empty()


def test_model_update_variants() -> None:
    added: ModelUpdate = ModelUpdate.Added(ModelType.Chat)
    removed: ModelUpdate = ModelUpdate.Removed(ModelType.Chat)
    assert added != removed
    assert isinstance(added, ModelAdded) and isinstance(removed, ModelRemoved)
    assert ModelUpdate.Removed is ModelRemoved
    assert added == ModelAdded(ModelType.Chat)
    match added:
        case ModelRemoved():
            pytest.fail("matched the wrong variant")
        case ModelAdded(model_type=t):
            assert t is ModelType.Chat


class FlakyStore(MemoryStore):
    """A memory store whose watches can be broken, and refused while it is "down"."""

    CUT = "\x00cut"

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.watches_opened = 0

    def cut(self) -> None:
        """Break every live watch now and refuse new ones until ``down`` is cleared."""
        self.down = True
        for watcher in self._watchers:
            watcher.queue.put_nowait(WatchEvent(WatchEventKind.PUT, KeyValue(self.CUT, b"", 0)))

    async def watch_prefix(  # type: ignore[override]
        self, prefix: str, *, start_revision: int | None = None
    ) -> AsyncIterator[WatchEvent]:
        if self.down:
            raise DiscoveryError("store unreachable")
        self.watches_opened += 1
        inner = super().watch_prefix(prefix, start_revision=start_revision)
        try:
            async for event in inner:
                if event.kv.key == self.CUT:
                    raise DiscoveryError("watch broken")
                yield event
        finally:
            await inner.aclose()


async def test_a_failed_watch_resumes_and_replays_what_it_missed(
    make_harness: HarnessFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the store is unreachable the frontend serves what it knew; when it is back,
    the watch resumes after the last revision it saw, so a card added and a card removed
    meanwhile are both applied."""
    monkeypatch.setattr(model_watcher, "WATCH_RETRY_MIN_SECONDS", 0.01)
    store = FlakyStore()
    h = await make_harness(store=store)
    llama = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)

    store.cut()
    await asyncio.sleep(0.05)  # the watcher is retrying, refused
    assert h.served() == {"llama"}  # serving what it knew
    assert not h.task.done()
    await h.put_card(make_card("later", ep=endpoint("ns", "later"), model_type=ModelType.Chat))
    await llama.stop()
    opened = store.watches_opened
    store.down = False
    await until(lambda: store.watches_opened > opened)
    await until(lambda: h.served() == {"later"})


# -- one view per card, and the switch grace period ---------------------------------------------


async def test_each_card_routes_to_its_own_instances_only(h: Harness) -> None:
    """During a rolling upgrade the old and the new card share one endpoint client, but each
    card's pipelines route through a view of their own: before, during and after the switch,
    the old card's view never lists an instance of the new card, nor the reverse."""
    old = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    new = await h.serve("llama", context_length=8192)
    assert await h.barrier() == []
    a_view = h.factory.views[make_card("llama").checksum()]
    b_view = h.factory.views[make_card("llama", context_length=8192).checksum()]
    assert a_view is not b_view and a_view.client is b_view.client
    await until(lambda: a_view.announced_ids() == {old.instance_id, new.instance_id})
    assert list(a_view.instance_ids()) == [old.instance_id]
    assert [i.instance_id for i in a_view.instances()] == [old.instance_id]
    assert a_view.get_instance(new.instance_id) is None
    assert list(b_view.instance_ids()) == [new.instance_id]
    # Even a request that names the other card's instance is not sent to it.
    with pytest.raises(NoInstanceAvailable, match="serves another card"):
        await anext(a_view.stream(new.instance_id, b"x", RequestContext()).__aiter__())
    reply = [r async for r in b_view.stream(new.instance_id, b"x", RequestContext())]
    assert reply == [b"x"]

    await old.stop()
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    assert h.manager.model_instances("llama") == [new.instance_id]
    # Requests still running on the old card (a migration, a retry) find no instance of it;
    # they are never handed to the new card's instance.
    assert list(a_view.instance_ids()) == []
    assert a_view.get_instance(new.instance_id) is None
    assert list(b_view.instance_ids()) == [new.instance_id]


GRACE = 3.0


async def test_switch_back_when_the_served_card_returns_within_the_grace_period(
    make_harness: HarnessFactory,
) -> None:
    """The served card's last worker leaves and the model switches to the standby card; a
    worker of the served card registering again within the grace period takes the model
    back (its pipelines kept meanwhile, not rebuilt)."""
    clock = FakeClock()
    h = await make_harness(card_grace_s=GRACE, clock=clock)
    old = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    odd = await h.serve("llama", context_length=8192)
    assert await h.barrier() == []
    built = len(h.built())

    await old.stop()
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    assert h.manager.model_instances("llama") == [odd.instance_id]
    assert h.factory.released == []  # the old card's pipelines are kept for the grace period

    clock.advance(GRACE - 0.5)
    back = await h.serve("llama")  # the old card again, a new instance
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    await until(lambda: h.manager.model_instances("llama") == [back.instance_id])
    assert [c.context_length for c in h.manager.entries_for_model("llama")] == [4096]
    assert len(h.built()) == built  # nothing rebuilt
    # The odd card is standby again; its view still lists only its own instance.
    b_view = h.factory.views[make_card("llama", context_length=8192).checksum()]
    assert list(b_view.instance_ids()) == [odd.instance_id]

    # Past a grace period, no switch back.
    await back.stop()
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    clock.advance(GRACE)
    late = await h.serve("llama")
    assert await h.barrier() == []
    await until(lambda: late.instance_id in b_view.announced_ids())
    assert h.manager.model_instances("llama") == [odd.instance_id]
    assert [c.context_length for c in h.manager.entries_for_model("llama")] == [8192]


async def test_switch_back_when_a_set_aside_instance_answers_again(
    make_harness: HarnessFactory,
) -> None:
    """A served instance set aside (unreachable for a moment) switches the model to a
    reachable standby card at once; when it is routable again within the grace period, the
    model returns to it."""
    clock = FakeClock()
    h = await make_harness(card_grace_s=GRACE, clock=clock)
    old = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    odd = await h.serve("llama", context_length=8192)
    assert await h.barrier() == []
    a_view = h.factory.views[make_card("llama").checksum()]
    await until(lambda: len(a_view.announced_ids()) == 2)

    a_view.report_instance_down(old.instance_id)
    assert h.manager.model_instances("llama") == [odd.instance_id]
    # Announced again (its record re-put): back in service, and the model with it.
    await h.store.put(*await _instance_record(h, old))
    await until(lambda: h.manager.model_instances("llama") == [old.instance_id])
    assert [c.context_length for c in h.manager.entries_for_model("llama")] == [4096]
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)


async def test_grace_period_over_forgets_an_empty_previous_card(
    make_harness: HarnessFactory,
) -> None:
    clock = FakeClock()
    h = await make_harness(card_grace_s=GRACE, clock=clock)
    old = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    await h.serve("llama", context_length=8192)
    assert await h.barrier() == []
    await old.stop()
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    assert h.factory.released == []
    clock.advance(GRACE)
    await until(lambda: [c.context_length for c in h.factory.released] == [4096])


async def test_no_grace_period_drops_the_old_card_at_the_switch(
    make_harness: HarnessFactory,
) -> None:
    h = await make_harness(card_grace_s=0)
    old = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    await h.serve("llama", context_length=8192)
    assert await h.barrier() == []
    await old.stop()
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    await until(lambda: [c.context_length for c in h.factory.released] == [4096])


async def _instance_record(h: Harness, inst: ServingInstance) -> tuple[str, bytes]:
    """The discovery record (key, value) ``inst`` announced itself with."""
    (kv,) = [
        kv
        for kv in await h.store.get_prefix("v1/instances/")
        if kv.key.endswith(f"{inst.instance_id:x}")
    ]
    return kv.key, kv.value


# -- concurrent builds ----------------------------------------------------------------------------


async def test_a_stalled_build_does_not_hold_up_other_models(h: Harness) -> None:
    """Model A's artifact fetch hangs; model B, announced after it, is served meanwhile. A's
    own later events wait behind its build, in order."""
    stall = h.factory.stalled["slow"] = asyncio.Event()
    slow_key = await h.put_card(make_card("slow", ep=endpoint("ns", "slow")))
    await until(lambda: ("chat", "slow") in h.built())
    await h.put_card(make_card("quick", ep=endpoint("ns", "quick")))
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    assert h.served() == {"quick"}
    await h.store.delete(slow_key)  # queued behind the stalled build

    stall.set()
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)  # slow, built at last
    await asyncio.wait_for(h.watcher.settled(), TIMEOUT)
    assert h.served() == {"quick"}  # and removed by its DELETE, handled after


async def test_concurrent_builds_are_bounded(make_harness: HarnessFactory) -> None:
    h = await make_harness(max_concurrent_models=2)
    names = ["m1", "m2", "m3"]
    for name in names:
        h.factory.stalled[name] = asyncio.Event()
        await h.put_card(make_card(name, ep=endpoint("ns", name)))
    await until(lambda: len(h.built()) == 2)
    await asyncio.sleep(0.01)  # time under test: the third model waits for a slot
    assert len(h.built()) == 2
    first = h.built()[0][1]
    h.factory.stalled[first].set()
    await until(lambda: {m for _, m in h.built()} == set(names))
    for name in names:
        h.factory.stalled[name].set()
    await asyncio.wait_for(h.watcher.settled(), TIMEOUT)
    assert h.served() == set(names)


# -- planes and held-back instances -------------------------------------------------------------


def instance_record(instance_id: int, request_plane: str = "", event_plane: str = "") -> bytes:
    """An instance record as a worker on these planes writes it ("" : a process that predates
    the fields)."""
    return msgspec.json.encode(
        Instance(
            endpoint=endpoint(),
            instance_id=instance_id,
            transport=TransportAddress(kind="local", address=f"w{instance_id}"),
            host="10.0.0.9",
            pid=4242,
            request_plane=request_plane,
            event_plane=event_plane,
        )
    )


def plane_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "every process must use" in r.getMessage()]


@pytest.mark.parametrize("record_first", [True, False])
async def test_an_instance_on_other_planes_is_refused_loudly(
    h: Harness, caplog: pytest.LogCaptureFixture, record_first: bool
) -> None:
    """A worker on other planes gets no request (its KV events and load would go where this
    frontend does not listen), whichever of its records the frontend sees first; one warning
    line names it; the frontend holds it back; one on the same planes is served."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    h.watcher.held_back_changed.clear()
    ok = await h.serve("llama")
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    key = instance_key(endpoint(), 0x1A2B)
    if record_first:
        await h.store.put(key, instance_record(0x1A2B, "tcp", "zmq"))
    await h.put_card(make_card("llama", instance_id=0x1A2B))
    assert await h.barrier() == [ModelUpdate.Added(CHAT_COMPL)]
    if not record_first:
        await h.store.put(key, instance_record(0x1A2B, "tcp", "zmq"))
    view = h.factory.views[make_card("llama").checksum()]
    await until(lambda: bool(plane_warnings(caplog)))
    assert 0x1A2B in view.client.instance_ids()  # announced, and the client would call it
    assert view.instance_ids() == (ok.instance_id,)
    (warning,) = plane_warnings(caplog)
    assert warning == (
        "instance 1a2b at 10.0.0.9:4242 runs request plane tcp, event plane zmq; this frontend "
        "runs local/local: refused; every process must use the same planes"
    )
    assert h.watcher.held_back_changed.is_set()
    (held,) = h.watcher.held_back()
    assert (held.model, held.instance_id, held.reason) == (
        "llama",
        "1a2b",
        HoldReason.PLANES_DIFFER,
    )
    assert held.detail == "instance runs tcp/zmq, frontend local/local"

    await h.store.put(key, instance_record(0x1A2B, "tcp", "zmq"))  # the same record again
    await h.barrier()
    assert len(plane_warnings(caplog)) == 1 and view.instance_ids() == (ok.instance_id,)

    await h.store.delete(mdc_key(endpoint(), 0x1A2B))
    await h.store.delete(key)
    await h.barrier()
    assert h.watcher.held_back() == []


async def test_an_instance_record_without_planes_is_served(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker older than the planes' fields says nothing of them: it is not held against it."""
    await h.store.put(instance_key(endpoint(), 7), instance_record(7))
    await h.put_card(make_card("llama", instance_id=7))
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    view = h.factory.views[make_card("llama").checksum()]
    await until(lambda: view.instance_ids() == (7,))
    assert not plane_warnings(caplog) and h.watcher.held_back() == []


async def test_held_back_lists_standby_instances_with_the_served_checksum(h: Harness) -> None:
    good = make_card("llama", instance_id=1)
    other = make_card("llama", instance_id=2, context_length=8192)
    await h.put_card(good)
    assert await h.next_update() == ModelUpdate.Added(CHAT_COMPL)
    h.watcher.held_back_changed.clear()
    await h.put_card(other)
    await h.barrier()
    assert h.watcher.held_back_changed.is_set()
    (held,) = h.watcher.held_back()
    assert (held.model, held.instance_id, held.checksum) == ("llama", "2", other.checksum())
    assert held.reason is HoldReason.CARD_DIFFERS
    assert held.detail == f"served card is {good.checksum()}"
