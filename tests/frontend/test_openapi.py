"""``GET /openapi.json``: it describes every route the frontend serves, and schemathesis,
generating requests from it (valid and not), finds no 5xx and no undocumented status."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
from pathlib import Path

import httpx
import pytest
from tests.frontend.stack import Stack

from turnout.engines.embeddings import EmbeddingEngine
from turnout.engines.tensor import NumericEngine
from turnout.frontend.http.openapi import build_openapi
from turnout.protocols.model import EndpointId

SCHEMATHESIS = shutil.which("schemathesis", path=str(Path(sys.executable).parent))


@pytest.fixture
def stack(echo_stack: Stack) -> Stack:
    return echo_stack


async def test_the_document_names_every_route(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        document = (await http.get("/openapi.json")).json()
    assert document["openapi"].startswith("3.1")
    assert stack.frontend.http is not None
    served = {(method.lower(), path) for method, path in stack.frontend.http.routes}
    documented = {(m, p) for p, ops in document["paths"].items() for m in ops}
    assert documented == served
    # Request bodies are the schemas of the structs the frontend decodes.
    assert "messages" in document["components"]["schemas"]["ChatCompletionRequest"]["required"]


def test_busy_threshold_routes_only_where_they_exist() -> None:
    assert "/busy_threshold" in build_openapi(busy_thresholds=True)["paths"]
    assert "/busy_threshold" not in build_openapi(busy_thresholds=False)["paths"]


@pytest.mark.slow
@pytest.mark.no_conformance  # schemathesis's requests are its own; it checks their answers
@pytest.mark.timeout(600)
async def test_schemathesis_finds_no_server_error_or_undocumented_status(
    stack: Stack, tmp_path: Path
) -> None:
    assert SCHEMATHESIS is not None, "schemathesis missing: run scripts/setup.sh (test extra)"
    embedder = EndpointId(namespace="test", component="embed", name="generate")
    await stack.add_worker(EmbeddingEngine(threads=1), model_name="minilm", endpoint=embedder)
    tensors = EndpointId(namespace="test", component="tensor", name="generate")
    await stack.add_worker(NumericEngine(), model_name="numeric", endpoint=tensors)
    await stack.wait_for_model("minilm")
    await stack.wait_for_model("numeric")
    async with httpx.AsyncClient(base_url=stack.url) as http:
        document = (await http.get("/openapi.json")).json()
    # Realistic data: requests name the served model, so they reach the pipeline
    # (preprocessing, routing, the worker) instead of stopping at the 404 (tested elsewhere).
    for name in (
        "ChatCompletionRequest",
        "CompletionRequest",
        "ResponsesRequest",
        "MessagesRequest",
        "CountTokensRequest",
    ):
        document["components"]["schemas"][name]["properties"]["model"] = {"const": "echo"}
    document["components"]["schemas"]["EmbeddingsRequest"]["properties"]["model"] = {
        "const": "minilm"
    }
    tensor = document["components"]["schemas"]["TensorInferRequest"]["properties"]
    tensor["model"] = {"const": "numeric"}
    # Random tensors almost never fit the card (their 400s are tested elsewhere): one that
    # does, so the other fields' variations reach the worker.
    tensor["inputs"] = {
        "const": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.5, -2]}]
    }
    # A deadline of a few nanoseconds is a 504 (a server-side status, as it should be),
    # which schemathesis's not_a_server_error check would count: keep generated ones real.
    for nvext in ("NvExt", "UnaryNvExt"):
        timeout = document["components"]["schemas"][nvext]["properties"]["request_timeout"]
        timeout["anyOf"][0] = {"type": "number", "minimum": 30}
    schema = tmp_path / "openapi.json"
    schema.write_text(json.dumps(document))
    process = await asyncio.create_subprocess_exec(
        SCHEMATHESIS, "run", str(schema), "--url", stack.url,
        "--checks", "not_a_server_error,status_code_conformance,content_type_conformance",
        "--max-examples", "60", "--seed", "1", "--request-timeout", "30",
        "--exclude-path", "/metrics", "--no-color",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        cwd=tmp_path, env={**os.environ, "SCHEMATHESIS_HOOKS": ""},
    )  # fmt: skip
    output, _ = await asyncio.wait_for(process.communicate(), timeout=540)
    text = output.decode(errors="replace")
    assert process.returncode == 0, text[-6000:]
    # And it reached the pipeline: generated requests for the served model were answered by
    # every generation route.
    async with httpx.AsyncClient(base_url=stack.url) as http:
        metrics = (await http.get("/metrics")).text
    served = re.findall(
        r'turnout_requests_total\{([^}]*model="(?:echo|minilm|numeric)"[^}]*)\} (\S+)', metrics
    )
    answered = {
        re.sub(r'.*endpoint="(\w+)".*', r"\1", labels)
        for labels, count in served
        if 'status="200"' in labels and float(count) > 0
    }
    assert answered == {
        "chat_completions",
        "completions",
        "responses",
        "messages",
        "count_tokens",
        "embeddings",
        "tensor",
    }, served
