"""Model artifacts travel with the card by content: fetched from workers over the request
plane, verified, cached; never opened from a worker's path.

Stacks are real: a memory store and the tcp request plane, workers and frontend in one
process but talking only through the planes. "Another host" is simulated by deleting the
model directory after the worker loaded it, and by giving workers their own artifact
registries (what separate processes would hold).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import msgspec
import pytest
from tests.frontend.stack import ENDPOINT
from tests.llm.conftest import make_small_hf_tokenizer

from turnout.engines.echo import EchoEngine
from turnout.engines.worker import Worker, artifact_handler
from turnout.errors import ConfigError
from turnout.frontend.models.artifacts import CACHE_ENV, ArtifactFetcher, DiskArtifactCache
from turnout.frontend.models.manager import ModelKind
from turnout.frontend.service import Frontend, FrontendConfig, free_port
from turnout.llm.artifacts import (
    CHUNK_SIZE,
    LOCAL_ARTIFACTS,
    ArtifactError,
    ArtifactRegistry,
    make_ref,
)
from turnout.llm.model_card import load_model_card
from turnout.protocols.model import (
    ARTIFACT_HANDLER,
    ArtifactRef,
    EndpointId,
    ModelDeploymentCard,
    mdc_key,
)
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery.memory import MemoryStore
from turnout.runtime.endpoint_client import EndpointClient
from turnout.runtime.serving import ServingInstance

WATCHER_LOG = "turnout.frontend.models.watcher"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_hf_model(d: Path) -> Path:
    """A small HF model directory (tokenizer trained here, a chat template, eos)."""
    d.mkdir(parents=True)
    make_small_hf_tokenizer().save(str(d / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    return d


async def _idle(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield payload


async def until(cond: Callable[[], bool], within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        while not cond():
            await asyncio.sleep(0.01)


@pytest.fixture
async def runtime() -> AsyncIterator[DistributedRuntime]:
    store = MemoryStore()
    rt = await DistributedRuntime.create(store=store, request_plane="tcp", lease_ttl=5.0)
    yield rt
    await rt.shutdown()
    await store.close()


async def serve_artifact(
    runtime: DistributedRuntime,
    refs: list[ArtifactRef],
    registry: ArtifactRegistry,
    ep: EndpointId = ENDPOINT,
) -> ServingInstance:
    """An instance of ``ep`` that serves ``refs`` from ``registry``, and nothing else."""
    serving = await runtime.endpoint(ep).serve(_idle)
    serving.add_handler(ARTIFACT_HANDLER, artifact_handler(refs, registry))
    return serving


class CountingRegistry(ArtifactRegistry):
    """Counts how often its bytes are served."""

    def __init__(self) -> None:
        super().__init__()
        self.served = 0

    def get(self, sha256: str) -> bytes | None:
        self.served += 1
        return super().get(sha256)


class TamperingRegistry(ArtifactRegistry):
    """Serves the announced number of bytes, one of them flipped (corruption in transit, or
    a worker whose file changed under it)."""

    def get(self, sha256: str) -> bytes | None:
        data = super().get(sha256)
        return None if data is None else bytes([data[0] ^ 1]) + data[1:]


# -- the fetcher over a real request plane -------------------------------------------------------


async def test_round_trip_in_chunks_verified_and_cached(
    runtime: DistributedRuntime, tmp_path: Path
) -> None:
    data = bytes(range(256)) * (5 * CHUNK_SIZE // 256) + b"tail"  # 5 chunks and a bit
    registry = CountingRegistry()
    ref = registry.publish("blob.bin", "opaque", data)
    chunks: list[int] = []
    serving = await runtime.endpoint(ENDPOINT).serve(_idle)
    handler = artifact_handler([ref], registry)

    async def counting(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        async for chunk in handler(payload, ctx):
            chunks.append(len(chunk))
            yield chunk

    serving.add_handler(ARTIFACT_HANDLER, counting)
    client = await runtime.endpoint(ENDPOINT).client()
    disk = DiskArtifactCache(tmp_path / "cache")
    fetcher = ArtifactFetcher(disk=disk)

    assert await fetcher.get_bytes(ref, client, prefer=serving.instance_id) == data
    assert fetcher.fetches == 1
    assert chunks == [CHUNK_SIZE] * 5 + [4]
    cached = disk.path(ref.sha256)
    assert cached.read_bytes() == data and cached.parent.name == ref.sha256[:2]
    assert not [p for p in cached.parent.iterdir() if p != cached]  # no temporary left

    # A disk hit costs no fetch, in this fetcher and in a new one (a restarted frontend).
    assert await fetcher.get_bytes(ref, client) == data
    assert await ArtifactFetcher(disk=disk).get_bytes(ref, client) == data
    assert fetcher.fetches == 1 and registry.served == 1

    # A corrupt cache entry is dropped and fetched again.
    cached.write_bytes(b"x" * len(data))
    again = ArtifactFetcher(disk=disk)
    assert await again.get_bytes(ref, client) == data
    assert again.fetches == 1 and cached.read_bytes() == data


async def test_tokenizer_loaded_once_per_content(
    runtime: DistributedRuntime, tmp_path: Path
) -> None:
    model = write_hf_model(tmp_path / "m")
    data = (model / "tokenizer.json").read_bytes()
    registry = CountingRegistry()
    ref = registry.publish("tokenizer.json", "hf_tokenizer_json", data)
    serving = await serve_artifact(runtime, [ref], registry)
    client = await runtime.endpoint(ENDPOINT).client()
    fetcher = ArtifactFetcher(disk=None)

    first = await fetcher.tokenizer(ref, client, prefer=serving.instance_id, eos_token="</s>")
    again = await asyncio.gather(
        *(fetcher.tokenizer(ref, client, eos_token="</s>") for _ in range(5))
    )
    assert all(t is first for t in again)
    assert fetcher.fetches == 1 and registry.served == 1
    assert first.sha256 == ref.sha256 and first.eos_token_id == first.token_to_id("</s>")
    assert first.decode(first.encode("hello world")) == "hello world"


async def test_dead_or_silent_instance_falls_back_to_another(
    runtime: DistributedRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="turnout.frontend.models.artifacts")
    data = b"x" * 1000
    ref = make_ref("blob", "opaque", data)
    good_registry = ArtifactRegistry()
    good_registry.publish("blob", "opaque", data)

    gone = await serve_artifact(runtime, [ref], good_registry)
    silent = await runtime.endpoint(ENDPOINT).serve(_idle)
    hung = asyncio.Event()

    async def never_answers(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        hung.set()
        await asyncio.Event().wait()
        yield b""

    silent.add_handler(ARTIFACT_HANDLER, never_answers)
    good = await serve_artifact(runtime, [ref], good_registry)
    client = await runtime.endpoint(ENDPOINT).client()
    await gone.stop()  # the worker left (its card may still be in a frontend's hands)

    fetcher = ArtifactFetcher(disk=None, timeout=10.0, attempt_timeout=0.3)
    assert await fetcher.get_bytes(ref, client, prefer=gone.instance_id) == data
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"instance {gone.instance_id:x}:" in warning
    caplog.clear()

    fetcher = ArtifactFetcher(disk=None, timeout=10.0, attempt_timeout=0.3)
    assert await fetcher.get_bytes(ref, client, prefer=silent.instance_id) == data
    assert hung.is_set()  # the silent one was asked, timed out, and another one answered
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"from instance {good.instance_id:x} after failures" in warning
    assert f"instance {silent.instance_id:x}: timed out" in warning


async def test_fetch_fails_with_every_reason_within_its_deadline(
    runtime: DistributedRuntime,
) -> None:
    data = b"y" * 100
    registry = TamperingRegistry()
    ref = registry.publish("blob", "opaque", data)
    bad = await serve_artifact(runtime, [ref], registry)
    other = await serve_artifact(runtime, [], registry)  # announces no such artifact
    client = await runtime.endpoint(ENDPOINT).client()
    fetcher = ArtifactFetcher(disk=None, timeout=5.0, rounds=2)

    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(ArtifactError) as err:
        await fetcher.get_bytes(ref, client, prefer=bad.instance_id)
    assert loop.time() - start < 5.0
    message = str(err.value)
    assert f"instance {bad.instance_id:x}: checksum mismatch" in message
    assert f"instance {other.instance_id:x}:" in message and "does not serve" in message
    assert fetcher.fetches == 4  # two rounds over two instances


# -- the whole stack -----------------------------------------------------------------------------


async def start_frontend(
    runtime: DistributedRuntime, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> Frontend:
    """A frontend with an empty artifact cache of its own at ``cache`` (as an operator would
    configure it: through the environment)."""
    monkeypatch.setenv(CACHE_ENV, str(cache))
    frontend = Frontend(FrontendConfig(port=free_port()), runtime=runtime)
    await frontend.start()
    return frontend


async def chat(frontend: Frontend, model: str, text: str) -> str:
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        resp = await http.post(
            "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": text}]},
        )
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["message"]["content"]
    assert isinstance(content, str)
    return content


async def test_frontend_serves_without_the_workers_files(
    runtime: DistributedRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker loads its model, then its model directory disappears: a frontend that
    opened any path the card came from could not build the model; this one fetches it."""
    model = write_hf_model(tmp_path / "worker-disk" / "tiny")
    worker = Worker(runtime, EchoEngine(str(model)), ENDPOINT, model_name="tiny")
    await worker.start()
    shutil.rmtree(tmp_path / "worker-disk")
    assert worker.card is not None and worker.card.tokenizer is not None
    assert str(model) not in msgspec.json.encode(worker.card).decode()

    frontend = await start_frontend(runtime, tmp_path / "cache", monkeypatch)
    try:
        await until(lambda: "tiny" in frontend.manager.list_models_of(ModelKind.CHAT))
        assert "tiny" in frontend.manager.list_models_of(ModelKind.COMPLETIONS)
        # The echo engine returns the prompt's tokens: the frontend's templating and
        # tokenizing both ran with the fetched tokenizer.
        assert "hello world" in await chat(frontend, "tiny", "hello world")
        # Chat and completions share one tokenizer, fetched once.
        assert frontend.factory is not None and frontend.factory.artifacts.fetches == 1
        assert DiskArtifactCache(tmp_path / "cache").get(worker.card.tokenizer) is not None
    finally:
        await worker.stop(drain_timeout=1.0)
        await frontend.stop()


