"""``turnout mocker-server`` as a real process: it serves, publishes KV events, stops on
SIGTERM with status 0, and refuses a bad flag combination with one line and status 2."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest
import zmq

from turnout.frontend.service import free_port
from turnout.protocols.native_kv import NativeStored, decode_native_batch

pytestmark = pytest.mark.slow


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail("the server never became healthy")


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_the_command_serves_and_publishes(api: str) -> None:
    port, kv_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "turnout", "mocker-server", "--api", api, "--port", str(port),
         "--kv-events-endpoint", f"tcp://127.0.0.1:{kv_port}", "--speedup-ratio", "0",
         "--block-size", "16", "--num-gpu-blocks", "512", "--served-model-name", "mock",
         "--log-level", "warning"],
    )  # fmt: skip
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{kv_port}")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        models = httpx.get(f"{url}/v1/models").json()
        assert models["data"][0]["id"] == "mock"
        deadline = time.monotonic() + 20
        stored: list[NativeStored] = []
        prompt = 1000
        while not stored and time.monotonic() < deadline:  # past ZMQ's slow-joiner window
            prompt += 1
            r = httpx.post(f"{url}/v1/completions", json={"prompt": [prompt] * 32, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            while sub.poll(200):
                batch = decode_native_batch(sub.recv_multipart()[2])
                stored += [e for e in batch.events if isinstance(e, NativeStored)]
        # vLLM stores both blocks in one event, SGLang one event per block.
        tokens = [t for event in stored for t in event.token_ids]
        assert tokens[-32:] == [prompt] * 32
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sub.close(linger=0)
        ctx.term()


def test_a_bad_combination_is_refused_with_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "turnout", "mocker-server", "--api", "sglang", "--port", "0",
         "--kv-events-encoding", "map", "--kv-events-endpoint", "tcp://127.0.0.1:0"],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert b"--kv-events-encoding map" in proc.stderr
    assert b"Traceback" not in proc.stderr
