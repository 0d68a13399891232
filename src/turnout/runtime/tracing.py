"""Distributed tracing with OpenTelemetry: one trace per request, across the frontend and the
workers that served it.

Off by default. ``--otlp-endpoint URL`` turns it on for a process: spans go, batched, over
OTLP/HTTP (protobuf) to ``URL/v1/traces`` through the official SDK. Off, the SDK is not even
imported, and every helper here returns at its first check of a module global: the request
path pays one comparison per step.

The trace follows the request:

* the frontend continues a client's W3C ``traceparent`` (and ``tracestate``), or starts a
  trace; its ``{method} {route}`` server span is the root of the request's spans there;
* ``RequestContext.trace`` holds the span that is the parent of the next ones (explicit parents,
  never OTel's current-span context variable, which async generators cannot restore);
* the request plane carries ``RequestContext.traceparent`` (the attempt's span) in the REQUEST
  frame, so a worker's spans are children of the attempt that reached it.

Spans (attributes under ``turnout.*``):

============================  =========================================================
``POST /v1/chat/completions``  the HTTP request (server span): status, model, request id;
                               events ``first_token``, ``migration`` (each move to another
                               worker, with why), ``retry`` (before the first token)
``admission``                  the wait for an admission slot (with ``--max-inflight``)
``preprocess``                 chat template and tokenization
``route``                      the routing decision: mode, chosen instance; under the KV
                               router each candidate's overlap, load and predicted TTFT
``attempt``                    one send to one instance (client span): instance, endpoint,
                               its number under its parent (``turnout.attempt``, from 1); a
                               later one the cause (``migration``, ``retry``) and reason of
                               the move; events ``first_token``, ``stream_end``; an error
                               status when it broke
``prefill``                    the prefill stage of a disaggregated request
``generate``                   on the worker (server span): the engine's run of the request;
                               events ``first_token`` (and the engine's: the mocker's
                               ``mocker.scheduled``); finish reason, tokens out
``kv_transfer``                on a decode worker: pulling the prompt's KV from the prefill one
``mocker.prefill``,            the mocker's stages, under ``generate``: queued to first token
``mocker.decode``              (prompt and cached tokens, preemptions), then to the end
                               (tokens, steps); ``engines.mocker.spans``
``llamacpp.generate``          llama.cpp's run, under ``generate``: prompt, cached and output
                               tokens, finish reason
``upstream``                   attach's call to the server it fronts (client span, under
                               ``generate``); the server is sent its ``traceparent`` (in text
                               mode, or when attach does not trace, the frontend's attempt's),
                               so a vLLM or SGLang exporting OTLP continues the trace
============================  =========================================================
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from turnout.errors import ConfigError
from turnout.runtime.context import RequestContext
from turnout.runtime.redact import redact_url

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("turnout.tracing")

#: The OTLP/HTTP path spans are POSTed to, under ``--otlp-endpoint``.
TRACES_PATH = "/v1/traces"
#: Seconds one export may take before it is abandoned (the batch is dropped, the process goes on).
EXPORT_TIMEOUT_S = 10.0
#: Spans waiting for export at most; past it new spans are dropped, never the process slowed.
MAX_QUEUED_SPANS = 4096
#: Seconds a stopping process gives its queued spans to reach the collector; what is left then
#: is dropped (a collector that is down must not hold up a stop: the SDK's own shutdown would
#: retry each queued batch for up to ``EXPORT_TIMEOUT_S``).
EXIT_FLUSH_S = 5.0

_tracer: Tracer | None = None
_provider: TracerProvider | None = None


def enabled() -> bool:
    """Whether this process records spans."""
    return _tracer is not None


def traces_url(endpoint: str) -> str:
    """``URL/v1/traces`` for ``--otlp-endpoint URL``; ``ConfigError`` naming the flag when the URL
    is not an http(s) URL with a host."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"--otlp-endpoint must be an http:// or https:// URL with a host, got {endpoint!r}"
        )
    if parts.query or parts.fragment:
        raise ConfigError(f"--otlp-endpoint takes no query or fragment, got {endpoint!r}")
    return endpoint.rstrip("/") + TRACES_PATH


def configure_tracing(endpoint: str | None, service_name: str) -> None:
    """Turn tracing on for this process, exporting to ``endpoint`` (None: leave it off)."""
    if endpoint is None:
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    url = traces_url(endpoint)
    install_exporter(OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S), service_name)
    log.info("tracing on: spans go to %s", redact_url(url))


def install_exporter(exporter: SpanExporter, service_name: str, *, batch: bool = True) -> None:
    """Record spans into ``exporter`` (batched on a thread of the SDK's, or, ``batch=False``,
    handed over as each ends: for tests' in-memory exporters)."""
    global _tracer, _provider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    from turnout import __version__

    shutdown_tracing()
    resource = Resource.create(
        {
            "service.name": service_name,
            "service.version": __version__,
            "host.name": socket.gethostname(),
            "process.pid": os.getpid(),
        }
    )
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # shutdown_tracing
    processor = (
        BatchSpanProcessor(exporter, max_queue_size=MAX_QUEUED_SPANS)
        if batch
        else SimpleSpanProcessor(exporter)
    )
    provider.add_span_processor(processor)
    _provider = provider
    _tracer = provider.get_tracer("turnout")


