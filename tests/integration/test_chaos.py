"""Chaos across real processes: workers killed (SIGKILL) or stopped (SIGTERM) under streaming
load, clients that vanish mid-stream, and 10,000 clients at once against admission limits.

Every stack is a frontend and mocker workers on 127.0.0.1 (file store, tcp request plane).
The mocker's tokens depend only on the prompt and ``--seed``, and a migrated request resumes
with exactly the tokens an uninterrupted run would produce, so every stream's text can be
compared with a reference run of the same prompt on an undisturbed stack. Every loop is
bounded in count and time; the deadlines are generous for a slow 2-core CI machine and no
assertion depends on how fast it is within them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
from benchmarks.bench_http import one_request
from tests.integration.procs import ProcessSet, health, wait_until

pytestmark = pytest.mark.slow

MODEL = "mock"
#: Streams run concurrently in the streaming tests.
STREAMS = 16
#: Tokens per stream: at ``SPEEDUP`` a stream lasts ~2.5 s, long enough to be hit mid-way.
MAX_TOKENS = 100
SPEEDUP = "0.5"
#: Worker flags shared by every stack: same seed everywhere, so any worker gives the same text.
MOCKER = ("--engine", "mocker", "--model-name", MODEL, "--seed", "7")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessSet]:
    ps = ProcessSet(tmp_path)
    yield ps
    ps.close()


def prompt(i: int) -> list[int]:
    """Token ids of the ``i``-th prompt: distinct per stream, so a mix-up would show."""
    return [100 + i, 200 + 3 * i, 300 + 5 * i, 400 + 7 * i, 11, 12, 13, 14]


@dataclass
class StreamResult:
    """What one streamed completion delivered."""

    status: int = 0
    text: str = ""
    chunks: int = 0
    finish: str | None = None
    usage: int | None = None
    migrations: int = 0
    error: str | None = None


def stream_completion(url: str, i: int, out: StreamResult) -> None:
    """Stream prompt ``i`` to completion, recording its text, finish reason, usage, errors."""
    body = {"model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "nvext": {"extra_fields": ["migrations"]}}  # fmt: skip
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            out.status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"])
                    continue
                for choice in chunk.get("choices", []):
                    out.text += choice.get("text") or ""
                    out.chunks += 1
                    out.finish = choice.get("finish_reason") or out.finish
                out.migrations = max(
                    out.migrations, (chunk.get("nvext") or {}).get("migrations") or 0
                )
                if chunk.get("usage"):
                    out.usage = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        out.error = repr(exc)


@dataclass
class StreamBatch:
    """``STREAMS`` concurrent streams, one thread each."""

    results: list[StreamResult] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    @classmethod
    def start(cls, url: str, n: int = STREAMS) -> StreamBatch:
        batch = cls(results=[StreamResult() for _ in range(n)])
        for i, r in enumerate(batch.results):
            t = threading.Thread(target=stream_completion, args=(url, i, r), daemon=True)
            batch.threads.append(t)
            t.start()
        return batch

    def join(self, timeout: float = 90) -> list[StreamResult]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "streams still running at the deadline"
        return self.results


def instances(url: str) -> list[str]:
    return health(url).get(MODEL, [])


def start_stack(procs: ProcessSet, workers: int, *frontend_flags: str) -> None:
    """A frontend and ``workers`` mocker workers, waited for until all serve the model."""
    procs.frontend(*frontend_flags)
    for _ in range(workers):
        procs.worker(*MOCKER, "--speedup-ratio", SPEEDUP)
    wait_until(lambda: len(instances(procs.url)) == workers, 60, "the workers", procs.logs)


def reference_texts(url: str) -> list[str]:
    """Each prompt's text from a run nothing disturbs (the stack is quiet)."""
    results = StreamBatch.start(url).join()
    for r in results:
        assert r.status == 200 and r.error is None and r.usage == MAX_TOKENS, r
    return [r.text for r in results]


def assert_whole(results: list[StreamResult], reference: list[str], logs: str) -> None:
    """Every stream succeeded with exactly the reference text: nothing lost, repeated, mixed."""
    for i, r in enumerate(results):
        assert r.status == 200 and r.error is None, (i, r, logs)
        assert r.finish == "length" and r.usage == MAX_TOKENS, (i, r)
        assert r.text == reference[i], (
            f"stream {i} differs from its reference:\n{r}\n{reference[i]!r}"
        )


