"""`turnout serve` with the real SmolLM2 model, driven by the official OpenAI client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import openai
import pytest
from tests.helpers import smollm2_path
from tests.integration.procs import health, wait_until

from turnout.frontend.service import free_port
from turnout.llm.chat_template import ChatTemplate
from turnout.llm.model_card import load_model_card
from turnout.llm.tokenizer import Tokenizer
from turnout.protocols.model import EndpointId

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    with open(tmp / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "turnout", "serve", "--port", str(port),
             "--store-path", str(tmp / "store.sqlite"), "--num-workers", "2",
             "--n-ctx", "1024", "--n-parallel", "2", "--threads", "1", "--lease-ttl", "3"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def logs() -> str:
        return (tmp / "serve.log").read_text(errors="replace")[-5000:]

    try:
        wait_until(
            lambda: len(next(iter(health(url).values()), [])) == 2, 180, "2 SmolLM2 workers", logs
        )
        yield url
        # Ctrl-C stops the whole tree cleanly.
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0, logs()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def model_name(served: str) -> str:
    return next(iter(health(served)))


@pytest.fixture(scope="module")
def api(served: str) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()


def _prompt_tokens(messages: list[dict[str, str]]) -> int:
    path = smollm2_path()
    assert path is not None
    card = load_model_card(path, endpoint=EndpointId(namespace="a", component="b", name="c"))
    template = ChatTemplate(card.chat_template or "", card.bos_token, card.eos_token)
    text = template.render(messages, add_generation_prompt=True)
    return len(Tokenizer.from_gguf(path).encode(text))


def test_chat_whole(api: openai.OpenAI, model_name: str) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = api.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=24,
        temperature=0,  # type: ignore[arg-type]
    )
    text = out.choices[0].message.content or ""
    assert sum(c.isalpha() for c in text) >= 5, text
    assert "\ufffd" not in text
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage is not None
    assert out.usage.prompt_tokens == _prompt_tokens(messages)
    assert 1 <= out.usage.completion_tokens <= 24
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_streamed(api: openai.OpenAI, model_name: str) -> None:
    stream = api.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    text = "".join(pieces)
    assert sum(c.isalpha() for c in text) >= 5, text
    assert usage is not None and usage.completion_tokens >= 1
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completions_whole_and_streamed(api: openai.OpenAI, model_name: str) -> None:
    out = api.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=16, temperature=0
    )
    assert sum(c.isalpha() for c in out.choices[0].text) >= 3
    assert (out.usage is not None and out.usage.completion_tokens == 16) or (
        out.choices[0].finish_reason == "stop"
    )
    started = time.monotonic()
    stream = api.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=16, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert sum(ch.isalpha() for ch in text) >= 3
    assert time.monotonic() - started < 60