async def test_bad_artifact_leaves_the_instance_out_until_a_good_one_comes(
    runtime: DistributedRuntime,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger=WATCHER_LOG)
    model = write_hf_model(tmp_path / "tiny")
    card = load_model_card(model, endpoint=ENDPOINT)
    assert card.tokenizer is not None
    data = LOCAL_ARTIFACTS.get(card.tokenizer.sha256)
    assert data is not None
    tampering = TamperingRegistry()
    tampering.publish("tokenizer.json", "hf_tokenizer_json", data)
    frontend = await start_frontend(runtime, tmp_path / "cache", monkeypatch)
    assert frontend.factory is not None
    frontend.factory.artifacts.rounds = 1  # fail fast: this instance never gets better
    bad = Worker(runtime, EchoEngine(str(model)), ENDPOINT, model_name="tiny", artifacts=tampering)
    good = Worker(runtime, EchoEngine(str(model)), ENDPOINT, model_name="tiny")
    try:
        await bad.start()

        def errors() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]

        await until(lambda: bool(errors()))
        assert frontend.manager.list_models() == []  # nothing half-built
        (error,) = errors()
        assert "tiny" in error and "checksum mismatch" in error
        # The reason, not a traceback.
        assert not any(r.exc_info for r in caplog.records if r.levelno >= logging.ERROR)

        await good.start()
        await until(lambda: "tiny" in frontend.manager.list_models_of(ModelKind.CHAT))
        assert good.serving is not None and bad.serving is not None
        entries = frontend.manager.entries_for_model("tiny")
        assert [c.instance_id for c in entries] == [good.serving.instance_id]
        # Discovery announces both instances; only the accepted one is routed to.
        await until(lambda: frontend.manager.model_instances("tiny") != [])
        assert frontend.manager.model_instances("tiny") == [good.serving.instance_id]
        for _ in range(4):
            assert "hello" in await chat(frontend, "tiny", "hello")
        assert len(errors()) == 1  # logged once
    finally:
        await bad.stop(drain_timeout=1.0)
        await good.stop(drain_timeout=1.0)
        await frontend.stop()


