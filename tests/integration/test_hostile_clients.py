"""Hostile clients against a real frontend process in front of a real mocker worker process:
a flood of silent connections, streams whose readers stop reading, and streams cancelled at
every point. Each used to take the frontend down or count as a server error; a memory
watchdog kills the frontend (failing the test) if a bound regresses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import resource
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from tests.integration.procs import ProcessSet, health, wait_until
from tests.watchdog import MemoryWatchdog

pytestmark = pytest.mark.slow

MODEL = "mock"
NUM_STALLED = 20


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessSet]:
    ps = ProcessSet(tmp_path)
    yield ps
    ps.close()


def start(procs: ProcessSet, *frontend_flags: str, speedup: str = "100") -> psutil.Process:
    """The frontend (returned) and one mocker worker; waits until the model is served."""
    front = procs.frontend(*frontend_flags)
    procs.worker("--engine", "mocker", "--model-name", MODEL, "--speedup-ratio", speedup,
                 "--block-size", "16", "--num-gpu-blocks", "8192")  # fmt: skip
    wait_until(lambda: bool(health(procs.url).get(MODEL)), 60, "the model", procs.logs)
    return psutil.Process(front.pid)


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"the open-file limit ({hard}) is below the {needed} this test needs")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


@pytest.mark.parametrize("max_connections", [None, "1000"])
def test_silent_connections_leave_probes_answering(
    procs: ProcessSet, max_connections: str | None
) -> None:
    """4,500 connections that never send a byte: with the default cap they all fit; with a
    cap of 1,000 those past it are turned away while the held ones are young, and the held
    ones are evicted once idle for a second. Either way /live and /health answer."""
    flags = ["--max-connections", max_connections] if max_connections else []
    front = start(procs, *flags)
    raise_fd_limit(6000)
    silent: list[socket.socket] = []
    with MemoryWatchdog(front.pid, limit_bytes=front.memory_info().rss + 600 * 2**20) as dog:
        try:
            for _ in range(4500):
                sock = socket.socket()
                sock.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    sock.connect(("127.0.0.1", procs.port))
                silent.append(sock)
            # The listener has seen them all (held or evicted) before the probes go.
            def seen() -> float:
                return metric(procs.url, "turnout_http_connections ") + sum(
                    metric(procs.url, "turnout_http_connections_closed_total", reason=r)
                    for r in ("evicted", "over_capacity")
                )

            wait_until(lambda: seen() >= 4500, 60, "the silent connections to be seen",
                       procs.logs)  # fmt: skip
            for path in ("/live", "/health"):
                wait_until(lambda p=path: httpx.get(procs.url + p, timeout=5).status_code == 200,
                           10, f"{path} to answer 200", procs.logs)  # fmt: skip
            turned_away = sum(
                metric(procs.url, "turnout_http_connections_closed_total", reason=r)
                for r in ("evicted", "over_capacity")
            )
            if max_connections:
                assert turned_away >= 4500 - 1000
                assert metric(procs.url, "turnout_http_connections ") <= 1000
            else:
                assert turned_away == 0
        finally:
            for sock in silent:
                sock.close()
    dog.check()


async def _open_stalled_stream(port: int, body: bytes) -> socket.socket:
    """A streamed request whose client reads the status line, then nothing more."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
            f"\r\ncontent-length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    await loop.sock_sendall(sock, head + body)
    first = await asyncio.wait_for(loop.sock_recv(sock, 12), 30)
    assert first.startswith(b"HTTP/1.1 200"), first
    return sock


