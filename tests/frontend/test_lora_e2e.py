"""LoRA serving end to end: mocker workers that load adapters on first use, behind the real
frontend with ``--enable-lora`` (real sockets, the memory store)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import openai.types
import pytest
from tests.frontend.stack import Stack, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.mocker import MockerConfig, MockerEngine, make_mocker_engines
from turnout.errors import ConfigError
from turnout.frontend.service import Frontend, FrontendConfig
from turnout.protocols.llm import PreprocessedRequest, StopConditions
from turnout.router.kv.config import KvRouterConfig
from turnout.router.lora import rendezvous_pick
from turnout.router.mode import RouterMode
from turnout.runtime.context import RequestContext

BLOCK = 16
ADAPTERS = {f"ad{n}": f"/adapters/ad{n}" for n in range(12)}


def lora_config(**changes: Any) -> MockerConfig:
    settings: dict[str, Any] = {
        "num_gpu_blocks": 1024,
        "block_size": BLOCK,
        "speedup_ratio": 0.0,
        "lora_adapters": ADAPTERS,
        "max_loras": 16,
    }
    return MockerConfig(**(settings | changes))


async def lora_stack(
    gguf_path: str, workers: int, mode: RouterMode = RouterMode.ROUND_ROBIN, **config: Any
) -> Stack:
    extra: dict[str, Any] = {}
    if mode is RouterMode.KV:
        extra["kv"] = KvRouterConfig(block_size=BLOCK)
    stack = await make_stack(router_mode=mode, enable_lora=True, **extra)
    for engine in make_mocker_engines(lora_config(**config), workers, model_path=gguf_path):
        await stack.add_worker(engine, model_name="base")
    await stack.wait_for_model("base", instances=workers)
    return stack


@pytest.fixture
async def stacks() -> AsyncIterator[list[Stack]]:
    before = set(asyncio.all_tasks())
    made: list[Stack] = []
    yield made
    for stack in made:
        await stack.close()
    await assert_no_leaked_tasks(before)


async def complete(
    http: httpx.AsyncClient, model: str, prompt: list[int] | str = "hello", status: int = 200
) -> Any:
    r = await http.post(
        "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 3, "ignore_eos": True,
              "nvext": {"extra_fields": ["worker_id", "routing"]}},
        timeout=30,
    )  # fmt: skip
    assert r.status_code == status, r.text
    return r.json()


def worker_of(out: Any) -> int:
    return int(out["nvext"]["worker_id"], 16)


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.02)


async def listed(http: httpx.AsyncClient) -> dict[str, openai.types.Model]:
    body = (await http.get("/v1/models")).json()
    models = [openai.types.Model.model_validate(m) for m in body["data"]]
    return {m.id: m for m in models}


def instance_ids(stack: Stack) -> list[int]:
    return [w.serving.instance_id for w in stack.workers if w.serving is not None]


async def test_unknown_adapter_is_404_and_the_first_request_loads_on_the_rendezvous_winner(
    gguf_path: str, stacks: list[Stack]
) -> None:
    stack = await lora_stack(gguf_path, 3)
    stacks.append(stack)
    ids = instance_ids(stack)
    registry = stack.frontend.lora
    assert registry is not None
    async with httpx.AsyncClient(base_url=stack.url) as http:
        err = (await complete(http, "no-such-adapter", status=404))["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "ad0" not in await listed(http)
        # No holder: every request goes to the rendezvous winner, which loads the adapter.
        winner = rendezvous_pick("ad0", ids)
        for _ in range(5):
            out = await complete(http, "ad0")
            assert worker_of(out) == winner and out["model"] == "ad0"
        r = await http.post(
            "/v1/chat/completions",
            json={"model": "ad0", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 2, "nvext": {"extra_fields": ["worker_id"]}},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert worker_of(r.json()) == winner and r.json()["model"] == "ad0"
        await until(lambda: registry.holders("ad0") == {winner})
        models = await listed(http)
        routes = [
            "/v1/chat/completions",
            "/v1/responses",
            "/v1/messages",
            "/v1/messages/count_tokens",
            "/v1/completions",
        ]
        assert models["ad0"].model_extra == {"root": "ad0", "parent": "base", "endpoints": routes}
        assert models["base"].model_extra == {"root": "base", "parent": None, "endpoints": routes}
        # Different adapters spread over the workers (12 adapters, 3 workers).
        homes = {a: worker_of(await complete(http, a)) for a in ADAPTERS}
        assert homes == {a: rendezvous_pick(a, ids) for a in ADAPTERS}
        assert len(set(homes.values())) >= 2


async def test_adapter_requests_go_only_to_holders(gguf_path: str, stacks: list[Stack]) -> None:
    stack = await lora_stack(gguf_path, 4)
    stacks.append(stack)
    registry = stack.frontend.lora
    assert registry is not None
    # Two workers load ad3 out of band (as if earlier traffic had put it there).
    holders = stack.workers[1:3]
    for worker in holders:
        engine = worker.engine
        assert isinstance(engine, MockerEngine)
        request = PreprocessedRequest(
            model="base",
            token_ids=[1, 2, 3],
            stop_conditions=StopConditions(max_tokens=1),
            lora_name="ad3",
        )
        async for _ in engine.generate(request, RequestContext()):
            pass
    held = {w.serving.instance_id for w in holders if w.serving is not None}
    await until(lambda: registry.holders("ad3") == held)
    async with httpx.AsyncClient(base_url=stack.url) as http:
        chosen = Counter([worker_of(await complete(http, "ad3")) for _ in range(40)])
        assert set(chosen) == held and min(chosen.values()) == 20  # round-robin among them
        base = {worker_of(await complete(http, "base")) for _ in range(8)}
        assert base == set(instance_ids(stack))


async def test_max_loras_evicts_the_lru_adapter_and_its_card(
    gguf_path: str, stacks: list[Stack]
) -> None:
    stack = await lora_stack(gguf_path, 1, max_loras=2)
    stacks.append(stack)
    registry = stack.frontend.lora
    assert registry is not None
    async with httpx.AsyncClient(base_url=stack.url) as http:
        for name in ("ad0", "ad1", "ad0", "ad2"):  # ad1 is the least recently used
            await complete(http, name)
        await until(lambda: [a for a, _ in registry.loaded_adapters()] == ["ad0", "ad2"])
        models = await listed(http)
        assert {"ad0", "ad2"} <= models.keys() and "ad1" not in models
        # Evicted is not unknown: it loads again on its next request.
        await complete(http, "ad1")


async def test_adapter_blocks_give_no_overlap_to_base_requests_in_kv_mode(
    gguf_path: str, stacks: list[Stack]
) -> None:
    stack = await lora_stack(gguf_path, 2, RouterMode.KV)
    stacks.append(stack)
    prompt = [1000 + i for i in range(256)]
    async with httpx.AsyncClient(base_url=stack.url) as http:
        first = await complete(http, "ad5", prompt)
        assert worker_of(first) == rendezvous_pick("ad5", instance_ids(stack))
        await stack.wait_for_cached_blocks("base", prompt, 256 // BLOCK, lora_name="ad5")
        again = await complete(http, "ad5", prompt)
        assert again["nvext"]["routing"]["overlap_blocks"] == 256 // BLOCK
        assert len(again["nvext"]["routing"]["candidates"]) == 1  # holders only
        base = await complete(http, "base", prompt)
        assert base["nvext"]["routing"]["overlap_blocks"] == 0
        assert base["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert len(base["nvext"]["routing"]["candidates"]) == 2


@pytest.mark.parametrize(
    ("mode", "affinity", "match"),
    [
        (RouterMode.POWER_OF_TWO, None, "not supported with router mode power-of-two"),
        (RouterMode.DIRECT, None, "not supported with router mode direct"),
        (RouterMode.ROUND_ROBIN, 30.0, "session affinity is unsupported"),
    ],
)
def test_the_frontend_refuses_lora_with_an_unsupported_mode_at_start(
    mode: RouterMode, affinity: float | None, match: str
) -> None:
    config = FrontendConfig(
        router_mode=mode, enable_lora=True, router_session_affinity_ttl_s=affinity
    )
    with pytest.raises(ConfigError, match=match):
        Frontend(config)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["frontend", "--enable-lora", "--router-mode", "direct"], "router mode direct"),
        (
            ["frontend", "--enable-lora", "--router-session-affinity-ttl-secs", "30"],
            "session affinity is unsupported with LoRA serving and round-robin",
        ),
        (["worker", "--engine", "mocker", "--lora-adapters", "a/b"], "bad adapter name 'a/b'"),
        (["worker", "--engine", "mocker", "--max-loras", "0"], "max_loras must be"),
    ],
)
def test_bad_lora_settings_fail_at_start_in_one_line(
    args: list[str], words: str, tmp_path: Path
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "turnout", *args, "--store-path", str(tmp_path / "s.sqlite")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert words in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


async def test_adapter_cards_leave_with_their_worker(gguf_path: str, stacks: list[Stack]) -> None:
    stack = await lora_stack(gguf_path, 2)
    stacks.append(stack)
    registry = stack.frontend.lora
    assert registry is not None
    async with httpx.AsyncClient(base_url=stack.url) as http:
        home = worker_of(await complete(http, "ad7"))
        await until(lambda: registry.holders("ad7") == {home})
        leaving = next(w for w in stack.workers if w.serving and w.serving.instance_id == home)
        await leaving.stop(drain_timeout=1.0)
        stack.workers.remove(leaving)
        await until(lambda: not registry.holders("ad7"))
        assert "ad7" not in await listed(http)
        # The other worker takes the adapter over (it can load it too).
        (other,) = instance_ids(stack)
        await until(lambda: stack.frontend.manager.model_instances("base") == [other])
        assert worker_of(await complete(http, "ad7")) == other
