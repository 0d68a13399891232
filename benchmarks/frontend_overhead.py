"""Frontend overhead: CPU per request, requests/s, latency and RSS of the frontend process.

The frontend runs in its own process in front of ``echo`` workers (separate processes, file
store, TCP request plane), so the frontend's CPU time (read from /proc through psutil) is its
own: HTTP, JSON, preprocessing (chat template + tokenization), routing, request plane,
detokenization and SSE. Scenarios, each at several concurrencies:

* ``short``: a short prompt, ``max_tokens=1``, not streamed;
* ``long_stream``: a 512-token prompt, 64 tokens streamed back.
* ``paced_stream``: the same against echo workers that wait ``--paced-delay-ms`` before each
  token, as a real engine does: every token then travels alone (one frame, one pass through
  the pipeline, one SSE event), the per-token path a GPU engine exercises.
* ``multi_turn`` (not run by default): chat conversations growing turn by turn, several at
  once (``multi_turn.py``), through SmolLM2's chat template and tokenizer; its rows add the
  tokens the frontend encoded and reused per request (``turnout_prompt_cache_*`` on
  /metrics). ``--prompt-cache-mib 64 0`` measures it with the prompt cache and without.
* ``chat_stream`` / ``chat_stream_parsed`` (not run by default): a streamed chat request whose
  echoed answer holds reasoning in think tags and a hermes tool call, to a model without
  parsers (tools passed as context, ``tool_choice: none``) and to one with
  ``--tool-call-parser hermes --reasoning-parser deepseek_r1``: the cost of parsing, as the
  difference between the two rows.

Method: the load generator is ``bench_http`` (raw asyncio HTTP/1.1 keep-alive, several times
cheaper than httpx, so on a 2-core machine it does not starve the frontend). Every
(scenario, concurrency) gets a warm-up run first, then ``--repeat`` measured runs; the row
kept is the run with the median frontend CPU/request. Reported per row: the frontend's CPU
per request, split into the event-loop thread (all the Python) and its other threads
(tokenizers' pool, the etcd client's gRPC threads), requests/s, client-side p50/p99 latency (and
p50 time to the first SSE chunk), RSS, and the CPU the client and the workers spent.

Security (``--security off auth auth+tls``): one stack per variant, all up at once, and every
measured run of a row taken in turn on each (interleaved, so load on the machine hits them
alike). ``auth``: the frontend takes an ``--api-keys-file`` of ``SECURITY_KEYS`` keys over
``SECURITY_TENANTS`` tenants whose limits (rps, tokens per minute, concurrency) are far above
what the load reaches, so every request is authenticated and charged to its tenant's account
but never refused; requests carry ``Authorization: Bearer``. ``auth+tls``: the same, with the
planes under mutual TLS (``--plane-ca/--plane-cert/--plane-key``, a throwaway CA). The run
ends with a ``security`` summary: each variant's CPU per request against ``off``, and plane
TLS's CPU per streamed token (frontend and workers) as ``auth+tls`` minus ``auth``.
``tracing``: every process exports its spans (``--otlp-endpoint``) to a receiver in the
benchmark's process that drops them: the cost of tracing every request, against ``off``.

Before and after (``--compare-src DIR``, the ``src`` of another checkout, e.g. a git worktree
of an earlier commit): every variant gets a second stack whose processes import turnout from
``DIR``, measured interleaved with this tree's in the same rounds; rows say their
``source`` (``tree`` or ``compare``), and the summary gives this tree's CPU per request
against the other's, variant by variant.

Usage::

    python benchmarks/frontend_overhead.py                    # defaults, JSON to results/
    python benchmarks/frontend_overhead.py --profile py-spy   # sampled CPU profile (py-spy)
    python benchmarks/frontend_overhead.py --profile cprofile # cProfile in thread CPU time
    python benchmarks/frontend_overhead.py --router-mode kv   # KV-aware routing's cost
    python benchmarks/frontend_overhead.py --scenarios multi_turn --prompt-cache-mib 64 0
    python benchmarks/frontend_overhead.py --security off auth auth+tls --repeat 5 \
        --scenarios short long_stream paced_stream --concurrency 16
    python benchmarks/frontend_overhead.py --security off auth --scenarios short \
        --compare-src /tmp/wt/src                     # this tree against another's

For scale (issue #2): Dynamo 1.6.1's Rust frontend spends ~0.6 ms CPU/request on ``short``
and 1.4-2.1 ms on ``long_stream`` on this kind of machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import http.server
import itertools
import json
import os
import pstats
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from tests.certs import TestCa  # noqa: E402
from tests.servers.etcd import EtcdServer  # noqa: E402
from tests.servers.nats import NatsServerProcess  # noqa: E402

from bench_http import LoadResult, percentile, run_load  # noqa: E402
from multi_turn import cache_row, prompt_cache_counters, run_conversations  # noqa: E402
from turnout.frontend.service import free_port  # noqa: E402

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hum",
]


def long_prompt(tokens: int = 512) -> str:
    from turnout.llm.model_card import default_gguf_path
    from turnout.llm.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_gguf_path())
    words: list[str] = []
    i = 0
    while len(tok.encode(" ".join(words))) < tokens:
        words.append(WORDS[i % len(WORDS)])
        i += 1
    return " ".join(words)


#: A tool the parsing scenarios offer, and the answer their echo worker streams back.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def chat_body(model: str, *, parsed: bool) -> dict[str, Any]:
    """A streamed chat request whose echo holds reasoning, an answer and a tool call."""
    reasoning = " ".join(WORDS[i % len(WORDS)] for i in range(60))
    answer = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(20))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    message = f"<think>{reasoning}</think>{answer}\n{call}"
    return {
        "model": model,
        "messages": [{"role": "user", "content": message}],
        "stream": True,
        "tools": [WEATHER_TOOL],
        "tool_choice": "auto" if parsed else "none",
    }


#: ``turnout serve --in-process``: the echo engines inside the frontend's process, so no
#: planes at all (what they cost: compare its rows with file+tcp+zmq's).
IN_PROCESS = "in-process"
#: Store+request plane+event plane stacks, and the in-process deployment.
PLANES = ("file+tcp+zmq", "etcd+tcp+zmq", "etcd+nats+nats", IN_PROCESS)


@contextlib.contextmanager
def plane_services(planes: str, tmp: Path) -> Iterator[list[str]]:
    """Start what ``planes`` needs (etcd, nats-server) on free ports; yield the flags every
    process of the stack takes."""
    if planes == IN_PROCESS:
        yield ["--log-level", "warning"]
        return
    store, request_plane, event_plane = planes.split("+")
    flags = ["--request-plane", request_plane, "--event-plane", event_plane,
             "--log-level", "warning"]  # fmt: skip
    with contextlib.ExitStack() as stack:
        if store == "etcd":
            etcd = stack.enter_context(EtcdServer(tmp / f"etcd-{planes}"))
            flags += ["--store", "etcd", "--store-endpoints", etcd.url]
        else:
            flags += ["--store", "file", "--store-path", str(tmp / f"{planes}.sqlite")]
        if "nats" in (request_plane, event_plane):
            nats = stack.enter_context(NatsServerProcess())
            flags += ["--nats-url", nats.url]
        yield flags


#: The variants ``--security`` may name (see the module docstring).
SECURITY = ("off", "auth", "auth+tls", "tracing")
#: Keys in the ``auth`` variants' keys file, spread over this many tenants.
SECURITY_KEYS = 8
SECURITY_TENANTS = 4


@dataclasses.dataclass(frozen=True)
class Security:
    """What one security variant adds: the frontend's flags, the workers' flags, and the
    headers every request carries."""

    variant: str
    frontend: list[str]
    workers: list[str]
    headers: list[tuple[str, str]]


def security_setup(variant: str, tmp: Path) -> Security:
    """Write what ``variant`` needs (a keys file, a CA and its leaves) under ``tmp``."""
    if variant == "off":
        return Security(variant, [], [], [])
    if variant == "tracing":
        sink = ["--otlp-endpoint", otlp_sink()]
        return Security(variant, list(sink), list(sink), [])
    keys = [f"sk-turnout-bench-{secrets.token_hex(16)}" for _ in range(SECURITY_KEYS)]
    tables = [
        f'[[keys]]\nsha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
        f'tenant = "tenant-{i % SECURITY_TENANTS}"\n'
        # Limits no run comes near: the cost of checking them, never a refusal.
        "rps = 1000000\ntokens_per_minute = 1000000000\nmax_concurrent = 100000\n"
        for i, key in enumerate(keys)
    ]
    keys_file = tmp / f"keys-{variant}.toml"
    keys_file.write_text("\n".join(tables))
    frontend = ["--api-keys-file", str(keys_file), "--public-route", "/metrics"]
    workers: list[str] = []
    if variant == "auth+tls":
        ca = TestCa(tmp, name=variant.replace("+", "-"))
        for role, flags in (("frontend", frontend), ("worker", workers)):
            leaf = ca.issue(role)
            flags += ["--plane-ca", leaf.ca, "--plane-cert", leaf.cert, "--plane-key", leaf.key]
    # The last key's tenant: the others are configured only to make the ring realistic.
    return Security(variant, frontend, workers, [("authorization", f"Bearer {keys[-1]}")])


_SINK: list[str] = []


def otlp_sink() -> str:
    """The URL of an OTLP/HTTP receiver in this process that takes every export and keeps
    nothing (started once, on a daemon thread): the ``tracing`` variant's spans go there."""
    if not _SINK:

        class Sink(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        _SINK.append(f"http://127.0.0.1:{server.server_address[1]}")
    return _SINK[0]


def render_request(host: str, path: str, body: bytes, headers: list[tuple[str, str]]) -> bytes:
    """A complete POST request with a JSON body and ``headers`` (sent as is every time)."""
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"{extra}content-length: {len(body)}\r\n\r\n"
    ).encode() + body


