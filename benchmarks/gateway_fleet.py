"""The engines and gateways of ``benchmarks/gateways.py`` as processes: start, wait, read, stop.

* ``Fleet``: N ``turnout mocker-server`` processes (one simulated engine each, vLLM's or
  SGLang's face, native KV events on ZMQ with a replay socket), or N real llama.cpp servers
  (``tests.servers.llamacpp``: xllamacpp, one thread each). Started fresh for every gateway,
  so each one meets cold caches.
* ``Processes``: the gateway's processes (turnout's frontend and attach, or a peer), each in
  its own process group, with their CPU time read through psutil.
* ``EngineCounters``: what the engines' own ``/metrics`` say about the prompt tokens they
  were asked for and served from cache; the cached share of a run is the difference of two
  readings, so a warm-up request does not count.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks.process_groups import stop_process_groups  # noqa: E402

from turnout.frontend.service import free_port  # noqa: E402

#: (hits, queries) counter names per engine face: cached prompt tokens, prompt tokens asked.
#: llama.cpp counts the tokens it evaluated and those it reused apart; queries = their sum.
CACHE_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm": ("vllm:prefix_cache_hits_total", ("vllm:prefix_cache_queries_total",)),
    "sglang": ("sglang:cached_tokens_total", ("sglang:prompt_tokens_total",)),
    "llamacpp": (
        "llamacpp:prompt_tokens_cached_total",
        ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total"),
    ),
}


def get_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode(errors="replace")


def metric_sum(text: str, name: str) -> float:
    """Sum of every series of ``name`` in a Prometheus text page (0 when absent)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """One reading of every engine's prompt-cache counters."""

    hits: tuple[float, ...]
    queries: tuple[float, ...]

    def minus(self, before: EngineCounters) -> EngineCounters:
        return EngineCounters(
            tuple(a - b for a, b in zip(self.hits, before.hits, strict=True)),
            tuple(a - b for a, b in zip(self.queries, before.queries, strict=True)),
        )

    @property
    def cached_share(self) -> float | None:
        total = sum(self.queries)
        return sum(self.hits) / total if total else None

    @property
    def spread(self) -> float | None:
        """Max / mean of the prompt tokens each engine was asked for (1.0: perfectly even)."""
        total = sum(self.queries)
        return max(self.queries) / (total / len(self.queries)) if total else None


