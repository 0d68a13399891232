"""Spans of requests through an in-process stack, collected by the SDK's in-memory exporter:
what each stage records (the KV router's candidates, a prefill stage and its KV transfer
under disaggregation), and that tracing off leaves the SDK unimported."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tests.frontend.stack import make_stack
from tests.frontend.test_disagg_e2e import LONG, MakeStack
from tests.frontend.test_disagg_e2e import stacks as stacks  # the fixture

from turnout.engines.mocker import MockerConfig, make_mocker_engines
from turnout.errors import ConfigError
from turnout.router.kv.config import KvRouterConfig
from turnout.router.mode import RouterMode
from turnout.runtime import tracing


def tree_of(exporter: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    """The finished spans by name, after checking they form one trace and one tree."""
    got = exporter.get_finished_spans()
    assert len({s.context.trace_id for s in got}) == 1
    ids = {s.context.span_id for s in got}
    roots = [s for s in got if s.parent is None or s.parent.span_id not in ids]
    assert len(roots) == 1, [s.name for s in roots]
    out: dict[str, list[ReadableSpan]] = {}
    for span in got:
        out.setdefault(span.name, []).append(span)
    return out


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_a_kv_routed_request_explains_its_route_in_its_span(
    gguf_path: str, spans: InMemorySpanExporter
) -> None:
    stack = await make_stack(router_mode=RouterMode.KV, kv=KvRouterConfig(block_size=16))
    config = MockerConfig(num_gpu_blocks=256, block_size=16, speedup_ratio=0)
    try:
        for engine in make_mocker_engines(config, 2, model_path=gguf_path):
            await stack.add_worker(engine, model_name="mock")
        await stack.wait_for_model("mock", instances=2)
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            answer = await http.post(
                "/v1/completions",
                json={"model": "mock", "prompt": LONG, "max_tokens": 4},
                headers={"x-request-id": "kv-1"},
            )
        assert answer.status_code == 200, answer.text
    finally:
        await stack.close()
    by_name = tree_of(spans)
    (request,) = by_name["POST /v1/completions"]
    assert str(attrs(request)["turnout.request_id"]).startswith("kv-1.")
    assert attrs(request)["gen_ai.request.model"] == "mock"
    (route,) = by_name["route"]
    decision = attrs(route)
    assert (
        decision["turnout.router.mode"] == "kv" and decision["turnout.route.status"] == "selected"
    )
    candidates = decision["turnout.route.candidates.instance"]
    assert len(candidates) == 2 and decision["turnout.instance"] in candidates
    assert len(decision["turnout.route.candidates.overlap_blocks"]) == 2
    (attempt,) = by_name["attempt"]
    (generate,) = by_name["generate"]
    assert attempt.parent is not None and attempt.parent.span_id == request.context.span_id
    assert generate.parent is not None and generate.parent.span_id == attempt.context.span_id
    assert attrs(generate)["turnout.output_tokens"] == 4
    assert [e.name for e in generate.events] == ["mocker.scheduled", "first_token"]
    assert attrs(attempt)["turnout.instance"] == decision["turnout.instance"]
    assert attrs(attempt)["turnout.attempt"] == 1 and "turnout.attempt.cause" not in attrs(attempt)
    # The engine's stages, under the worker's span: the prompt until the first token, then
    # one step a token.
    (prefill,) = by_name["mocker.prefill"]
    (decode,) = by_name["mocker.decode"]
    for stage in (prefill, decode):
        assert stage.parent is not None and stage.parent.span_id == generate.context.span_id
    assert attrs(prefill)["turnout.prompt_tokens"] == attrs(generate)["turnout.prompt_tokens"]
    assert attrs(prefill)["turnout.preemptions"] == 0
    assert attrs(decode)["turnout.output_tokens"] == 4 and attrs(decode)["mocker.steps"] == 4
    assert attrs(decode)["turnout.finish_reason"] == "length"
    assert prefill.end_time is not None and decode.start_time is not None
    assert prefill.end_time <= decode.start_time


async def test_a_disaggregated_request_has_a_prefill_stage_and_a_kv_transfer(
    stacks: MakeStack, spans: InMemorySpanExporter
) -> None:
    stack = await stacks(prefill=1, decode=1)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        answer = await http.post(
            "/v1/completions",
            json={"model": "mock", "prompt": LONG, "max_tokens": 4, "ignore_eos": True},
        )
    assert answer.status_code == 200, answer.text
    by_name = tree_of(spans)
    (request,) = by_name["POST /v1/completions"]
    (prefill,) = by_name["prefill"]
    (transfer,) = by_name["kv_transfer"]
    assert prefill.parent is not None and prefill.parent.span_id == request.context.span_id
    prefill_attempts = [
        a for a in by_name["attempt"] if a.parent and a.parent.span_id == prefill.context.span_id
    ]
    assert len(prefill_attempts) == 1  # the prefill worker's, under its stage
    assert len(by_name["generate"]) == 2  # the prefill worker's and the decode worker's
    assert attrs(transfer)["turnout.kv.bytes"] > 0


def test_tracing_off_never_imports_the_sdk() -> None:
    code = (
        "import sys, turnout.cli.main, turnout.frontend.service, turnout.engines.worker\n"
        "from turnout.runtime import tracing\n"
        "tracing.configure_tracing(None, 'x')\n"
        "assert not tracing.enabled()\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://collector:4318", "http://collector:4318/v1/traces"),
        ("https://otel.example/base/", "https://otel.example/base/v1/traces"),
    ],
)
def test_the_export_url_is_the_endpoint_and_v1_traces(endpoint: str, url: str) -> None:
    assert tracing.traces_url(endpoint) == url


@pytest.mark.parametrize("endpoint", ["collector:4318", "grpc://c:4317", "http://", "http://c?x=1"])
def test_an_unusable_endpoint_is_a_config_error_naming_the_flag(endpoint: str) -> None:
    with pytest.raises(ConfigError, match="--otlp-endpoint"):
        tracing.traces_url(endpoint)