def wait_ready(url: str, workers: int, models: int = 1, timeout: float = 120) -> None:
    """Until ``models`` models each have ``workers`` live instances."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                body = json.loads(r.read())
            ready = [m for m in body["models"] if len(m["instances"]) >= workers]
            if len(ready) >= models:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise TimeoutError("stack did not come up")


def thread_cpu(proc: psutil.Process) -> tuple[float, float]:
    """(CPU seconds of the main thread, of all other threads) of ``proc``."""
    main = other = 0.0
    for t in proc.threads():
        if t.id == proc.pid:
            main += t.user_time + t.system_time
        else:
            other += t.user_time + t.system_time
    return main, other


def procs_cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        c = p.cpu_times()
        total += c.user + c.system
    return total


def measure(
    front: psutil.Process,
    workers: list[psutil.Process],
    load: Callable[[], Coroutine[Any, Any, LoadResult]],
    total: int,
    streamed: bool,
) -> dict[str, Any]:
    """Run ``load`` (``total`` requests) and measure it."""
    main0, other0 = thread_cpu(front)
    work0 = procs_cpu(workers)
    client0 = time.process_time()
    res = asyncio.run(load())
    client1 = time.process_time()
    main1, other1 = thread_cpu(front)
    work1 = procs_cpu(workers)
    if res.errors:
        raise RuntimeError(f"{res.errors} of {total} requests failed: {res.sample_body[:300]!r}")
    if streamed and not res.sample_body.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError(f"stream did not end with [DONE]: {res.sample_body[-300:]!r}")
    main, other = main1 - main0, other1 - other0
    ms = 1000 / total
    row: dict[str, Any] = {
        "requests": total,
        "requests_per_s": round(total / res.elapsed_s, 1),
        "frontend_cpu_ms_per_request": round((main + other) * ms, 3),
        "frontend_loop_thread_cpu_ms_per_request": round(main * ms, 3),
        "frontend_other_threads_cpu_ms_per_request": round(other * ms, 3),
        "latency_p50_ms": round(1000 * percentile(res.latencies_s, 0.5), 2),
        "latency_p99_ms": round(1000 * percentile(res.latencies_s, 0.99), 2),
    }
    if streamed:
        row["first_chunk_p50_ms"] = round(1000 * percentile(res.first_chunk_s, 0.5), 2)
    row["frontend_rss_mib"] = round(front.memory_info().rss / 2**20, 1)
    row["client_cpu_ms_per_request"] = round((client1 - client0) * ms, 3)
    row["workers_cpu_ms_per_request"] = round((work1 - work0) * ms, 3)
    return row


def summarize_pyspy(raw_path: Path, main_tid: int, top: int = 30) -> dict[str, Any]:
    """Self and inclusive sample counts per function from py-spy's raw (collapsed) output,
    for the event-loop thread (``main_tid``) and for all threads together."""
    self_counts: collections.Counter[str] = collections.Counter()
    incl_counts: collections.Counter[str] = collections.Counter()
    per_thread: collections.Counter[str] = collections.Counter()
    main_total = 0
    for line in raw_path.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not count_s.isdigit():
            continue
        count = int(count_s)
        frames = stack.split(";")
        thread = frames[0] if frames and frames[0].startswith("thread") else "?"
        per_thread[thread] += count
        if f"{main_tid:#x}" not in thread and str(main_tid) not in thread:
            continue
        main_total += count
        # "func (file:line)" -> "func (file)": aggregate per function, not per line
        frames = [f.rsplit(":", 1)[0] + ")" if f.endswith(")") else f
                  for f in frames[1:] if not f.startswith("process ")]  # fmt: skip
        if frames:
            self_counts[frames[-1]] += count
        for f in set(frames):
            incl_counts[f] += count

    def table(c: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(f, round(100 * n / max(main_total, 1), 1)) for f, n in c.most_common(top)]

    return {
        "samples_by_thread": dict(per_thread.most_common(10)),
        "loop_thread_samples": main_total,
        "self_pct": table(self_counts),
        "inclusive_pct": table(incl_counts),
    }


_Load = Callable[[], Coroutine[Any, Any, LoadResult]]


def scenario_load(
    args: argparse.Namespace,
    name: str,
    bodies: dict[str, tuple[dict[str, Any], bool, int]],
    port: int,
    conc: int,
    nonces: Iterator[int],
    headers: list[tuple[str, str]],
) -> tuple[_Load, _Load, int, bool]:
    """(a measured run, its warm-up, requests per run, streamed) of scenario ``name``."""
    if name == "multi_turn":
        n, turns = args.multi_turn_conversations, args.multi_turn_turns

        def conversations(count: int) -> _Load:
            # Each run's conversations are new: the cache holds nothing of them before.
            return lambda: run_conversations("127.0.0.1", port, "echo", conversations=count,
                                             turns=turns, concurrency=conc,
                                             nonce=next(nonces))  # fmt: skip

        return conversations(n), conversations(max(n // 4, conc)), n * turns, False
    body, streamed, total = bodies[name]
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    raw = render_request(f"127.0.0.1:{port}", path, json.dumps(body).encode(), headers)

    def repeated(count: int) -> _Load:
        return lambda: run_load("127.0.0.1", port, raw, count, conc, streamed=streamed)

    return repeated(total), repeated(max(total // 5, 2 * conc)), total, streamed


@dataclasses.dataclass
class Stack:
    """One running frontend and its workers, and what its rows are labelled with."""

    label: dict[str, Any]
    url: str
    port: int
    front: psutil.Process
    workers: list[psutil.Process]
    bodies: dict[str, tuple[dict[str, Any], bool, int]]
    headers: list[tuple[str, str]]


@contextlib.contextmanager
def start_stack(
    args: argparse.Namespace,
    planes: str,
    common: list[str],
    security: Security,
    prof_out: Path,
    mib: float | None,
    source: str | None = None,
) -> Iterator[Stack]:
    """Start a frontend (prompt cache of ``mib`` MiB; None: its default) and echo workers on
    ``common``'s planes with ``security``'s flags, importing turnout from ``source`` (a
    ``src`` directory; None: this tree's); stop them all on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    py = sys.executable
    front_only = ["--router-mode", args.router_mode, *security.frontend]
    if mib is not None:
        front_only += ["--prompt-cache-mib", str(mib)]
    front_args = ["frontend", "--port", str(port), *front_only, *common]
    front_cmd = [py, "-m", "turnout", *front_args]
    if args.profile == "cprofile":
        front_cmd = [py, str(ROOT / "benchmarks/profile_frontend.py"), str(prof_out), *front_args]
    paced = "paced_stream" in args.scenarios
    parsed = "chat_stream_parsed" in args.scenarios
    if planes == IN_PROCESS:
        if paced or parsed:
            raise SystemExit("in-process: the paced and parsed scenarios need more models")
        front_cmd = [py, "-m", "turnout", "serve", "--in-process", "--engine", "echo",
                     "--model-name", "echo", "--num-workers", str(args.workers),
                     "--port", str(port), *front_only, *common]  # fmt: skip
    worker_cmd = [py, "-m", "turnout", "worker", "--engine", "echo", *common,
                  *security.workers]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": source} if source is not None else None
    procs = [subprocess.Popen(front_cmd, start_new_session=True, env=env)]
    for _ in range(args.workers if planes != IN_PROCESS else 0):
        procs.append(subprocess.Popen([*worker_cmd, "--model-name", "echo"],
                                      start_new_session=True, env=env))  # fmt: skip
        if paced:
            procs.append(subprocess.Popen(
                [*worker_cmd, "--model-name", "echo-paced", "--echo-delay-ms",
                 str(args.paced_delay_ms), "--endpoint", "turnout/paced/generate"],
                start_new_session=True, env=env,
            ))  # fmt: skip
        if parsed:
            procs.append(subprocess.Popen(
                [*worker_cmd, "--model-name", "echo-parsed", "--tool-call-parser", "hermes",
                 "--reasoning-parser", "deepseek_r1", "--endpoint", "turnout/parsed/generate"],
                start_new_session=True, env=env,
            ))  # fmt: skip
    front_pid = procs[0].pid
    try:
        wait_ready(url, args.workers, models=1 + paced + parsed)
        bodies = {
            "short": ({"model": "echo", "prompt": "Hello, how are you?", "max_tokens": 1},
                      False, args.short_requests),
            "long_stream": ({"model": "echo", "prompt": long_prompt(512), "max_tokens": 64,
                             "stream": True}, True, args.stream_requests),
            "paced_stream": ({"model": "echo-paced", "prompt": long_prompt(512),
                              "max_tokens": 64, "stream": True}, True, args.stream_requests),
            "chat_stream": (chat_body("echo", parsed=False), True, args.stream_requests),
            "chat_stream_parsed": (chat_body("echo-parsed", parsed=True), True,
                                   args.stream_requests),
        }  # fmt: skip
        label = {"planes": planes, "security": security.variant,
                 "source": "tree" if source is None else "compare",
                 "router_mode": args.router_mode, "prompt_cache_mib": mib}  # fmt: skip
        yield Stack(label, url, port, psutil.Process(front_pid),
                    [psutil.Process(p.pid) for p in procs[1:]], bodies,
                    security.headers)  # fmt: skip
    finally:
        os.killpg(front_pid, signal.SIGINT)
        try:
            procs[0].wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(front_pid, signal.SIGKILL)
            procs[0].wait()
        for p in procs[1:]:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@contextlib.contextmanager
def profiled(profile: str | None, front_pid: int, prof_out: Path) -> Iterator[None]:
    """py-spy on the frontend for the block (``--profile py-spy``); cProfile runs inside the
    frontend's own process (``profile_frontend.py``) and needs nothing here."""
    if profile != "py-spy":
        yield
        return
    # Attached once the stack is up, so start-up (imports, tokenizer load) stays out of the
    # profile; the per-row warm-ups are steady state and stay in.
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    spy = subprocess.Popen([pyspy, "record", "--pid", str(front_pid), "--nonblocking",
                            "--threads", "-r", "250", "-f", "raw", "-o", str(prof_out)],
                           start_new_session=True)  # fmt: skip
    time.sleep(1.0)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=30)