def metric(url: str, name: str) -> float:
    """The sum of a frontend metric's samples (over its labels); 0 when it has none yet."""
    text = httpx.get(url + "/metrics", timeout=10).text
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


def wait_streaming(batch: StreamBatch, chunks: int = 5) -> None:
    """Wait until every stream of ``batch`` has delivered ``chunks`` chunks (mid-stream)."""
    wait_until(
        lambda: all(r.chunks >= chunks for r in batch.results), 30, "the streams to flow",
        lambda: str(batch.results),
    )  # fmt: skip


# -- kill -9 ---------------------------------------------------------------------------------


def test_kill_9_workers_under_streaming_load(procs: ProcessSet) -> None:
    """SIGKILL one of three workers mid-stream, then restart it: every stream completes with
    the text an undisturbed run gives, and the restarted worker serves the same texts too."""
    start_stack(procs, 3, "--migration-limit", "3")
    reference = reference_texts(procs.url)
    before = metric(procs.url, "turnout_migrations_total")

    victim = procs.procs[1]
    batch = StreamBatch.start(procs.url)
    wait_streaming(batch)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    procs.worker(*MOCKER, "--speedup-ratio", SPEEDUP)  # the restart
    results = batch.join()
    assert_whole(results, reference, procs.logs())
    # Round-robin spread the streams over all three: the victim's moved.
    assert metric(procs.url, "turnout_migrations_total") > before
    assert any(r.migrations for r in results), results

    # The dead instance's lease (2 s) ends and the restarted one joins: three again, and a
    # second wave over all of them, the newcomer included, gives the same texts.
    wait_until(lambda: len(instances(procs.url)) == 3, 60, "the restarted worker", procs.logs)
    assert_whole(StreamBatch.start(procs.url).join(), reference, procs.logs())


# -- SIGTERM ---------------------------------------------------------------------------------


def test_sigterm_a_worker_under_load_fails_no_request(procs: ProcessSet) -> None:
    """A worker told to stop (SIGTERM) leaves discovery, finishes or hands over its streams,
    and exits cleanly: no request fails and every text is whole."""
    procs.frontend("--migration-limit", "3")
    procs.worker(*MOCKER, "--speedup-ratio", SPEEDUP)
    procs.worker(*MOCKER, "--speedup-ratio", SPEEDUP)
    # A drain shorter than the streams: it finishes none of them, so its streams are cut
    # and must be handed over (migrated) whole.
    victim = procs.worker(*MOCKER, "--speedup-ratio", SPEEDUP, "--drain-timeout", "0.3")
    wait_until(lambda: len(instances(procs.url)) == 3, 60, "the workers", procs.logs)
    reference = reference_texts(procs.url)

    batch = StreamBatch.start(procs.url)
    wait_streaming(batch)
    os.killpg(victim.pid, signal.SIGTERM)
    results = batch.join()
    assert_whole(results, reference, procs.logs())
    assert victim.wait(timeout=30) == 0, procs.logs()
    assert metric(procs.url, "turnout_migrations_total") > 0, "no stream was handed over"

    # Requests after it left go to the two that remain.
    wait_until(lambda: len(instances(procs.url)) == 2, 30, "the worker to leave", procs.logs)
    assert_whole(StreamBatch.start(procs.url).join(), reference, procs.logs())


# -- clients that disconnect ------------------------------------------------------------------


