"""The mocker's spans of one traced request, children of the worker's ``generate`` span
(``runtime.tracing``): what the simulated engine did with it, in two stages.

* ``mocker.prefill``: from the request entering its rank's queue to its first token. The
  prompt's tokens, how many of them the prefix cache served (``turnout.cached_tokens``), and
  how often the request was preempted meanwhile.
* ``mocker.decode``: from the first token to the end. Tokens out, the engine steps that
  produced them (one output a step), preemptions over the whole request, the finish reason
  (on the prefill span when the request ended before its first token; ``turnout.cancelled``
  when the consumer went away first).

Made only for a traced request: an untraced one costs the engine one check a request and one
an output.
"""

from __future__ import annotations

from typing import Any

from turnout.engines.mocker.request import MockRequest
from turnout.protocols.llm import LLMEngineOutput
from turnout.runtime import tracing
from turnout.runtime.context import RequestContext


class MockerSpans:
    """The prefill then the decode span of one request; ``output`` is told each output the
    consumer receives, ``end`` when the stream is over."""

    __slots__ = ("_ctx", "_decode", "_prefill", "_req", "_steps")

    def __init__(self, ctx: RequestContext, req: MockRequest) -> None:
        self._ctx = ctx
        self._req = req
        self._prefill: Any = tracing.start_span(
            ctx, "mocker.prefill", {"turnout.prompt_tokens": req.prompt_len}
        )
        self._decode: Any = None
        self._steps = 0

    def output(self, out: LLMEngineOutput) -> None:
        """One output on its way to the consumer."""
        if out.token_ids:
            self._steps += 1
            if self._prefill is not None:
                self._end_prefill()
                self._decode = tracing.start_span(self._ctx, "mocker.decode")
        if out.finish_reason is not None:
            span = self._decode if self._decode is not None else self._prefill
            if span is not None:
                span.set_attribute("turnout.finish_reason", str(out.finish_reason))

    def end(self, finished: bool) -> None:
        """The stream is over: ``finished`` when its last output was read, else the consumer
        left (cancelled, or its connection broke) first."""
        if self._prefill is not None:
            self._end_prefill(finished)
        span, self._decode = self._decode, None
        if span is None:
            return
        req = self._req
        span.set_attributes(
            {
                "turnout.output_tokens": req.num_output,
                "mocker.steps": self._steps,
                "turnout.preemptions": req.num_preemptions,
            }
        )
        if not finished:
            span.set_attribute("turnout.cancelled", True)
        tracing.end_span(span)

    def _end_prefill(self, finished: bool = True) -> None:
        span, self._prefill = self._prefill, None
        req = self._req
        span.set_attributes(
            {
                "turnout.cached_tokens": req.cached_tokens or 0,
                "turnout.preemptions": req.num_preemptions,
            }
        )
        if not finished:
            span.set_attribute("turnout.cancelled", True)
        tracing.end_span(span)