def test_stalled_readers_are_bounded_then_cancelled(procs: ProcessSet) -> None:
    """20 streams of n=4 x 4,000 tokens whose clients stop reading: the frontend buffers a
    bounded amount for each (its RSS stays within bounds), and once a client has read
    nothing for --client-stall-timeout its request is cancelled on the worker (499)."""
    front = start(procs, "--client-stall-timeout", "4")
    body = json.dumps({
        "model": MODEL, "stream": True, "n": 4, "max_tokens": 4000, "ignore_eos": True,
        # Log-prob alternatives make each stream (~6 MB) larger than what the kernel's socket
        # buffers absorb (4 MB at most here), so the frontend itself must hold back.
        "logprobs": True, "top_logprobs": 5,
        "messages": [{"role": "user", "content": "tell me a long story " * 20}],
    }).encode()  # fmt: skip

    async def run() -> list[socket.socket]:
        return list(await asyncio.gather(*(_open_stalled_stream(procs.port, body)
                                           for _ in range(NUM_STALLED))))  # fmt: skip

    # One whole request of the same shape first: what it allocates once is not growth.
    warm = json.loads(body) | {"stream": False, "max_tokens": 200}
    assert httpx.post(procs.url + "/v1/chat/completions", json=warm, timeout=60).is_success
    base = front.memory_info().rss
    with MemoryWatchdog(front.pid, limit_bytes=base + 400 * 2**20) as dog:
        socks = asyncio.run(run())
        try:
            wait_until(
                lambda: metric(procs.url, "turnout_requests_total", status="499") >= NUM_STALLED,
                60,
                "the stalled streams to be cancelled",
                procs.logs,
            )
            wait_until(
                lambda: metric(procs.url, "turnout_inflight_requests") == 0,
                30,
                "no request in flight",
                procs.logs,
            )
            assert metric(procs.url, "turnout_http_connections_closed_total",
                          reason="write_stall") >= NUM_STALLED  # fmt: skip
        finally:
            for sock in socks:
                sock.close()
    dog.check()
    # What the sockets' buffers did not take was never produced, and what was streamed is
    # not kept: the frontend grew by far less than the streams' ~120 MB of SSE.
    assert dog.peak_bytes - base < 40 * 2**20, (dog.peak_bytes - base) / 2**20


async def _cancel_at_random(port: int, body: bytes, rng: random.Random) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
            f"\r\ncontent-length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    point = rng.choice(["body", "headers", "stream", "stream"])
    if point == "body":  # cut off mid-body
        writer.write(head + body[: len(body) // 2])
        await writer.drain()
    else:
        writer.write(head + body)
        await writer.drain()
        if point == "stream":
            await reader.read(rng.randint(1, 4000))
    sock = writer.get_extra_info("socket")
    if rng.random() < 0.5:  # a reset rather than a clean close
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    writer.transport.abort()


def test_cancelled_streams_are_not_server_errors(procs: ProcessSet) -> None:
    """1,000 requests abandoned mid-body, right after sending, or mid-stream (closed or
    reset): none is counted as a 5xx, and nothing is logged at ERROR."""
    start(procs, speedup="10")
    body = json.dumps({"model": MODEL, "prompt": "one two three four", "stream": True,
                       "max_tokens": 200}).encode()  # fmt: skip
    rng = random.Random(7)

    async def run() -> None:
        sem = asyncio.Semaphore(50)

        async def one() -> None:
            async with sem:
                await _cancel_at_random(procs.port, body, rng)

        await asyncio.gather(*(one() for _ in range(1000)))

    asyncio.run(run())
    wait_until(lambda: metric(procs.url, "turnout_inflight_requests") == 0, 60,
               "the abandoned requests to end", procs.logs)  # fmt: skip
    text = httpx.get(procs.url + "/metrics", timeout=10).text
    assert not re.search(r'turnout_requests_total\{[^}]*status="5\d\d"', text), text
    assert metric(procs.url, "turnout_requests_total", status="499") > 0
    frontend_log = "".join(p.read_text(errors="replace") for p in procs.tmp.glob("frontend-*"))
    assert " ERROR " not in frontend_log and "Traceback" not in frontend_log, frontend_log[-3000:]
    # The frontend still serves.
    r = httpx.post(procs.url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 3})  # fmt: skip
    assert r.status_code == 200

