"""The peer gateways ``benchmarks/gateways.py`` measures turnout against, each in a venv of its own.

* **SGLang's gateway** (``pip install smg``; console script ``smg``; measured: 1.13.0)::

      smg launch --host 127.0.0.1 --port P --worker-urls URL... --policy cache_aware|round_robin
                 --prometheus-host 127.0.0.1 --prometheus-port M --log-level warn

  Over HTTP it registers a worker from ``/health``, ``/v1/models``, ``/server_info``,
  ``/model_info`` (SGLang) or ``/version`` (vLLM), and polls ``/loads`` and ``/metrics``.
  Its ``/v1/completions`` refuses a token-id ``prompt`` (``StringOrArray``: strings only), so
  token-exact traffic goes through SGLang's own ``/generate`` with ``input_ids``, which it
  relays to the worker: the workers wear SGLang's face. ``cache_aware`` keys its radix tree
  on the request's text (characters) or ids; KV events it reads only from gRPC workers.
  Its metrics listener binds ``0.0.0.0:29000`` unless told otherwise.
* **vLLM's router** (``pip install vllm-router``; console script ``vllm-router``; measured:
  0.1.17)::

      vllm-router --host 127.0.0.1 --port P --worker-urls URL... --policy cache_aware|round_robin
                  --prometheus-host 127.0.0.1 --prometheus-port M --log-level warning
      # exact KV routing from the workers' ZMQ events (one flag pair per worker):
      vllm-router ... --policy kv_aware --kv-event-source URL=tcp://H:P
                  --kv-event-replay-source URL=tcp://H:R --kv-event-block-size B --kv-event-model M

  It relays ``/v1/completions`` with a token-id ``prompt`` as is (its ``cache_aware`` tree
  keys token ids as characters), so the workers wear vLLM's face. Its ``kv_aware`` decoder
  takes only vLLM 0.29's wire contract: the batch an array ``[ts, events, rank]``, each event
  a tagged *map* with every field present, block hashes as 32-byte digests, ``medium``
  ``"GPU"``; a batch it cannot read is dropped whole (logged ``kv_index decode batch``).

Both are installed on first use into ``~/.cache/turnout-bench/<name>-venv`` (override with
``$TURNOUT_SMG_VENV`` / ``$TURNOUT_VLLM_ROUTER_VENV``) with a Python >= 3.10 found on the
machine; a peer that cannot be installed or started is recorded with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CACHE = Path.home() / ".cache" / "turnout-bench"
#: Interpreters tried (first found) to build a peer's venv; the peers ship abi3 wheels.
PYTHONS = ("python3.12", "python3.13", "python3.11", "python3.10")
PYENV_ROOT = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))


@dataclass(frozen=True, slots=True)
class Peer:
    """A gateway installed from PyPI into a venv of its own."""

    #: Label in the benchmark's output.
    name: str
    #: PyPI distribution (and ``importlib.metadata`` name).
    package: str
    #: Console script in the venv's ``bin``.
    script: str
    #: Environment variable that names another venv.
    env: str
    #: The engine face its workers must wear for token-exact traffic (see the docstring).
    face: str

    @property
    def venv(self) -> Path:
        return Path(os.environ.get(self.env) or CACHE / f"{self.name}-venv")

    @property
    def executable(self) -> Path:
        return self.venv / "bin" / self.script

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


SMG = Peer("smg", "smg", "smg", "TURNOUT_SMG_VENV", face="sglang")
VLLM_ROUTER = Peer(
    "vllm-router", "vllm-router", "vllm-router", "TURNOUT_VLLM_ROUTER_VENV", face="vllm"
)
PEERS = {p.name: p for p in (SMG, VLLM_ROUTER)}
#: What the benchmark's output says about how each gateway was run (measured, see above).
NOTES = {
    "turnout": (
        "turnout frontend --router-mode kv|round-robin and one turnout attach for all engines "
        "(--url and --kv-events/--kv-events-replay per engine; the attach process rehashes the "
        "engines' native KV events); its CPU is the frontend's and attach's"
    ),
    "smg": (
        "its /v1/completions refuses a token-id prompt (StringOrArray: strings only), so it gets "
        "SGLang's /generate with input_ids and the engines wear SGLang's face (streamed output "
        "cumulative, SGLang's default); it polls /loads and /v1/loads, which the mocker-server's "
        "SGLang face does not serve (404), and /metrics, which it does; its cache_aware tree "
        "guesses from the requests (KV events only from gRPC workers)"
    ),
    "vllm-router": (
        "relays /v1/completions with a token-id prompt to vLLM's face; cache_aware keys the ids "
        "as characters in its tree; kv_aware decodes only vLLM 0.29's KV-event wire contract "
        "(the batch an array, events tagged maps with every field, 32-byte digests, medium GPU): "
        "turnout mocker-server --kv-events-encoding map writes the batch as a map as well, so "
        "kv_aware drops every batch and is recorded as skipped"
    ),
}


def _find_python() -> str | None:
    """An interpreter of another version than turnout's is fine: each peer has its own venv."""
    for name in PYTHONS:
        found = shutil.which(name)
        if found is not None:
            # pyenv shims exist for versions that are not selected; they fail when run.
            ok = subprocess.run([found, "-c", "pass"], capture_output=True, timeout=30)
            if ok.returncode == 0:
                return found
        version = name.removeprefix("python")
        for candidate in sorted(PYENV_ROOT.glob(f"versions/{version}*/bin/{name}"), reverse=True):
            return str(candidate)
    return sys.executable


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def ensure_installed(peer: Peer, *, install: bool = True, timeout: float = 900) -> str | None:
    """None when ``peer``'s console script is there (installing it first when allowed), else
    one line saying why it is not."""
    if peer.executable.exists():
        return None
    if not install:
        return f"{peer.package} is not installed in {peer.venv} (run without --no-install)"
    python = _find_python()
    if python is None:
        return "no Python interpreter to build a venv with"
    peer.venv.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{peer.name}] installing {peer.package} into {peer.venv} ...", flush=True)
    steps = [
        [python, "-m", "venv", str(peer.venv)],
        [str(peer.python), "-m", "pip", "install", "-q", peer.package],
    ]
    for cmd in steps:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"`{' '.join(cmd)}` failed: {exc}"
        if out.returncode != 0:
            return f"`{' '.join(cmd)}` exited {out.returncode}: {_tail(out.stderr or out.stdout)}"
    if not peer.executable.exists():
        return f"{peer.package} installed but {peer.executable} is missing"
    return None


