"""Stopping tracing: what is queued is exported on the way out, and a collector that does
not answer does not hold the stop up (the export is left to die with the process)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from turnout.runtime import tracing
from turnout.runtime.context import RequestContext


class StuckExporter(SpanExporter):
    """An export that does not return until ``release`` is set: a collector that hangs."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.exported: list[str] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.release.wait(60)
        self.exported.extend(s.name for s in spans)
        return SpanExportResult.SUCCESS


def one_span(name: str) -> None:
    ctx = RequestContext()
    tracing.end_span(tracing.start_request_span(ctx, name, {}, {}))


def test_queued_spans_are_exported_when_tracing_stops() -> None:
    exporter = StuckExporter()
    exporter.release.set()
    tracing.install_exporter(exporter, "turnout-test")  # batched: nothing sent yet
    one_span("last words")
    tracing.shutdown_tracing(timeout=60)
    assert exporter.exported == ["last words"] and not tracing.enabled()


def test_a_hanging_collector_does_not_hold_the_stop_up() -> None:
    exporter = StuckExporter()
    tracing.install_exporter(exporter, "turnout-test")
    one_span("lost")
    try:
        tracing.shutdown_tracing(timeout=0.05)
        assert not exporter.exported  # it returned with the export still hanging
        assert not tracing.enabled()
        one_span("after")  # tracing is off: nothing recorded, nothing raised
    finally:
        exporter.release.set()
