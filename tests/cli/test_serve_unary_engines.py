"""``turnout serve --engine embeddings`` and ``--engine numeric``: with no other flag, a real
worker process behind the frontend (all-MiniLM-L6-v2 reached with the official openai client;
the numeric tensor model over ``/v1/tensor``), and the flags these engines refuse."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from tests.integration.procs import health, start_serve, stop_serve, wait_until

from turnout.cli.engine_flags import check_engine_flags
from turnout.cli.main import build_parser
from turnout.cli.serve import worker_argv
from turnout.cli.worker import make_engines
from turnout.engines.embeddings import EmbeddingEngine
from turnout.engines.embeddings.model import DEFAULT_MODEL_NAME
from turnout.engines.worker import Worker
from turnout.errors import ConfigError
from turnout.frontend.service import free_port
from turnout.protocols.model import EndpointId

REFERENCE = json.loads((Path(__file__).parents[1] / "data" / "minilm_reference.json").read_text())


@pytest.mark.slow
def test_serve_embeddings_needs_no_setup(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(tmp_path, port, "--engine", "embeddings")
    log_path = tmp_path / "serve.log"

    def logs() -> str:
        return log_path.read_text(errors="replace")[-4000:]

    try:
        wait_until(lambda: health(url).get(DEFAULT_MODEL_NAME), 90, "the worker", logs)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        out = client.embeddings.create(model=DEFAULT_MODEL_NAME, input=REFERENCE["sentences"][:4])
        got = np.array([d.embedding for d in out.data])
        want = np.array(REFERENCE["embeddings"][:4])
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cos.min() >= 0.999
        (model,) = client.models.list().data
        assert model.model_extra is not None
        assert model.model_extra["endpoints"] == ["/v1/embeddings"]
        with pytest.raises(openai.NotFoundError, match="does not serve chat"):
            client.chat.completions.create(
                model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "hi"}]
            )
        client.close()
    finally:
        stop_serve(proc)


def test_embeddings_flags_are_checked() -> None:
    args = build_parser().parse_args(["worker", "--engine", "embeddings", "--num-workers", "2"])
    with pytest.raises(ConfigError, match="one model per process"):
        make_engines(args, 2)
    args = build_parser().parse_args(
        ["serve", "--engine", "embeddings", "--max-batch-size", "8", "--threads", "1"]
    )
    argv = worker_argv(args, "/tmp/store", threads=2)
    assert argv[argv.index("--max-batch-size") + 1] == "8"
    assert argv[argv.index("--threads") + 1] == "1"


async def test_parsers_are_refused_for_an_engine_that_generates_no_text() -> None:
    with pytest.raises(ConfigError, match="generates none"):
        Worker(
            object(),  # type: ignore[arg-type]
            EmbeddingEngine(),
            EndpointId.parse("a/b/c"),
            tool_call_parser="hermes",
        )


@pytest.mark.slow
def test_serve_numeric_tensor_model(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(tmp_path, port, "--engine", "numeric")
    try:
        wait_until(lambda: bool(health(url).get("numeric")), 60, "a worker")
        x = {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}
        r = httpx.post(url + "/v1/tensor", json={"model": "numeric", "inputs": [x]}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == [3, 5]
    finally:
        stop_serve(proc)


def test_tensor_engines_refuse_flags_they_cannot_honour() -> None:
    for argv, words in [
        (["--engine", "numeric", "--model-path", "x.onnx"], "no model file"),
        (["--engine", "onnx", "--context-length", "8"], "--context-length is read by"),
        (["--engine", "numeric", "--num-workers", "2"], "one model per process"),
    ]:
        args = build_parser().parse_args(["worker", *argv])
        with pytest.raises(ConfigError, match=words):
            make_engines(args, args.num_workers)


@pytest.mark.parametrize(
    ("command", "argv", "words"),
    [
        ("worker", ["--engine", "llamacpp", "--echo-delay-ms", "5"], "--echo-delay-ms is read by"),
        ("worker", ["--engine", "echo", "--speedup-ratio", "0"], "--speedup-ratio is read by"),
        ("worker", ["--engine", "llamacpp", "--context-length", "64"], "not by llamacpp"),
        ("serve", ["--engine", "echo", "--threads", "3"], "--threads is read by"),
        ("serve", ["--engine", "mocker", "--max-batch-size", "8"], "--max-batch-size is read by"),
        ("serve", ["--engine", "numeric", "--n-ctx", "64"], "--n-ctx is read by"),
    ],
)
def test_a_flag_of_another_engine_is_refused(command: str, argv: list[str], words: str) -> None:
    args = build_parser().parse_args([command, *argv])
    with pytest.raises(ConfigError, match=words):
        check_engine_flags(args)


def test_an_engines_own_flags_and_defaults_pass() -> None:
    for argv in (
        ["--engine", "mocker", "--speedup-ratio", "0", "--max-waiting", "8"],
        ["--engine", "embeddings", "--threads", "1", "--max-batch-size", "4"],
        ["--engine", "echo", "--echo-delay-ms", "1", "--context-length", "64"],
        ["--engine", "llamacpp", "--n-ctx", "2048", "--threads", "2"],
        ["--engine", "numeric"],
    ):
        check_engine_flags(build_parser().parse_args(["worker", *argv]))
