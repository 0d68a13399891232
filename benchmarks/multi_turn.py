"""The ``multi_turn`` scenario of ``frontend_overhead.py``: chat conversations that grow turn
by turn, several at once, as chat clients send them.

Each conversation opens with one shared system prompt; each request is the conversation so
far, the assistant's previous answer and a new user message, so request ``t`` repeats the
``t - 1`` turns before it (what the prompt cache, ``llm.prompt_cache``, is for). The
answers are written here, not taken from the echo (which would echo the whole prompt and
grow the conversation quadratically), so every run sends the same text. ``concurrency``
connections each run conversations one after the other, turn after turn (a turn is sent when
the previous one is answered); every run's conversations are new (``nonce``), so a warm-up
run leaves nothing a measured run could reuse but the system prompt.

Also: the frontend's ``turnout_prompt_cache_*`` counters, read from /metrics around a run,
give the tokens encoded (and reused) per request.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from typing import Any

from bench_http import LoadResult, _Conn, render_post

WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "seven",
    "wizards", "quietly", "hum", "about", "tokens", "caches", "and", "routers", "on", "a",
    "sunny", "afternoon",
]  # fmt: skip
SYSTEM = (
    "You are a careful assistant for a travel agency. Answer in two or three sentences, "
    "name prices in euros, never invent train times, and ask one question back when the "
    "traveller's dates or budget are unclear. " * 3
).strip()


def _words(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n))


def conversation_bodies(
    model: str, conversation: int, turns: int, nonce: int, max_tokens: int
) -> list[bytes]:
    """The request bodies of one conversation, turn by turn."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    bodies = []
    for t in range(turns):
        question = f"Run {nonce}, chat {conversation}, turn {t}: {_words(conversation + t, 40)}?"
        messages.append({"role": "user", "content": question})
        body = {"model": model, "messages": messages, "max_tokens": max_tokens}
        bodies.append(json.dumps(body).encode())
        messages.append({"role": "assistant", "content": _words(conversation * 3 + t, 60) + "."})
    return bodies


async def run_conversations(
    host: str,
    port: int,
    model: str,
    *,
    conversations: int,
    turns: int,
    concurrency: int,
    nonce: int,
    max_tokens: int = 16,
) -> LoadResult:
    """``conversations`` conversations of ``turns`` requests over ``concurrency`` keep-alive
    connections (each runs whole conversations, one turn after the other)."""
    loop = asyncio.get_running_loop()
    hostport = f"{host}:{port}"
    pending = [
        [render_post(hostport, "/v1/chat/completions", b)
         for b in conversation_bodies(model, c, turns, nonce, max_tokens)]
        for c in range(conversations)
    ]  # fmt: skip
    pending.reverse()
    conns: list[_Conn] = []
    for _ in range(concurrency):
        _, conn = await loop.create_connection(_Conn, host, port)
        conns.append(conn)
    result = LoadResult(elapsed_s=0.0)

    async def client(conn: _Conn) -> None:
        while pending:
            for raw in pending.pop():
                keep = not result.sample_body
                t0 = time.perf_counter()
                status, _, body = await conn.request(raw, keep)
                result.latencies_s.append(time.perf_counter() - t0)
                if keep:
                    result.sample_body = body
                if status != 200:
                    result.errors += 1

    started = time.perf_counter()
    try:
        await asyncio.gather(*(client(c) for c in conns))
    finally:
        result.elapsed_s = time.perf_counter() - started
        for conn in conns:
            if conn.transport is not None:
                conn.transport.close()
    return result


_METRIC = re.compile(r"^(turnout_prompt_cache_\w+) (\S+)$", re.MULTILINE)


def prompt_cache_counters(url: str) -> dict[str, float]:
    """The frontend's ``turnout_prompt_cache_*`` samples without labels, by name."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {name: float(value) for name, value in _METRIC.findall(text)}


def cache_row(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Per chat request between two scrapes: tokens encoded, tokens reused, prompt tokens
    (nothing for a run without chat requests, or a frontend without the cache's metrics)."""
    p = "turnout_prompt_cache_"
    if p + "prompts_total" not in after:
        return {}
    prompts = after[p + "prompts_total"] - before[p + "prompts_total"]
    if not prompts:
        return {}
    encoded = after[p + "tokens_encoded_total"] - before[p + "tokens_encoded_total"]
    reused = after[p + "tokens_reused_total"] - before[p + "tokens_reused_total"]
    per = 1 / prompts
    return {
        "tokens_encoded_per_request": round(encoded * per, 1),
        "tokens_reused_per_request": round(reused * per, 1),
        "prompt_tokens_per_request": round((encoded + reused) * per, 1),
        "prompt_cache_entries": after[p + "entries"],
        "prompt_cache_held_mib": round(after[p + "bytes"] / 2**20, 2),
    }
