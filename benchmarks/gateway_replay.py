"""The client of ``benchmarks/gateways.py``: replay requests open-loop through any gateway.

Each gateway is spoken to in the API it accepts for the same work (``Dialect``):

* ``completions``: ``POST /v1/completions`` with a token-id ``prompt``, ``ignore_eos``,
  streamed with ``stream_options.include_usage`` (turnout's frontend, vLLM's router);
* ``generate``: SGLang's ``POST /generate`` with ``input_ids`` and
  ``sampling_params.ignore_eos``, streamed (SGLang's gateway, whose ``/v1/completions``
  takes no token ids); its events carry the output so far and ``meta_info``;
* ``chat``: ``POST /v1/chat/completions`` with text messages (the llama.cpp part, where every
  gateway gets the same text and each engine templates or is templated for).

A request is sent at its scheduled time (arrival x time scale), never before the previous turn
of its session has finished (then its latencies count from that moment), with at most
``concurrency`` in flight. Per request the client records when each streamed event with
output arrived (``RequestResult.chunk_times``), TTFT, end-to-end time and the usage the
gateway relays. Everything is wall time; ``summarize`` turns it into simulated time.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from benchmarks.routing_quality import RequestResult, chunk_gaps, itl_values, percentiles

#: Reads one decoded SSE event into a result (``now`` is wall seconds since the schedule).
EventParser = Callable[[dict[str, Any], RequestResult, float], None]


def _parse_openai(obj: dict[str, Any], result: RequestResult, now: float) -> None:
    """A completions or chat chunk: output arrives with any choice that carries text or a
    finish reason (an empty text is a token whose bytes are held back); usage at the end."""
    choices = obj.get("choices") or []
    if choices:
        choice = choices[0]
        delta = choice.get("delta") or {}
        text = choice.get("text") or delta.get("content") or delta.get("reasoning_content")
        if text:
            result.chunk_times.append(now)
        if result.ttft_s is None and (text or choice.get("finish_reason")):
            result.ttft_s = now
    if usage := obj.get("usage"):
        result.prompt_tokens = usage.get("prompt_tokens") or 0
        result.output_tokens = usage.get("completion_tokens") or 0
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens") or 0


def _parse_generate(obj: dict[str, Any], result: RequestResult, now: float) -> None:
    """An SGLang ``/generate`` event: the output so far (``output_ids``) and ``meta_info``."""
    meta = obj.get("meta_info") or {}
    produced = meta.get("completion_tokens")
    if produced is None:
        produced = len(obj.get("output_ids") or [])
    if produced > result.output_tokens:
        result.chunk_times.append(now)
        if result.ttft_s is None:
            result.ttft_s = now
        result.output_tokens = produced
    result.prompt_tokens = meta.get("prompt_tokens") or result.prompt_tokens
    result.cached_tokens = meta.get("cached_tokens") or result.cached_tokens


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one gateway is asked for a streamed generation, and how its events read."""

    name: str
    path: str
    parse: EventParser


COMPLETIONS = Dialect("completions", "/v1/completions", _parse_openai)
GENERATE = Dialect("generate", "/generate", _parse_generate)
CHAT = Dialect("chat", "/v1/chat/completions", _parse_openai)