def shutdown_tracing(timeout: float = EXIT_FLUSH_S) -> None:
    """Turn tracing off, exporting what is queued within ``timeout`` seconds; past them the
    export goes on, on a daemon thread, only until the process exits."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is None:
        return
    stopping = threading.Thread(target=provider.shutdown, name="tracing-shutdown", daemon=True)
    stopping.start()
    stopping.join(timeout)
    if stopping.is_alive():
        log.warning("tracing: spans not exported within %g s of stopping are dropped", timeout)


# -------------------------------------------------------------------------------- spans


class HeaderSource(Protocol):
    """Where a request's headers are read from (a request's ``Headers``, a ``dict``)."""

    def get(self, name: str, /) -> str | None: ...


def start_request_span(
    ctx: RequestContext, name: str, headers: HeaderSource, attributes: dict[str, Any]
) -> Span | None:
    """The server span of a request that came in over HTTP, continuing the client's
    ``traceparent`` when it sent one; it becomes ``ctx``'s parent span (None: tracing off)."""
    tracer = _tracer
    if tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    parent = _extract({k: v for k in _W3C_HEADERS if (v := headers.get(k)) is not None})
    span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
    ctx.trace = span
    return span


def start_worker_span(ctx: RequestContext, name: str, attributes: dict[str, Any]) -> Span | None:
    """A worker's server span for a request that came over the request plane, child of the
    frontend's attempt (``ctx.traceparent``); it becomes ``ctx``'s parent span. None when
    tracing is off here or the request carries no trace."""
    tracer = _tracer
    if tracer is None or not ctx.traceparent:
        return None
    from opentelemetry.trace import SpanKind

    parent = _extract({"traceparent": ctx.traceparent})
    span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
    ctx.trace = span
    return span


def start_span(
    ctx: RequestContext,
    name: str,
    attributes: dict[str, Any] | None = None,
    *,
    client: bool = False,
) -> Span | None:
    """A child of ``ctx``'s parent span (None when the request is not traced). ``client``: a
    call to another process (its ``traceparent`` is then set on ``ctx`` for the plane)."""
    tracer = _tracer
    if tracer is None or ctx.trace is None:
        return None
    from opentelemetry.trace import SpanKind, set_span_in_context

    span = tracer.start_span(
        name,
        context=set_span_in_context(ctx.trace),
        kind=SpanKind.CLIENT if client else SpanKind.INTERNAL,
        attributes=attributes,
    )
    if client:
        ctx.traceparent = _traceparent(span)
    return span


def end_span(span: Span | None, error: BaseException | None = None) -> None:
    """End ``span``, with an error status naming ``error`` when one ended it."""
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


def add_event(ctx: RequestContext, name: str, attributes: dict[str, Any] | None = None) -> None:
    """An event on ``ctx``'s parent span (nothing when the request is not traced)."""
    span = ctx.trace
    if span is not None:
        span.add_event(name, attributes=attributes)


def start_attempt(ctx: RequestContext, instance_id: int, endpoint: str) -> Span | None:
    """The ``attempt`` span of one send of a traced request to one instance (a client span:
    ``ctx.traceparent`` then names it for the plane). Attempts under one parent are numbered
    from 1; a later one says why the request moved (``moved``), when it did."""
    span = ctx.trace
    if span is None:
        return None
    counts: dict[int, int] = ctx.metadata.setdefault(_ATTEMPTS_METADATA, {})
    parent_id = span.get_span_context().span_id
    number = counts[parent_id] = counts.get(parent_id, 0) + 1
    attributes: dict[str, Any] = {
        "turnout.instance": f"{instance_id:x}",
        "turnout.endpoint": endpoint,
        "turnout.attempt": number,
    }
    if number > 1:
        moved = ctx.metadata.pop(_MOVED_METADATA, None)
        if moved is not None:
            attributes["turnout.attempt.cause"], attributes["turnout.attempt.reason"] = moved
    return start_span(ctx, "attempt", attributes, client=True)


def moved(ctx: RequestContext, cause: str, reason: str, attributes: dict[str, Any]) -> None:
    """A traced request goes to another instance: a ``cause`` event (``migration``,
    ``retry``) on its parent span, and the cause and reason for its next attempt's span."""
    span = ctx.trace
    if span is not None:
        span.add_event(cause, attributes={"turnout.reason": reason, **attributes})
        ctx.metadata[_MOVED_METADATA] = (cause, reason)


def traced(
    ctx: RequestContext | None, name: str, **attributes: Any
) -> contextlib.AbstractContextManager[Any]:
    """``with traced(ctx, "preprocess"):``: a child span of ``ctx``'s around a block, with an
    error status when the block raises. One check when the request is not traced."""
    if ctx is None or ctx.trace is None:
        return _UNTRACED
    return _Traced(ctx, name, attributes)


class _Traced:
    __slots__ = ("_attributes", "_ctx", "_name", "_span")

    def __init__(self, ctx: RequestContext, name: str, attributes: dict[str, Any]) -> None:
        self._ctx = ctx
        self._name = name
        self._attributes = attributes
        self._span: Span | None = None

    def __enter__(self) -> Span | None:
        self._span = start_span(self._ctx, self._name, self._attributes)
        return self._span

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        end_span(self._span, exc)


_UNTRACED = contextlib.nullcontext()


_W3C_HEADERS = ("traceparent", "tracestate")
#: ``RequestContext.metadata`` keys of a traced request: the attempts started under each
#: parent span (span id -> count), and why it last moved (cause, reason) until an attempt
#: takes it.
_ATTEMPTS_METADATA = "trace_attempts"
_MOVED_METADATA = "trace_moved"


def _extract(carrier: dict[str, str]) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


def _traceparent(span: Span) -> str:
    """The W3C ``traceparent`` naming ``span`` as the parent."""
    context = span.get_span_context()
    flags = int(context.trace_flags)
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}"
