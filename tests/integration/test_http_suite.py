"""One HTTP suite, two deployments: ``turnout serve`` with its engine in worker processes
(file store, TCP request plane) and ``turnout serve --in-process`` (the engine inside the
frontend's process, in-memory discovery, the local request plane). Everything a client sees
must be the same: bodies (checked against the official clients' types by the suite's
conformance hook), streams, errors, the model list, health."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from tests.integration.procs import health, start_serve, stop_serve, wait_until

from turnout.engines.embeddings.model import DEFAULT_MODEL_NAME
from turnout.frontend.service import free_port

pytestmark = pytest.mark.slow

MODES = {"distributed": ["--num-workers", "1"], "in-process": ["--in-process"]}
REFERENCE = json.loads((Path(__file__).parents[1] / "data" / "minilm_reference.json").read_text())


@dataclass
class Deployment:
    url: str
    mode: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0)


def deploy(tmp: Path, model: str, mode: str, *flags: str) -> Iterator[Deployment]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(tmp, port, *flags, *MODES[mode])

    def logs() -> str:
        return (tmp / "serve.log").read_text(errors="replace")[-4000:]

    try:
        wait_until(lambda: bool(health(url).get(model)), 90, f"model {model}", logs)
        yield Deployment(url, mode)
    finally:
        stop_serve(proc)
    assert "Traceback" not in logs(), logs()


@pytest.fixture(scope="module", params=list(MODES))
def echo(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp(f"echo-{request.param}")
    yield from deploy(tmp, "echo", request.param, "--engine", "echo", "--model-name", "echo")


MESSAGES = [{"role": "user", "content": "the same words, echoed back"}]


def test_chat_whole_and_streamed_agree(echo: Deployment) -> None:
    client = echo.client()
    whole = client.chat.completions.create(model="echo", messages=MESSAGES, max_tokens=12)  # type: ignore[arg-type]
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    chunks = client.chat.completions.create(
        model="echo", messages=MESSAGES, max_tokens=12, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    text, usage = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == whole.choices[0].message.content
    assert usage is not None and usage.total_tokens == whole.usage.total_tokens


def test_completions_choices_and_stop_strings(echo: Deployment) -> None:
    client = echo.client()
    prompt = "alpha beta gamma delta"
    out = client.completions.create(model="echo", prompt=prompt, n=2, max_tokens=4)
    assert [c.text for c in out.choices] == [prompt] * 2
    stopped = client.completions.create(model="echo", prompt=prompt, stop=[" g"], max_tokens=4)
    assert stopped.choices[0].text == "alpha beta"
    assert stopped.choices[0].finish_reason == "stop"


def test_models_health_and_metrics(echo: Deployment) -> None:
    (model,) = echo.client().models.list().data
    assert model.id == "echo"
    assert model.model_extra is not None
    assert model.model_extra["endpoints"] == [
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/completions",
    ]
    body = httpx.get(echo.url + "/health", timeout=10).json()
    assert body["status"] == "healthy" and len(body["models"][0]["instances"]) == 1
    metrics = httpx.get(echo.url + "/metrics", timeout=10).text
    assert 'turnout_requests_total{endpoint="chat_completions"' in metrics


def test_errors_are_the_same(echo: Deployment) -> None:
    client = echo.client()
    with pytest.raises(openai.BadRequestError, match="frequency_penaltyy"):
        client.chat.completions.create(
            model="echo",
            messages=MESSAGES,
            extra_body={"frequency_penaltyy": 1},  # type: ignore[arg-type]
        )
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=MESSAGES)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError, match="does not serve embeddings"):
        client.embeddings.create(model="echo", input="x")
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="echo", prompt="word " * 10000)
    r = httpx.get(echo.url + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("mode", list(MODES))
def test_embeddings_in_both_deployments(mode: str, tmp_path: Path) -> None:
    for deployment in deploy(tmp_path, DEFAULT_MODEL_NAME, mode, "--engine", "embeddings"):
        out = deployment.client().embeddings.create(
            model=DEFAULT_MODEL_NAME, input=REFERENCE["sentences"][:3]
        )
        got = np.array([d.embedding for d in out.data])
        want = np.array(REFERENCE["embeddings"][:3])
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cos.min() >= 0.999


@pytest.mark.parametrize("mode", list(MODES))
def test_tensors_in_both_deployments(mode: str, tmp_path: Path) -> None:
    for deployment in deploy(tmp_path, "numeric", mode, "--engine", "numeric"):
        x = {"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}
        body = {"model": "numeric", "inputs": [x], "outputs": [{"name": "row_sum"}]}
        r = httpx.post(deployment.url + "/v1/tensor", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["outputs"] == [
            {"name": "row_sum", "datatype": "FP64", "shape": [1], "data": [6.0]}
        ]
        bad = {**body, "inputs": [{**x, "shape": [3]}]}
        r = httpx.post(deployment.url + "/v1/tensor", json=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "inputs[0].shape"
