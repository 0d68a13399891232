"""The run path alone: process CPU per request of ``Responder.serve_tokens`` (preprocess
result -> ChatRun -> writer) with a fake pipeline, no network and no tokenizer, so what two
source trees differ in is the run and writer code only (``frontend_overhead.py`` measures the
whole frontend, whose run-to-run noise on a shared machine hides a few microseconds).

Usage (interleave two trees; the minimum over runs is the least disturbed)::

    PYTHONPATH=<tree>/src python benchmarks/run_path.py

Prints one JSON line: microseconds per request for a whole chat answer of one delta, and
streamed ones of 1 and 64 deltas (min of ``--repeat`` batches).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgspec

from turnout.frontend.metrics.frontend import FrontendMetrics
from turnout.frontend.models.pipeline import Generation
from turnout.frontend.openai.responder import Responder
from turnout.llm.backend import DecodedDelta
from turnout.protocols.llm import FinishReason, PreprocessedRequest
from turnout.protocols.model import ModelCapabilities
from turnout.protocols.openai import ChatCompletionRequest
from turnout.runtime.context import RequestContext


class _Decoder:
    def __init__(self) -> None:
        self.num_output_tokens = 0
        self.cached_tokens = 0
        self.matched_stop = None


class _Pipeline:
    """What the run reads of a tokens pipeline: deltas of ``n`` one-token texts."""

    is_chat = True
    card = SimpleNamespace(capabilities=ModelCapabilities())
    client = None

    def __init__(self, n: int) -> None:
        self.n = n

    async def preprocess(self, request: Any) -> PreprocessedRequest:
        return PreprocessedRequest(model="m", token_ids=[1, 2, 3])

    def generate(self, pre: PreprocessedRequest, ctx: RequestContext) -> Generation:
        decoder = _Decoder()
        n = self.n

        async def deltas() -> AsyncIterator[DecodedDelta]:
            for _ in range(n - 1):
                decoder.num_output_tokens += 1
                yield DecodedDelta(text=" tok", token_ids=[5])
            decoder.num_output_tokens += 1
            yield DecodedDelta(text=" end", token_ids=[6], finish_reason=FinishReason.LENGTH)

        return Generation(pre, decoder, deltas())  # type: ignore[arg-type]


class _Stream:
    async def send_bytes(self, data: bytes) -> None:
        pass


class _Exchange:
    def response_stream(self, status: int, headers: list[tuple[str, str]]) -> _Stream:
        return _Stream()

    def response_bytes(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        pass


async def per_request_us(deltas: int, stream: bool, requests: int, repeat: int) -> float:
    responder = Responder(FrontendMetrics())
    pipeline: Any = _Pipeline(deltas)
    exchange: Any = _Exchange()
    request = msgspec.convert(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream,
         "max_tokens": deltas},
        ChatCompletionRequest,
    )  # fmt: skip
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(requests):
            await responder.serve_tokens(exchange, pipeline, request, RequestContext("x"))
        best = min(best, (time.process_time() - start) / requests * 1e6)
    return round(best, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    out = {
        name: asyncio.run(per_request_us(deltas, stream, requests, args.repeat))
        for name, deltas, stream, requests in [
            ("whole_1", 1, False, 3000),
            ("stream_64", 64, True, 500),
            ("stream_1", 1, True, 3000),
        ]
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
