"""A rolling upgrade under load: workers of card A serve; workers of card B (another context
length, so another checksum) start; the A workers stop gracefully one by one while clients
keep sending requests. No request fails (on a polled store, at most the requests already
sent to the last A worker as it stopped taking them: they are never re-routed to B's
workers), and afterwards the model serves card B.

The stack is real: a memory or file store, the tcp request plane, echo workers, the HTTP frontend;
only the clients run in the same process. Nothing here waits on wall-clock speed: each step
waits for a state (the model served, the standby card built, the switch made) and the load
runs until the steps are done.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from tests.frontend.stack import ENDPOINT, make_stack
from tests.frontend.test_artifacts import start_frontend, write_hf_model

from turnout.engines.echo import EchoEngine
from turnout.engines.mocker import MockerConfig, make_mocker_engines
from turnout.engines.worker import Worker
from turnout.frontend.service import Frontend
from turnout.router.kv.config import KvRouterConfig
from turnout.router.mode import RouterMode
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.discovery import DiscoveryStore, FileStore, MemoryStore

MODEL = "tiny"
#: Card A's context length comes from the model's config (1024); card B overrides it.
B_CONTEXT = 512
#: Concurrent clients of the load.
CLIENTS = 4


async def until(cond: Callable[[], bool], within: float = 20.0) -> None:
    async with asyncio.timeout(within):
        while not cond():
            await asyncio.sleep(0.01)


@pytest.fixture(params=["memory", "file"])
async def runtime(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[DistributedRuntime]:
    """On the file store too: there the endpoint client and the model watcher poll the store
    apart, so the instance and the card of a leaving worker vanish for them at different
    times, which the switch must not turn into a failed request."""
    store: DiscoveryStore = (
        MemoryStore() if request.param == "memory" else FileStore(tmp_path / "d.sqlite")
    )
    rt = await DistributedRuntime.create(store=store, request_plane="tcp", lease_ttl=5.0)
    yield rt
    await rt.shutdown()
    await store.close()


class Load:
    """``clients`` loops, each sending one chat request after another until stopped; every
    response is recorded (status, and the text or the error body)."""

    def __init__(self, url: str, clients: int = CLIENTS) -> None:
        self.url = url
        self.results: list[tuple[int, str]] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._loop(i)) for i in range(clients)]

    async def _loop(self, n: int) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as http:
            i = 0
            while not self._stop.is_set():
                i += 1
                resp = await http.post(
                    "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": f"hello {n} {i}"}],
                    },
                )
                if resp.status_code == 200:
                    text = resp.json()["choices"][0]["message"]["content"]
                    ok = f"hello {n} {i}" in text
                    self.results.append((200 if ok else -1, text))
                else:
                    self.results.append((resp.status_code, resp.text))

    async def more(self, n: int) -> None:
        """Wait until ``n`` more requests have completed."""
        target = len(self.results) + n
        await until(lambda: len(self.results) >= target)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def test_rolling_upgrade_under_load_fails_no_request(
    runtime: DistributedRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_hf_model(tmp_path / MODEL)
    frontend: Frontend = await start_frontend(runtime, tmp_path / "cache", monkeypatch)
    assert frontend.watcher is not None
    watcher = frontend.watcher
    manager = frontend.manager

    def worker(**engine: object) -> Worker:
        echo = EchoEngine(str(model), **engine)  # type: ignore[arg-type]
        return Worker(runtime, echo, ENDPOINT, model_name=MODEL)

    old = [worker(), worker()]
    new = [worker(context_length=B_CONTEXT), worker(context_length=B_CONTEXT)]
    load: Load | None = None
    try:
        for w in old:
            await w.start()
        await until(lambda: len(manager.model_instances(MODEL)) == 2)
        (card_a,) = {c.checksum() for c in manager.entries_for_model(MODEL)}
        load = Load(frontend.url)
        await load.more(20)

        for w in new:
            await w.start()
        # Both B instances are held back (their pipelines built), none gets a request.
        await until(
            lambda: sum(len(g.entries) for g in watcher._models[MODEL].standby.values()) == 2
        )
        await load.more(20)
        assert len(manager.model_instances(MODEL)) == 2

        for w in old:
            await w.stop(drain_timeout=5.0)
            await load.more(20)
        await until(lambda: not watcher._models[MODEL].standby)  # A's cards all gone
        await load.more(40)

        # The model serves card B, through B's instances only.
        cards = manager.entries_for_model(MODEL)
        assert {c.context_length for c in cards} == {B_CONTEXT}
        assert card_a not in {c.checksum() for c in cards}
        assert {c.instance_id for c in cards} == {w.serving.instance_id for w in new if w.serving}
        assert manager.model_instances(MODEL) == sorted(c.instance_id for c in cards)
    finally:
        if load is not None:
            await load.stop()
        for w in old + new:
            await w.stop(drain_timeout=1.0)
        await frontend.stop()

    # A polled store sees the last old worker leave after it stopped taking requests: the
    # requests tokenized with card A that find no instance of A left run again on card B.
    failed = [r for r in load.results if r[0] != 200]
    assert failed == [], f"{len(failed)} of {len(load.results)} requests failed: {failed[:3]}"
    switches = frontend.metrics.card_switches.labels(MODEL)._value.get()
    assert switches == 1


#: Card B of the mocker workers (card A's context is the mocker's own, larger).
B_MOCK_CONTEXT = 256


async def test_kv_routing_keeps_each_cards_requests_on_its_own_instances(gguf_path: str) -> None:
    """KV mode, mocker workers of two cards on one endpoint: each card has a KV router of its
    own, over its own routing view; requests go only to the served card's instances, before
    the switch and after it, and the KV router read per model name follows the switch."""
    stack = await make_stack(router_mode=RouterMode.KV, kv=KvRouterConfig(block_size=16))
    factory = stack.frontend.factory
    assert factory is not None
    config = MockerConfig(num_gpu_blocks=256, block_size=16, speedup_ratio=1.0)
    old = [
        await stack.add_worker(engine, model_name="mock")
        for engine in make_mocker_engines(config, 2, model_path=gguf_path)
    ]
    await stack.wait_for_model("mock", instances=2)
    new = [
        await stack.add_worker(engine, model_name="mock")
        for engine in make_mocker_engines(
            config, 2, model_path=gguf_path, first_worker_id=2, context_length=B_MOCK_CONTEXT
        )
    ]
    try:
        await until(lambda: len([r for r in factory.cards.values() if r.kv_router]) == 2)
        a, b = sorted(factory.cards.values(), key=lambda r: r.card.context_length == 256)
        assert a.card.context_length > B_MOCK_CONTEXT == b.card.context_length
        assert a.kv_router is not None and b.kv_router is not None
        assert a.kv_router is not b.kv_router
        assert a.kv_router.client is a.client and b.kv_router.client is b.client
        assert factory.kv_routers["mock"] is a.kv_router
        a_ids = {w.serving.instance_id for w in old if w.serving}
        b_ids = {w.serving.instance_id for w in new if w.serving}
        await until(lambda: set(b.client.instance_ids()) == b_ids)
        assert set(a.client.instance_ids()) == a_ids

        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            assert await _worker_ids(http, 8) <= a_ids
            for w in old:
                await w.stop(drain_timeout=1.0)
            await until(lambda: set(stack.frontend.manager.model_instances("mock")) == b_ids)
            assert await _worker_ids(http, 8) <= b_ids
        assert factory.kv_routers["mock"] is b.kv_router
        assert list(a.client.instance_ids()) == []  # the old card's router sees none of B's
    finally:
        await stack.close()


async def _worker_ids(http: httpx.AsyncClient, n: int) -> set[int]:
    """The instances ``n`` completions (each a different prompt) were served by."""
    seen: set[int] = set()
    for i in range(n):
        r = await http.post(
            "/v1/completions",
            json={"model": "mock", "prompt": [100 + i * 7 + j for j in range(48)],
                  "max_tokens": 2, "ignore_eos": True,
                  "nvext": {"extra_fields": ["worker_id"]}},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        seen.add(int(r.json()["nvext"]["worker_id"], 16))
    return seen
