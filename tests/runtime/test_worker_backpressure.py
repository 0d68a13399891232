"""Back-pressure from a consumer to the engine, across a real worker process over tcp.

A client that stops reading its streams stops the request plane's credit, which stops the
worker's handler, which stops pulling from the mocker, whose scheduler pauses those requests:
the worker's load reports show every request still running, no step taken, its KV blocks
flat, and its RSS stays put. Reading again resumes every stream to its last token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import psutil
import pytest
from tests.watchdog import MemoryWatchdog

from turnout.protocols.kv import LOAD_TOPIC, LoadReport
from turnout.protocols.llm import (
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    StopConditions,
)
from turnout.protocols.model import EndpointId
from turnout.runtime.context import RequestContext
from turnout.runtime.planes import PlanesConfig, open_runtime

pytestmark = pytest.mark.slow

ENDPOINT = EndpointId(namespace="bp", component="backend", name="generate")
NUM_STREAMS = 20
MAX_TOKENS = 4000
PROMPT_LEN = 32
BLOCK_SIZE = 16
#: Tokens each stalled stream may have cost, at most: far below MAX_TOKENS (what it would
#: cost if the engine ran on), with room for the mocker's stream, the worker's buffer and
#: the plane's window, whatever the batching of items.
STALLED_TOKENS = 1000
#: Growth of the worker's RSS allowed while its streams stay stalled (measured: ~0.1 MiB;
#: ~15 MiB when the engine ran on, buffering all 80,000 tokens).
RSS_AT_REST = 8 * 1024 * 1024
#: Growth of the worker's RSS past which the watchdog kills it (a bound broken outright).
RSS_SLACK = 64 * 1024 * 1024

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(LLMEngineOutput).decode
_decode_load = msgspec.msgpack.Decoder(LoadReport).decode


@dataclass
class WorkerProcess:
    """One ``turnout worker`` on a file store in ``tmp``; killed at the end."""

    tmp: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def store_path(self) -> str:
        return str(self.tmp / "discovery.sqlite")

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        with open(self.tmp / "worker.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "turnout", "worker", "--store", "file",
                 "--store-path", self.store_path, "--lease-ttl", "2", *args],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        return self.proc

    def logs(self) -> str:
        path = self.tmp / "worker.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[WorkerProcess]:
    ps = WorkerProcess(tmp_path)
    yield ps
    ps.close()


def request(i: int) -> bytes:
    prompt = [1000 + i * 131 + j for j in range(PROMPT_LEN)]
    return _encode(
        PreprocessedRequest(
            model="mock", token_ids=prompt, stop_conditions=StopConditions(max_tokens=MAX_TOKENS)
        )
    )


async def until(
    predicate: Callable[[], bool],
    what: str,
    timeout: float,
    logs: Callable[[], str] | None = None,
) -> None:
    """Poll ``predicate`` under a deadline; the failure names ``what`` (and the logs)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            detail = logs() if logs is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{detail}")
        await asyncio.sleep(0.05)


async def read_rest(stream: AsyncIterator[bytes]) -> list[LLMEngineOutput]:
    return [_decode(item) async for item in stream]


async def test_a_stalled_consumer_pauses_the_engine_in_a_worker_process(
    procs: WorkerProcess,
) -> None:
    planes = ["--request-plane", "tcp", "--event-plane", "zmq", "--log-level", "warning"]
    worker = procs.start(
        *planes, "--engine", "mocker", "--model-name", "mock", "--endpoint", ENDPOINT.path(),
        "--block-size", str(BLOCK_SIZE), "--speedup-ratio", "100",
    )  # fmt: skip
    runtime = await open_runtime(
        PlanesConfig(
            store="file", store_path=procs.store_path, request_plane="tcp", event_plane="zmq"
        )
    )
    loads: list[LoadReport] = []
    consumer: asyncio.Task[None] | None = None
    try:
        client = await runtime.endpoint(ENDPOINT).client()
        await until(
            lambda: bool(client.instance_ids()) or worker.poll() is not None,
            "the worker to register", 60, procs.logs,
        )  # fmt: skip
        assert worker.poll() is None, f"the worker exited\n{procs.logs()}"
        (instance_id,) = client.instance_ids()
        sub = await runtime.event_plane.subscribe(
            ENDPOINT.namespace, ENDPOINT.component, LOAD_TOPIC
        )

        async def consume() -> None:
            async for event in sub:
                report = _decode_load(event.payload)
                if report.worker_id == instance_id:
                    loads.append(report)

        consumer = asyncio.create_task(consume())

        streams = [
            client.stream(instance_id, request(i), RequestContext(f"stalled-{i}"))
            for i in range(NUM_STREAMS)
        ]
        firsts = [[_decode(await anext(s)) for _ in range(3)] for s in streams]
        # From here on nobody reads: the engine must come to rest with every request paused.

        def at_rest() -> bool:
            """The last two reports: every request running, no step between them."""
            last = loads[-2:]
            return len(last) == 2 and all(
                r.num_running == NUM_STREAMS and not r.steps for r in last
            ) and last[0].active_decode_blocks == last[1].active_decode_blocks  # fmt: skip

        await until(at_rest, "the engine to rest with every stream stalled", 60, procs.logs)
        blocks = loads[-1].active_decode_blocks
        per_stream = -(-(PROMPT_LEN + STALLED_TOKENS) // BLOCK_SIZE)
        assert blocks <= NUM_STREAMS * per_stream, (blocks, NUM_STREAMS * per_stream)

        rss = psutil.Process(worker.pid).memory_info().rss
        with MemoryWatchdog(worker.pid, limit_bytes=rss + RSS_SLACK) as watchdog:
            # Two more beats at rest: nothing moves while the consumer stays away.
            seen = len(loads)
            await until(lambda: len(loads) >= seen + 2, "two more load reports", 30)
            assert at_rest() and loads[-1].active_decode_blocks == blocks
            grown = psutil.Process(worker.pid).memory_info().rss - rss
            assert grown < RSS_AT_REST, f"the worker grew {grown} bytes at rest"

            # Reading again resumes every stream, to exactly its last token.
            rests = await asyncio.wait_for(asyncio.gather(*map(read_rest, streams)), 120)
        watchdog.check()
        for first, rest in zip(firsts, rests, strict=True):
            outs = first + rest
            assert sum(len(o.token_ids) for o in outs) == MAX_TOKENS
            assert outs[-1].finish_reason is FinishReason.LENGTH
        await until(lambda: bool(loads) and loads[-1].num_running == 0, "the engine to go idle", 30)
    finally:
        if consumer is not None:
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
        await runtime.shutdown()
