"""A frontend process drains on SIGTERM: readiness goes first (``/health`` is 503 with
``"status": "draining"``), new generation requests are refused with a 503 in OpenAI's shape,
the stream in flight runs to its end, and the process exits 0 once it has; a second signal
stops it at once. Real processes: a frontend and a mocker worker slowed down so that a
stream outlasts the checks made while it runs."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.procs import ProcessSet, wait_until

pytestmark = pytest.mark.slow

MODEL_TOKENS = 40


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessSet]:
    ps = ProcessSet(tmp_path)
    yield ps
    ps.close()


def start(procs: ProcessSet, drain_timeout: float) -> tuple[subprocess.Popen[bytes], str]:
    """A frontend and a slow mocker worker; the frontend's process and the model's name."""
    frontend = procs.frontend("--drain-timeout", str(drain_timeout))
    procs.worker("--engine", "mocker", "--speedup-ratio", "0.02")

    def served() -> bool:
        body = httpx.get(procs.url + "/health", timeout=5).json()
        return body["status"] == "healthy"

    wait_until(served, 60, "the model", procs.logs)
    model = httpx.get(procs.url + "/v1/models", timeout=5).json()["data"][0]["id"]
    return frontend, str(model)


class Stream:
    """One streamed completion read in a thread: its chunks, finish reason and error."""

    def __init__(self, url: str, model: str) -> None:
        self.chunks = 0
        self.finish: str | None = None
        self.error: str | None = None
        self.started = threading.Event()
        body = {"model": model, "prompt": "alpha beta gamma delta", "stream": True,
                "max_tokens": MODEL_TOKENS, "ignore_eos": True}  # fmt: skip
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    self.chunks += 1
                    self.started.set()
                    for choice in chunk.get("choices", []):
                        self.finish = choice.get("finish_reason") or self.finish
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        finally:
            self.started.set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"


def health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=5)


def test_sigterm_drains_the_stream_in_flight_then_exits_0(procs: ProcessSet) -> None:
    frontend, model = start(procs, drain_timeout=120)
    stream = Stream(procs.url, model)
    assert stream.started.wait(60) and stream.error is None, procs.logs()
    assert stream.running

    frontend.send_signal(signal.SIGTERM)
    wait_until(lambda: health(procs.url).status_code == 503, 30, "/health 503", procs.logs)
    assert health(procs.url).json()["status"] == "draining"
    ready = httpx.get(procs.url + "/ready", timeout=5)
    assert (ready.status_code, ready.json()["status"]) == (503, "draining")
    refused = httpx.post(
        procs.url + "/v1/completions",
        json={"model": model, "prompt": "hi", "max_tokens": 2},
        timeout=10,
    )
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "service_unavailable"
    assert stream.running, "the stream ended before the drain could be seen"

    stream.join(120)
    assert stream.error is None, stream.error
    assert stream.finish == "length"
    assert frontend.wait(timeout=60) == 0, procs.logs()


def test_a_second_signal_stops_at_once(procs: ProcessSet) -> None:
    frontend, model = start(procs, drain_timeout=600)
    stream = Stream(procs.url, model)
    assert stream.started.wait(60) and stream.error is None, procs.logs()

    frontend.send_signal(signal.SIGTERM)
    wait_until(lambda: health(procs.url).status_code == 503, 30, "/health 503", procs.logs)
    frontend.send_signal(signal.SIGINT)
    assert frontend.wait(timeout=60) == 0, procs.logs()  # far less than the drain timeout
    stream.join(60)
    assert stream.finish != "length", "the stream ran to its end: nothing was cut"
