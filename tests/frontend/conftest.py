"""Frontend tests keep their fetched artifacts in a temporary cache, not ``~/.cache``; and
share plain stacks: a frontend with one echo worker (model ``echo``), with two echo workers
that answer with the whole conversation, with two mocker workers (model ``mock``), or with
one llama.cpp worker running the real SmolLM2 (model ``smol``); and real PostgreSQL and Redis
servers for the response store's shared backends."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator

import pytest
from tests.frontend.stack import Stack, WholePromptEcho, echo_engine, make_stack
from tests.helpers import assert_no_leaked_tasks
from tests.servers.postgres import PostgresServer, postgres_bin_dir
from tests.servers.process import require
from tests.servers.redis import RedisServer, redis_binary

from turnout.engines.llamacpp.engine import LlamaCppEngine
from turnout.engines.mocker import MockerConfig, MockerEngine, make_mocker_engines
from turnout.frontend.models.artifacts import CACHE_ENV


@pytest.fixture
async def echo_stack(gguf_path: str) -> AsyncIterator[Stack]:
    """A frontend with default settings and one echo worker (model ``echo``); checked for
    leaked tasks afterwards."""
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    await stack.add_worker(echo_engine(gguf_path), model_name="echo")
    await stack.wait_for_model("echo")
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


@pytest.fixture
async def whole_prompt_stack(gguf_path: str) -> AsyncIterator[Stack]:
    """A frontend with two echo workers that answer with the whole conversation (see
    ``WholePromptEcho``): model ``echo``, and model ``tools`` (hermes tool calls)."""
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    await stack.add_worker(WholePromptEcho(gguf_path), model_name="echo")
    await stack.add_worker(
        WholePromptEcho(gguf_path), model_name="tools", tool_call_parser="hermes"
    )
    await stack.wait_for_model("echo")
    await stack.wait_for_model("tools")
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


@pytest.fixture
async def two_mockers(gguf_path: str) -> AsyncIterator[tuple[Stack, list[MockerEngine]]]:
    """A frontend with default settings and two mocker workers at speedup 0 (model
    ``mock``, blocks of 16); checked for leaked tasks afterwards."""
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    config = MockerConfig(num_gpu_blocks=256, block_size=16, speedup_ratio=0)
    engines = make_mocker_engines(config, 2, model_path=gguf_path)
    for engine in engines:
        await stack.add_worker(engine, model_name="mock")
    await stack.wait_for_model("mock", instances=2)
    yield stack, engines
    await stack.close()
    await assert_no_leaked_tasks(before)


@pytest.fixture
async def smol_stack(gguf_path: str) -> AsyncIterator[Stack]:
    """A frontend with one llama.cpp worker on the real SmolLM2 GGUF (model ``smol``, two
    slots, one thread: the test machine is small and shared)."""
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    engine = LlamaCppEngine(str(gguf_path), n_ctx=2048, n_parallel=2, n_threads=1)
    await stack.add_worker(engine, model_name="smol")
    await stack.wait_for_model("smol")
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


@pytest.fixture(scope="session", autouse=True)
def _artifact_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("artifact_cache"))
    yield
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One real PostgreSQL for the session (tests take a fresh database each)."""
    require("postgres", postgres_bin_dir() is not None)
    with PostgresServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the session (tests flush what they use)."""
    require("redis-server", redis_binary() is not None)
    with RedisServer() as server:
        yield server
