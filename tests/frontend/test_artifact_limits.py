"""An artifact's size is a claim from whoever wrote the card: the frontend never buffers past
``--max-artifact-bytes``, nor past what the card announced.

Workers here are real served instances on the tcp request plane whose artifact handler
makes its bytes as they are asked for (a gigabyte costs them nothing), and counts them. The
last test runs a real ``turnout frontend`` process under a memory watchdog while such a
worker offers it a 1 GiB tokenizer.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest
from tests.frontend.stack import ENDPOINT
from tests.watchdog import MemoryWatchdog

from turnout.cli.frontend import frontend_config
from turnout.cli.main import build_parser
from turnout.errors import ConfigError
from turnout.frontend.models.artifacts import ArtifactFetcher
from turnout.frontend.service import free_port
from turnout.llm.artifacts import CHUNK_SIZE, ArtifactError
from turnout.llm.model_card import load_model_card
from turnout.protocols.card_bounds import DEFAULT_MAX_ARTIFACT_BYTES
from turnout.protocols.model import ARTIFACT_HANDLER, ArtifactRef, mdc_key
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery import FileStore
from turnout.runtime.discovery.memory import MemoryStore
from turnout.runtime.serving import ServingInstance

MiB = 1024 * 1024
GiB = 1024 * MiB
FAKE_SHA = "ab" * 32


def ref_of(size: int) -> ArtifactRef:
    return ArtifactRef(name="tokenizer.json", kind="hf_tokenizer_json", sha256=FAKE_SHA, size=size)


@dataclass
class Offer:
    """An artifact handler that sends ``size`` zero bytes (or without end), made as asked."""

    size: int | None
    calls: int = 0
    sent: int = 0
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        self.calls += 1
        chunk = b"\0" * CHUNK_SIZE
        try:
            while self.size is None or self.sent < self.size:
                piece = chunk if self.size is None else chunk[: self.size - self.sent]
                self.sent += len(piece)
                yield piece
        finally:
            self.closed.set()


async def _idle(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
    yield payload


@pytest.fixture
async def runtime() -> AsyncIterator[DistributedRuntime]:
    store = MemoryStore()
    rt = await DistributedRuntime.create(store=store, request_plane="tcp", lease_ttl=5.0)
    yield rt
    await rt.shutdown()
    await store.close()


async def offering(runtime: DistributedRuntime, offer: Offer) -> ServingInstance:
    return await runtime.endpoint(ENDPOINT).serve(_idle, handlers={ARTIFACT_HANDLER: offer.handle})


async def test_an_artifact_announced_past_the_bound_is_refused_before_any_byte(
    runtime: DistributedRuntime,
) -> None:
    offer = Offer(size=4 * MiB)
    serving = await offering(runtime, offer)
    client = await runtime.endpoint(ENDPOINT).client()
    try:
        fetcher = ArtifactFetcher(disk=None, max_bytes=1 * MiB)
        with pytest.raises(ArtifactError, match=r"announced at 4194304 bytes.*at most 1048576"):
            await fetcher.get_bytes(ref_of(4 * MiB), client, prefer=serving.instance_id)
        assert (offer.calls, fetcher.fetches) == (0, 0)
    finally:
        await client.close()
        await serving.stop()


@pytest.mark.parametrize(
    ("announced", "max_bytes", "why"),
    [
        (1 * MiB, 8 * MiB, "sent more than the 1048576 bytes announced"),
        # A bound lowered after the card was read (or a card that bypassed the watcher).
        (8 * MiB, 1 * MiB, "announced at 8388608 bytes"),
    ],
)
async def test_a_worker_sending_more_is_cut_off_mid_stream(
    runtime: DistributedRuntime, announced: int, max_bytes: int, why: str
) -> None:
    offer = Offer(size=None)  # never stops
    serving = await offering(runtime, offer)
    client = await runtime.endpoint(ENDPOINT).client()
    try:
        fetcher = ArtifactFetcher(disk=None, max_bytes=8 * MiB, rounds=1)
        fetcher.max_bytes = max_bytes
        with pytest.raises(ArtifactError, match=why):
            await fetcher.get_bytes(ref_of(announced), client, prefer=serving.instance_id)
        if offer.calls:
            # Cut off: the handler is cancelled, having run at most a credit window ahead.
            async with asyncio.timeout(5):
                await offer.closed.wait()
            assert offer.sent <= announced + 64 * CHUNK_SIZE + CHUNK_SIZE, offer.sent
    finally:
        await client.close()
        await serving.stop()


def test_the_bound_is_a_frontend_flag() -> None:
    parse = build_parser().parse_args
    assert frontend_config(parse(["frontend"])).max_artifact_bytes == DEFAULT_MAX_ARTIFACT_BYTES
    assert 256 * MiB == DEFAULT_MAX_ARTIFACT_BYTES
    config = frontend_config(parse(["frontend", "--max-artifact-bytes", str(3 * MiB)]))
    assert config.max_artifact_bytes == 3 * MiB
    with pytest.raises(ConfigError, match="--max-artifact-bytes must be at least 1"):
        ArtifactFetcher(disk=None, max_bytes=0)


# -- a real frontend process ----------------------------------------------------------------------


@pytest.fixture
def frontend_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """``turnout frontend`` on a file store in ``tmp_path``, with default bounds."""
    port = free_port()
    log_path = tmp_path / "frontend.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "turnout", "frontend", "--port", str(port),
             "--store", "file", "--store-path", str(tmp_path / "store.sqlite"),
             "--lease-ttl", "2", "--artifact-cache", "off"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        yield proc, port, log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _log(path: Path) -> str:
    return path.read_text(errors="replace")


async def _until_up(proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(timeout=2) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(await asyncio.to_thread(_log, log_path))
            try:
                if (await http.get(f"http://127.0.0.1:{port}/live")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError("the frontend did not start: " + await asyncio.to_thread(_log, log_path))


@pytest.mark.slow
async def test_a_frontend_offered_a_gigabyte_tokenizer_stays_small(
    tmp_path: Path,
    gguf_path: str,
    frontend_process: tuple[subprocess.Popen[bytes], int, Path],
) -> None:
    """A worker's card announces a 1 GiB tokenizer and the worker would send it all: the
    frontend refuses the card from its announced size, with one line, asks for nothing, and
    does not grow; it keeps answering."""
    proc, port, log_path = frontend_process
    await _until_up(proc, port, log_path)
    store = FileStore(tmp_path / "store.sqlite")
    runtime = await DistributedRuntime.create(store=store, request_plane="tcp", lease_ttl=2.0)
    offer = Offer(size=GiB)
    card = await asyncio.to_thread(load_model_card, gguf_path, endpoint=ENDPOINT)

    def records(instance_id: int) -> list[tuple[str, bytes]]:
        mine = msgspec.structs.replace(
            card, display_name="huge", instance_id=instance_id, tokenizer=ref_of(GiB)
        )
        return [(mdc_key(ENDPOINT, instance_id), msgspec.json.encode(mine))]

    baseline = psutil.Process(proc.pid).memory_info().rss
    try:
        with MemoryWatchdog(proc.pid, limit_bytes=baseline + 300 * MiB) as watchdog:
            serving = await runtime.endpoint(ENDPOINT).serve(
                _idle, records=records, handlers={ARTIFACT_HANDLER: offer.handle}
            )
            deadline = time.monotonic() + 30
            while "field=tokenizer.size" not in await asyncio.to_thread(_log, log_path):
                assert proc.poll() is None, "the frontend died (killed by the watchdog?)"
                assert time.monotonic() < deadline, await asyncio.to_thread(_log, log_path)
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.3)  # a few watchdog ticks after the refusal
        watchdog.check()
        grown = watchdog.peak_bytes - baseline
        assert grown < 64 * MiB, f"the frontend grew by {grown / MiB:.0f} MiB"
        assert offer.calls == 0 and offer.sent == 0
        log = await asyncio.to_thread(_log, log_path)
        assert log.count("model card refused") == 1, log[-3000:]
        async with httpx.AsyncClient(timeout=5) as http:
            models = (await http.get(f"http://127.0.0.1:{port}/v1/models")).json()["data"]
        assert models == []
        await serving.stop()
    finally:
        await runtime.shutdown()
        await store.close()