def completions_body(model: str, tokens: Sequence[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": list(tokens),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def generate_body(model: str, tokens: Sequence[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "input_ids": list(tokens),
        "stream": True,
        "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0},
    }


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of a replay: when (trace seconds), after which request of its session,
    and how to build its body (called just before it is sent)."""

    arrival_s: float
    previous: int | None
    body: Callable[[], dict[str, Any]]


async def _send(
    client: httpx.AsyncClient,
    dialect: Dialect,
    body: bytes,
    scheduled: float,
    result: RequestResult,
) -> None:
    result.send_delay_s = time.perf_counter() - scheduled
    headers = {"content-type": "application/json"}
    async with client.stream("POST", dialect.path, content=body, headers=headers) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            result.error = f"HTTP {resp.status_code}: {text[:300]}"
            return
        buffer = b""
        async for chunk in resp.aiter_bytes():
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                event = event.strip()
                if not event.startswith(b"data:"):
                    continue
                data = event[5:].strip()
                if data == b"[DONE]":
                    continue
                obj = json.loads(data)
                if isinstance(obj, dict) and "error" in obj:
                    error = obj["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    result.error = f"in-stream error: {message}"
                    continue
                dialect.parse(obj, result, time.perf_counter() - scheduled)
    result.e2e_s = time.perf_counter() - scheduled
    if result.error is None and result.ttft_s is None:
        result.error = "stream ended without a token"


async def replay(
    url: str,
    dialect: Dialect,
    plan: Sequence[Planned],
    *,
    time_scale: float,
    concurrency: int,
    timeout_s: float,
    deadline_s: float,
) -> tuple[list[RequestResult], float]:
    """Send every planned request (see the module docstring); results in plan order and the
    wall seconds from the first scheduled send to the last completion. Requests still running
    ``deadline_s`` after the start are cancelled and counted as errors."""
    done = [asyncio.Event() for _ in plan]
    results = [RequestResult(i) for i in range(len(plan))]
    cap = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url, limits=limits, timeout=httpx.Timeout(timeout_s)
    ) as client:
        start = time.perf_counter() + 0.5

        async def one(i: int) -> None:
            item = plan[i]
            scheduled = start + item.arrival_s * time_scale
            try:
                await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
                results[i].sent_at_s = time.perf_counter() - start
                if item.previous is not None and not done[item.previous].is_set():
                    await done[item.previous].wait()
                    now = time.perf_counter()
                    results[i].session_wait_s = max(0.0, now - scheduled)
                    scheduled = max(scheduled, now)
                    results[i].sent_at_s = now - start
                body = json.dumps(item.body()).encode()
                async with cap:
                    await _send(client, dialect, body, scheduled, results[i])
            except (httpx.HTTPError, ValueError) as exc:
                results[i].error = f"{type(exc).__name__}: {exc}"
            except asyncio.CancelledError:
                results[i].error = "cancelled at the replay's deadline"
                raise
            finally:
                done[i].set()

        tasks: list[asyncio.Task[None]] = []
        try:
            async with asyncio.timeout(deadline_s):
                for i, item in enumerate(plan):
                    ahead = start + item.arrival_s * time_scale - 0.25 - time.perf_counter()
                    if ahead > 0:
                        await asyncio.sleep(ahead)
                    tasks.append(asyncio.create_task(one(i)))
                await asyncio.gather(*tasks, return_exceptions=True)
        except TimeoutError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for r in results:
                if r.e2e_s is None and r.error is None:
                    r.error = "not finished at the replay's deadline"
        elapsed = time.perf_counter() - start
    return results, elapsed


def summarize(results: list[RequestResult], elapsed: float, speedup: float) -> dict[str, Any]:
    """One run's client-side figures: ``*_ms`` in wall milliseconds, ``*_sim_ms`` in
    simulated ones (wall x the mocker's speedup; 1 for real engines)."""
    ok = [r for r in results if r.error is None and r.ttft_s is not None and r.e2e_s is not None]
    errors = [r.error for r in results if r.error is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = itl_values(ok)

    def sim(values: dict[str, float]) -> dict[str, float]:
        return {k: round(v * speedup, 2) for k, v in values.items()}

    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(errors),
        "first_errors": sorted(set(errors))[:3],
        "ttft_ms": percentiles(ttft),
        "itl_ms": percentiles(itl),
        "ttft_sim_ms": sim(percentiles(ttft)),
        "itl_sim_ms": sim(percentiles(itl)),
        "token_gap_sim_ms": sim(percentiles(chunk_gaps(ok), (50, 99))),
        "send_delay_ms": percentiles([r.send_delay_s for r in results]),
        "wall_s": round(elapsed, 2),
        "requests_per_s": round(len(ok) / elapsed, 2) if elapsed > 0 else 0.0,
        "prompt_tokens_client": prompt,
        "cached_tokens_client": cached,
        "output_tokens": sum(r.output_tokens for r in ok),
        "ttft_sim_s_sorted": sorted(round(t * speedup, 5) for t in ttft),
    }