def worker_loads(procs: ProcessSet) -> list[dict[str, float]]:
    """Every instance's load report (running, waiting, kv_usage), via ``turnout status``."""
    out = subprocess.run(
        [sys.executable, "-m", "turnout", "status", "--json", "--load-wait", "2",
         *procs.common()],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    status = json.loads(out.stdout)
    return [
        inst.get("load") or {} for ns in status["namespaces"].values() for inst in ns["instances"]
    ]


def open_stream(port: int, i: int) -> socket.socket:
    """A raw connection with a long streamed completion in flight; returns once the first
    bytes of the body arrived (the request is running on a worker)."""
    body = json.dumps({"model": MODEL, "prompt": prompt(i), "max_tokens": 2000,
                       "ignore_eos": True, "stream": True}).encode()  # fmt: skip
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    received = b""
    while b"data: " not in received:
        data = sock.recv(65536)
        assert data, f"connection closed before the stream began: {received!r}"
        received += data
    return sock


def test_disconnected_clients_leave_nothing_running(procs: ProcessSet) -> None:
    """Clients that drop their connections mid-stream: the workers stop their requests and
    free their KV blocks, and the frontend's in-flight gauge returns to zero."""
    start_stack(procs, 2)
    socks = [open_stream(procs.port, i) for i in range(24)]
    assert metric(procs.url, "turnout_inflight_requests") == 24
    loads = worker_loads(procs)
    assert sum(load.get("running", 0) for load in loads) > 0, (
        loads
    )  # the check below means something
    assert any(load.get("kv_usage", 0) > 0 for load in loads), loads

    # Half close politely (FIN), half abort (RST): both are what vanished clients do.
    for n, sock in enumerate(socks):
        if n % 2:
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
        sock.close()

    wait_until(lambda: metric(procs.url, "turnout_inflight_requests") == 0, 30,
               "the frontend's in-flight gauge to return to 0", procs.logs)  # fmt: skip

    def idle() -> bool:
        loads = worker_loads(procs)
        return len(loads) == 2 and all(
            load.get("running") == 0 and load.get("waiting") == 0 and load.get("kv_usage") == 0
            for load in loads
        )

    wait_until(idle, 60, "the workers to drop the abandoned requests", procs.logs)


# -- 10,000 clients ---------------------------------------------------------------------------

CLIENTS = 10_000
MAX_INFLIGHT = 256
REJECT_STATUS = 429
#: Every client must have its answer by then (connect, queue wait and generation included).
CLIENT_DEADLINE_S = 90.0


async def crowd(port: int) -> list[tuple[int, bytes, bytes] | str]:
    """``CLIENTS`` clients at once, each on its own connection."""
    body = json.dumps({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1}).encode()
    raw = (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return await asyncio.gather(
        *(one_request("127.0.0.1", port, raw, CLIENT_DEADLINE_S) for _ in range(CLIENTS))
    )


def test_ten_thousand_concurrent_clients_get_an_answer(procs: ProcessSet) -> None:
    """10,000 clients at once against ``--max-inflight 256`` and a small queue: each gets a
    200 or a clean rejection (the ``--reject-status``, ``Retry-After``, an OpenAI error
    body), none hangs, and the frontend's memory stays bounded."""
    procs.frontend("--max-inflight", str(MAX_INFLIGHT), "--queue-size", "64",
                   "--queue-timeout", "5", "--reject-status", str(REJECT_STATUS))  # fmt: skip
    for _ in range(2):
        procs.worker(*MOCKER, "--speedup-ratio", "10")
    wait_until(lambda: len(instances(procs.url)) == 2, 60, "the workers", procs.logs)
    frontend = psutil.Process(procs.procs[0].pid)
    r = httpx.post(procs.url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1})  # fmt: skip
    assert r.status_code == 200, r.text
    rss_before = frontend.memory_info().rss

    started = time.monotonic()
    answers = asyncio.run(crowd(procs.port))
    elapsed = time.monotonic() - started

    failures = [a for a in answers if isinstance(a, str)]
    assert not failures, (len(failures), failures[:5], procs.logs())
    statuses: dict[int, int] = {}
    for status, head, body in answers:  # type: ignore[misc]
        statuses[status] = statuses.get(status, 0) + 1
        if status == 200:
            continue
        assert status == REJECT_STATUS, (status, head, body)
        assert b"\r\nretry-after: " in head, head
        error = json.loads(body)["error"]
        assert error["message"] and error["type"], body
    assert statuses.get(200, 0) >= MAX_INFLIGHT, statuses
    assert elapsed < CLIENT_DEADLINE_S + 10, elapsed

    rss_after = frontend.memory_info().rss
    assert rss_after < 500 * 2**20, (rss_before, rss_after, statuses)
    # Nothing left behind: the gauge is back to zero and the frontend still answers.
    wait_until(lambda: metric(procs.url, "turnout_inflight_requests") == 0, 30,
               "the in-flight gauge to return to 0", procs.logs)  # fmt: skip
    r = httpx.post(procs.url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1})  # fmt: skip
    assert r.status_code == 200, r.text
