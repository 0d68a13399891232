"""The llama.cpp engine's span of a traced request (real SmolLM2-135M GGUF, CPU), collected by
the SDK's in-memory exporter: under the request's span, with its tokens and how it ended."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tests.engines.test_llamacpp import chat_prompt, collect, make_request
from tests.engines.test_llamacpp import engine as engine  # the fixtures
from tests.engines.test_llamacpp import model_path as model_path
from tests.engines.test_llamacpp import tokenizer as tokenizer

from turnout.engines.llamacpp.engine import LlamaCppEngine
from turnout.llm.tokenizer import Tokenizer
from turnout.runtime import tracing
from turnout.runtime.context import RequestContext

pytestmark = pytest.mark.slow


def attrs(span: Any) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_a_traced_request_has_a_generate_span_under_its_own(
    engine: LlamaCppEngine, tokenizer: Tokenizer, spans: InMemorySpanExporter
) -> None:
    prompt = chat_prompt(tokenizer, "Name three colours.")
    for _ in range(2):  # the second run finds the prompt in its slot's cache
        ctx = RequestContext()
        parent = tracing.start_request_span(ctx, "request", {}, {})
        outs = await collect(engine, make_request(prompt, 4, ignore_eos=True), ctx)
        tracing.end_span(parent)
        assert sum(len(o.token_ids) for o in outs) == 4
    first, second = [s for s in spans.get_finished_spans() if s.name == "llamacpp.generate"]
    parents = [s for s in spans.get_finished_spans() if s.name == "request"]
    for span, request in zip((first, second), parents, strict=True):
        assert span.parent is not None and span.parent.span_id == request.context.span_id
        assert attrs(span)["turnout.prompt_tokens"] == len(prompt)
        assert attrs(span)["turnout.output_tokens"] == 4
        assert attrs(span)["turnout.finish_reason"] == "length"
        assert "turnout.cancelled" not in attrs(span)
    assert attrs(first)["turnout.cached_tokens"] < attrs(second)["turnout.cached_tokens"]


async def test_an_untraced_request_makes_no_span(
    engine: LlamaCppEngine, tokenizer: Tokenizer, spans: InMemorySpanExporter
) -> None:
    prompt = chat_prompt(tokenizer, "Say hi.")
    await collect(engine, make_request(prompt, 2, ignore_eos=True), RequestContext())
    assert spans.get_finished_spans() == ()