async def test_worker_refuses_a_card_whose_artifacts_it_cannot_serve(
    runtime: DistributedRuntime, tmp_path: Path
) -> None:
    model = write_hf_model(tmp_path / "tiny")
    worker = Worker(runtime, EchoEngine(str(model)), ENDPOINT, artifacts=ArtifactRegistry())
    with pytest.raises(ConfigError, match=r"does not hold \(tokenizer\.json\)"):
        await worker.start()
    await worker.engine.stop()


async def test_card_in_the_store_names_content_only(
    runtime: DistributedRuntime, tmp_path: Path
) -> None:
    model = write_hf_model(tmp_path / "tiny")
    worker = Worker(runtime, EchoEngine(str(model)), ENDPOINT)
    serving = await worker.start()
    try:
        kv = await runtime.store.get(mdc_key(ENDPOINT, serving.instance_id))
        assert kv is not None
        raw = kv.value
        card = msgspec.json.decode(raw, type=ModelDeploymentCard)
        tokenizer = json.loads(raw)["tokenizer"]
        assert set(tokenizer) == {"name", "kind", "sha256", "size"}
        data = (model / "tokenizer.json").read_bytes()
        assert tokenizer["sha256"] == hashlib.sha256(data).hexdigest()
        assert tokenizer["size"] == len(data)
        assert card.tokenizer is not None and str(tmp_path) not in raw.decode()
    finally:
        await worker.stop(drain_timeout=1.0)