def measure_stacks(args: argparse.Namespace, stacks: list[Stack]) -> list[dict[str, Any]]:
    """Every scenario at every concurrency on every stack: a warm-up each, then ``--repeat``
    rounds that measure one run on each stack in turn. A row per stack keeps the run with the
    median frontend CPU/request."""
    rows: list[dict[str, Any]] = []
    nonces = itertools.count()
    key = "frontend_cpu_ms_per_request"
    for name in args.scenarios:
        for conc in args.concurrency:
            loads = [scenario_load(args, name, st.bodies, st.port, conc, nonces, st.headers)
                     for st in stacks]  # fmt: skip
            for _, warm_up, _, _ in loads:
                asyncio.run(warm_up())
            runs: list[list[dict[str, Any]]] = [[] for _ in stacks]
            for _ in range(args.repeat):
                for st, (load, _, total, streamed), kept in zip(stacks, loads, runs, strict=True):
                    before = prompt_cache_counters(st.url)
                    run = measure(st.front, st.workers, load, total, streamed)
                    kept.append({**run, **cache_row(before, prompt_cache_counters(st.url))})
            for st, kept in zip(stacks, runs, strict=True):
                med = statistics.median_low([r[key] for r in kept])
                row = {**st.label, "scenario": name, "concurrency": conc,
                       **next(r for r in kept if r[key] == med)}  # fmt: skip
                if name in st.bodies and st.bodies[name][1]:
                    row["tokens_per_request"] = st.bodies[name][0].get("max_tokens")
                if args.repeat > 1:
                    row["cpu_ms_per_request_runs"] = [r[key] for r in kept]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def security_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario and concurrency: each variant's frontend CPU/request against ``off``'s,
    and plane TLS's CPU per streamed token (``auth+tls`` minus ``auth``; frontend and
    workers)."""
    Key = tuple[str, float | None, str, int, str]
    by: dict[Key, dict[str, dict[str, Any]]] = collections.defaultdict(dict)
    for row in rows:
        key = (row["planes"], row["prompt_cache_mib"], row["scenario"], row["concurrency"],
               row.get("source", "tree"))  # fmt: skip
        by[key][row["security"]] = row
    summary = []
    for (planes, mib, scenario, conc, source), variants in by.items():
        entry: dict[str, Any] = {"planes": planes, "prompt_cache_mib": mib,
                                 "scenario": scenario, "concurrency": conc,
                                 "source": source}  # fmt: skip
        off = variants.get("off")
        for variant, row in variants.items():
            entry[f"{variant}_cpu_ms_per_request"] = row["frontend_cpu_ms_per_request"]
            if off is not None and variant != "off":
                ratio = row["frontend_cpu_ms_per_request"] / off["frontend_cpu_ms_per_request"]
                entry[f"{variant}_vs_off_pct"] = round(100 * (ratio - 1), 1)
        auth, tls = variants.get("auth"), variants.get("auth+tls")
        tokens = (tls or {}).get("tokens_per_request")
        if auth is not None and tls is not None and tokens:
            for side, field in (("frontend", "frontend_cpu_ms_per_request"),
                                ("workers", "workers_cpu_ms_per_request")):  # fmt: skip
                extra_ms = tls[field] - auth[field]
                entry[f"plane_tls_{side}_us_per_token"] = round(1000 * extra_ms / tokens, 2)
        other = by.get((planes, mib, scenario, conc, "compare")) if source == "tree" else None
        for variant, row in variants.items():
            if other is not None and variant in other:
                ratio = (
                    row["frontend_cpu_ms_per_request"]
                    / other[variant]["frontend_cpu_ms_per_request"]
                )
                entry[f"{variant}_vs_compare_pct"] = round(100 * (ratio - 1), 1)
        summary.append(entry)
        print(json.dumps({"security": entry}), flush=True)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--short-requests", type=int, default=2000)
    ap.add_argument("--stream-requests", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=1, help="measured runs per row (median kept)")
    ap.add_argument("--scenarios", nargs="+", default=["short", "long_stream", "paced_stream"])
    ap.add_argument("--paced-delay-ms", type=float, default=2.0)
    ap.add_argument("--profile", choices=["py-spy", "cprofile"],
                    help="profile the frontend: py-spy (sampled, CPU only, low overhead) or "
                         "cprofile (deterministic, thread CPU time, slow)")  # fmt: skip
    ap.add_argument("--planes", nargs="+", default=["file+tcp+zmq"], choices=PLANES,
                    help="store+request plane+event plane stacks to measure, one after the "
                         "other in this run (etcd and NATS are started here)")  # fmt: skip
    ap.add_argument("--router-mode", default="round-robin", choices=["round-robin", "kv"],
                    help="the frontend's --router-mode (kv: KV-aware routing over the echo "
                         "workers' KV events)")  # fmt: skip
    ap.add_argument("--prompt-cache-mib", type=float, nargs="+", default=[None],
                    help="the frontend's --prompt-cache-mib (0: off); several values: one "
                         "stack each, one after the other (default: the frontend's)")  # fmt: skip
    ap.add_argument("--multi-turn-conversations", type=int, default=32,
                    help="multi_turn: conversations per run")  # fmt: skip
    ap.add_argument("--multi-turn-turns", type=int, default=12,
                    help="multi_turn: requests per conversation")  # fmt: skip
    ap.add_argument("--security", nargs="+", default=["off"], choices=SECURITY,
                    help="security variants, one stack each, measured interleaved: off, "
                         "auth (keys file, tenants' limits), auth+tls (and plane "
                         "mutual TLS)")  # fmt: skip
    ap.add_argument("--compare-src", metavar="DIR",
                    help="the src directory of another checkout: each variant also runs "
                         "on it, interleaved with this tree (before/after in one run)")  # fmt: skip
    ap.add_argument("--label", default="", help="free text stored in the JSON (e.g. 'before')")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/frontend_overhead.json"))
    args = ap.parse_args()

    results: dict[str, Any] = {
        "label": args.label,
        "machine": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        },
        "workers": args.workers,
        "router_mode": args.router_mode,
        "client": "bench_http (raw asyncio HTTP/1.1 keep-alive)",
        "scenarios": [],
    }
    sources: list[str | None] = [None]
    if args.compare_src is not None:
        sources.append(str(Path(args.compare_src).resolve()))
    if args.profile is not None and len(args.security) * len(sources) > 1:
        raise SystemExit("--profile profiles one frontend: give one --security variant")
    if "multi_turn" in args.scenarios and set(args.security) != {"off"}:
        raise SystemExit("multi_turn sends no key: run it with --security off")
    tmp = Path(tempfile.mkdtemp(prefix="turnout-bench-"))
    prof_out = tmp / ("frontend.prof" if args.profile == "cprofile" else "frontend.pyspy.txt")
    front_pid = 0
    for planes in args.planes:
        for mib in args.prompt_cache_mib:
            with contextlib.ExitStack() as running:
                stacks = []
                for variant, source in itertools.product(args.security, sources):
                    # A store of its own per stack: no frontend sees another stack's workers
                    # (nor the last stack's killed ones).
                    stack_tmp = Path(tempfile.mkdtemp(dir=tmp))
                    common = running.enter_context(plane_services(planes, stack_tmp))
                    security = security_setup(variant, stack_tmp)
                    stacks.append(running.enter_context(
                        start_stack(args, planes, common, security, prof_out, mib, source)
                    ))  # fmt: skip
                front_pid = stacks[0].front.pid
                with profiled(args.profile, front_pid, prof_out):
                    results["scenarios"] += measure_stacks(args, stacks)
    if len(args.security) > 1 or args.compare_src is not None:
        results["security"] = security_summary(results["scenarios"])
    if args.profile == "cprofile" and prof_out.exists():
        stats = pstats.Stats(str(prof_out))
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(30)
        results["profile_file"] = str(prof_out)
    elif args.profile == "py-spy" and prof_out.exists():
        summary = summarize_pyspy(prof_out, front_pid)
        results["profile_file"] = str(prof_out)
        results["profile"] = summary
        print(json.dumps(summary, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