def wait_for(
    what: str, check: Callable[[], bool], timeout: float, alive: Callable[[], str | None]
) -> str | None:
    """Poll ``check`` every 0.2 s until it holds (None) or ``timeout`` passes or ``alive``
    reports a dead process (the reason). Exceptions of ``check`` count as "not yet"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = alive()
        if dead is not None:
            return dead
        with contextlib.suppress(OSError, ValueError, KeyError, httpx.HTTPError):
            if check():
                return None
        time.sleep(0.2)
    return f"{what} not ready in {timeout:.0f} s"


@dataclass
class Processes:
    """Processes started for one run, each in its own session; logs under ``tmp``."""

    tmp: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def spawn(
        self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                list(cmd),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def dead(self) -> str | None:
        """The first process that exited, with its log's tail; None while all run."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return f"{name} exited with status {proc.returncode}: {self.log_tail(name)}"
        return None

    def log_tail(self, name: str, lines: int = 6) -> str:
        path = self.tmp / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def log_text(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def cpu_seconds(self, names: Sequence[str]) -> dict[str, float]:
        """User + system CPU so far of each named process, its children included (a process
        that exited counts 0)."""
        out: dict[str, float] = {}
        for name in names:
            out[name] = 0.0
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(proc.pid)
                for p in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        t = p.cpu_times()
                        out[name] += t.user + t.system
        return out

    def stop(self, names: Sequence[str] | None = None) -> None:
        """SIGINT the named process groups (all when None), then SIGKILL what lingers."""
        chosen = list(self.procs) if names is None else [n for n in names if n in self.procs]
        stop_process_groups([self.procs[n] for n in chosen], grace_s=5.0)
        for name in chosen:
            del self.procs[name]


@dataclass(frozen=True, slots=True)
class MockerFlags:
    """The mocker's settings, the same for every gateway's fleet."""

    block_size: int = 64
    num_gpu_blocks: int = 8192
    max_num_batched_tokens: int = 8192
    max_model_len: int = 20000
    speedup_ratio: float = 1.0
    seed: int = 0

    def args(self) -> list[str]:
        return [
            "--block-size",
            str(self.block_size),
            "--num-gpu-blocks",
            str(self.num_gpu_blocks),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--max-model-len",
            str(self.max_model_len),
            "--speedup-ratio",
            repr(self.speedup_ratio),
            "--seed",
            str(self.seed),
        ]


@dataclass
class Fleet:
    """N engines of one face (``vllm``, ``sglang``: mocker-servers; ``llamacpp``: real)."""

    procs: Processes
    face: str
    #: KV block size of the engines (mocker-servers: ``MockerFlags.block_size``).
    block_size: int | None = None
    urls: list[str] = field(default_factory=list)
    kv_events: list[str] = field(default_factory=list)
    kv_replay: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [f"engine{i}" for i in range(len(self.urls))]

    def reset(self) -> None:
        """Forget the engines (after their processes were stopped), to start anew."""
        self.urls.clear()
        self.kv_events.clear()
        self.kv_replay.clear()

    def start_mockers(
        self,
        num: int,
        flags: MockerFlags,
        *,
        model_name: str,
        encoding: str = "array",
        hash_type: str = "int",
        timeout: float = 90,
    ) -> str | None:
        """Start ``num`` mocker-servers of this face with KV events; None once all answer
        ``/health``, else why not."""
        for i in range(num):
            port, pub, replay = free_port(), free_port(), free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [
                sys.executable,
                "-m",
                "turnout",
                "mocker-server",
                "--api",
                self.face,
                "--port",
                str(port),
                "--served-model-name",
                model_name,
                *flags.args(),
                "--kv-events-endpoint",
                f"tcp://127.0.0.1:{pub}",
                "--kv-events-replay-endpoint",
                f"tcp://127.0.0.1:{replay}",
                "--log-level",
                "warning",
            ]
            if self.face == "vllm":
                cmd += ["--kv-events-encoding", encoding, "--kv-events-hash-type", hash_type]
            self.procs.spawn(f"engine{i}", cmd)
            self.urls.append(url)
            self.kv_events.append(f"tcp://127.0.0.1:{pub}")
            self.kv_replay.append(f"tcp://127.0.0.1:{replay}")
        return self._wait_healthy(timeout)

    def start_llamacpp(
        self, num: int, model: str, *, n_ctx: int, parallel: int, timeout: float = 90
    ) -> str | None:
        """Start ``num`` llama.cpp servers (one thread each) serving the GGUF ``model``."""
        for i in range(num):
            port = free_port()
            cmd = [
                sys.executable,
                "-m",
                "tests.servers.llamacpp",
                str(port),
                model,
                "--n-ctx",
                str(n_ctx),
                "--parallel",
                str(parallel),
            ]
            self.procs.spawn(f"engine{i}", cmd)
            self.urls.append(f"http://127.0.0.1:{port}")
        return self._wait_healthy(timeout)

    def _wait_healthy(self, timeout: float) -> str | None:
        def all_healthy() -> bool:
            for url in self.urls:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status != 200:
                        return False
            return True

        return wait_for(
            f"{len(self.urls)} {self.face} engines", all_healthy, timeout, self.procs.dead
        )

    def read_counters(self) -> EngineCounters:
        """Every engine's (cached, asked) prompt tokens so far."""
        hits_name, query_names = CACHE_COUNTERS[self.face]
        hits: list[float] = []
        queries: list[float] = []
        for url in self.urls:
            text = get_text(url + "/metrics")
            hits.append(metric_sum(text, hits_name))
            queries.append(sum(metric_sum(text, n) for n in query_names))
        return EngineCounters(tuple(hits), tuple(queries))

    def cpu_seconds(self) -> float:
        """All engines' CPU so far."""
        return sum(self.procs.cpu_seconds(self.names).values())