def test_disk_cache_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    cache = DiskArtifactCache.from_env()
    assert cache is not None and cache.root == tmp_path / "c"
    monkeypatch.setenv(CACHE_ENV, "off")
    assert DiskArtifactCache.from_env() is None
    monkeypatch.delenv(CACHE_ENV)
    default = DiskArtifactCache.from_env()
    assert default is not None and default.root == Path.home() / ".cache/turnout/artifacts"


async def test_no_instance_to_ask(runtime: DistributedRuntime) -> None:
    """A model whose instances are all gone fails at once, saying so."""
    client: EndpointClient = await runtime.endpoint(ENDPOINT).client()
    fetcher = ArtifactFetcher(disk=None, timeout=0.5, rounds=1)
    with pytest.raises(ArtifactError, match="no live instance to ask"):
        await fetcher.get_bytes(make_ref("b", "opaque", b"z"), client)


def test_a_checksum_can_only_name_a_file_inside_the_cache(tmp_path: Path) -> None:
    """A card's checksum comes from the discovery store: one that is not a sha256 digest
    (``../``, an absolute path) is refused when the card is decoded, and the disk cache
    refuses to turn it into a path anyway."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for bad in ("../../victim.txt", str(victim), "AB" * 32, "0" * 63):
        body = {"name": "tokenizer.json", "kind": "hf_tokenizer_json", "sha256": bad, "size": 1}
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(msgspec.json.encode(body), type=ArtifactRef)
        with pytest.raises(ValueError, match="not a sha256"):
            DiskArtifactCache(tmp_path / "cache").path(bad)
    assert victim.read_text() == "keep me"