def installed_version(peer: Peer) -> str | None:
    """The peer's version as its venv's package metadata says."""
    code = f"import importlib.metadata as m; print(m.version({peer.package!r}))"
    try:
        out = subprocess.run(
            [str(peer.python), "-c", code], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def peer_env() -> dict[str, str]:
    """The environment of a peer process: no turnout venv leaking into its interpreter, and
    no colour codes in its logs."""
    env = dict(os.environ)
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(name, None)
    env["NO_COLOR"] = "1"
    env["RUST_LOG_STYLE"] = "never"
    return env


def smg_command(
    *, port: int, metrics_port: int, worker_urls: Sequence[str], policy: str
) -> list[str]:
    """``smg launch`` in front of ``worker_urls`` with ``policy``, everything on 127.0.0.1."""
    return [
        str(SMG.executable),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warn",
    ]


def vllm_router_command(
    *,
    port: int,
    metrics_port: int,
    worker_urls: Sequence[str],
    policy: str,
    kv_events: Sequence[str] = (),
    kv_replay: Sequence[str] = (),
    block_size: int = 16,
    model: str | None = None,
) -> list[str]:
    """``vllm-router`` in front of ``worker_urls``; ``kv_events`` (one ZMQ endpoint per worker,
    same order) feed its ``kv_aware`` index."""
    cmd = [
        str(VLLM_ROUTER.executable),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warning",
    ]
    for url, endpoint in zip(worker_urls, kv_events, strict=False):
        cmd += ["--kv-event-source", f"{url}={endpoint}"]
    for url, endpoint in zip(worker_urls, kv_replay, strict=False):
        cmd += ["--kv-event-replay-source", f"{url}={endpoint}"]
    if kv_events:
        cmd += ["--kv-event-block-size", str(block_size)]
        if model is not None:
            cmd += ["--kv-event-model", model]
    return cmd
