"""Attach and tracing, against a scripted server: a traced request gets an ``upstream`` client
span, and the server is sent a W3C ``traceparent`` naming it (a vLLM or SGLang that traces
then continues the request's trace); a worker that does not trace passes the frontend's own
on, in token and text mode alike; an untraced request sends none."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tests.engines.attach.fake_server import FakeServer, Reply
from tests.engines.attach.test_attach_engine import CARD, FAST, LC_FINAL, lc_event, req
from tests.engines.attach.test_attach_engine import server as server  # the fixture

from turnout.engines.attach.llamacpp_api import LlamaCppApi
from turnout.engines.attach.text_relay import relay_handler
from turnout.engines.attach.tokens_engine import AttachedEngine
from turnout.engines.attach.upstream import Upstream
from turnout.protocols.llm import StopConditions
from turnout.runtime import tracing
from turnout.runtime.context import RequestContext

FRONTEND = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def generate(server: FakeServer, ctx: RequestContext) -> None:
    server.route("POST", "/completion", Reply(events=[lc_event(7, 1), LC_FINAL]))
    engine = AttachedEngine(url=server.url, api=LlamaCppApi(server.url), card=CARD,
                            served_name="served", deadlines=FAST, health_interval=60,
                            load_interval=60)  # fmt: skip
    await engine.start()
    try:
        request = req(stop_conditions=StopConditions(max_tokens=3))
        outputs = [out async for out in engine.generate(request, ctx)]
    finally:
        await engine.stop()
    assert outputs[-1].finish_reason is not None


def sent_traceparent(server: FakeServer, path: str) -> str | None:
    (headers,) = [h for (_, p, _), h in zip(server.requests, server.headers, strict=True)
                  if p == path]  # fmt: skip
    return headers.get("traceparent")


async def test_a_traced_request_names_its_upstream_span_to_the_server(
    server: FakeServer, spans: InMemorySpanExporter
) -> None:
    ctx = RequestContext("r1", FRONTEND)
    worker = tracing.start_worker_span(ctx, "generate", {})
    await generate(server, ctx)
    tracing.end_span(worker)
    (upstream,) = [s for s in spans.get_finished_spans() if s.name == "upstream"]
    assert worker is not None and upstream.parent is not None
    assert upstream.parent.span_id == worker.get_span_context().span_id
    attributes: dict[str, Any] = dict(upstream.attributes or {})
    assert attributes["url.full"] == server.url + "/completion"
    context = upstream.context
    assert context is not None
    assert sent_traceparent(server, "/completion") == (
        f"00-{context.trace_id:032x}-{context.span_id:016x}-01"
    )


async def test_a_worker_that_does_not_trace_passes_the_frontends_traceparent_on(
    server: FakeServer,
) -> None:
    await generate(server, RequestContext("r1", FRONTEND))
    assert sent_traceparent(server, "/completion") == FRONTEND


async def test_an_untraced_request_sends_no_traceparent(server: FakeServer) -> None:
    await generate(server, RequestContext("r1"))
    assert sent_traceparent(server, "/completion") is None


@pytest.mark.parametrize("traceparent", [FRONTEND, ""])
async def test_text_mode_passes_the_frontends_traceparent_on(
    server: FakeServer, traceparent: str
) -> None:
    chunk = {"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]}
    server.route("POST", "/v1/completions", Reply(events=[chunk, b"data: [DONE]"]))
    upstream = Upstream(server.url, FAST)
    await upstream.open()
    try:
        handle = relay_handler(upstream, "served")
        items = [i async for i in relay(handle, b'{"prompt": "x"}', traceparent)]
    finally:
        await upstream.close()
    assert len(items) == 1
    assert sent_traceparent(server, "/v1/completions") == (traceparent or None)


async def relay(handle: Any, payload: bytes, traceparent: str) -> AsyncIterator[bytes]:
    async for item in handle(payload, RequestContext("r1", traceparent)):
        yield item
