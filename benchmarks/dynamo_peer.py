"""A Dynamo 1.6.1 stack (frontend + mocker workers) to benchmark turnout against.

Dynamo lives in its own virtual environment (its wheels pin other versions of what turnout
uses): ``$TURNOUT_DYNAMO_PYTHON``, else ``/work/dynamo-venv/bin/python``. Install it with::

    python3.11 -m venv /work/dynamo-venv
    /work/dynamo-venv/bin/pip install ai-dynamo-runtime==1.6.1
    /work/dynamo-venv/bin/pip install --no-deps ai-dynamo==1.6.1
    /work/dynamo-venv/bin/pip install pyyaml msgspec packaging zstandard uvloop

How the stack runs on one machine without etcd or NATS (verified on 1.6.1):

* discovery on files: ``--discovery-backend file`` with ``DYN_FILE_KV=<dir>`` (a private
  directory per stack, so stacks never see each other);
* requests over TCP (``--request-plane tcp``), KV events and load over ZMQ
  (``--event-plane zmq``, the default for the file backend);
* ``python -m dynamo.frontend --http-host 127.0.0.1 --http-port P --router-mode kv``;
* ``python -m dynamo.mocker --model-path DIR --model-name M --num-workers N --block-size B
  --num-gpu-blocks-override G --speedup-ratio R``: N workers in one process (each with its
  own runtime). ``DIR`` needs a Hugging Face tokenizer and a ``config.json`` (the mocker
  derives KV bytes per token from it); there is no network, so ``write_model_dir`` builds
  a word-level tokenizer whose token ``i`` is the word ``w{i}`` (ids 0..49999).
* ``HOME`` points into the stack's temp dir: Dynamo caches model cards under
  ``~/.cache/dynamo/mdc``.

Requests: the body turnout's benchmarks send works unchanged (``request_body``): a token-id
``prompt``, top-level ``ignore_eos``, ``stream_options.include_usage``. The final usage chunk
carries ``usage.prompt_tokens_details.cached_tokens`` (the mocker's prefix-cache hit, whole
blocks). One difference: ``nvext.worker_id`` comes back as an object
``{"prefill_worker_id": int, "decode_worker_id": int, ...}``, not a string; ``worker_label``
turns either form into a hashable label.

Client caveat (measured): a request sent on a kept-alive connection to Dynamo's frontend
within ~30 ms of that connection's previous response waits ~25 ms longer (TTFT 47 ms instead
of 23 ms for a 128-token prompt at speedup 1; turnout's frontend shows no such stall). It
is wall time, so x speedup in simulated time. Use a fresh connection per request (httpx:
``Limits(max_keepalive_connections=0)``) or keep 60 ms between a connection's requests.

Mocker pacing (measured, 1.6.1): ``--speedup-ratio 0`` does not mean "no delays": a
6-token, 1-token request takes ~19 ms and a 64-token stream ~380 ms. With a large ratio
(1e3 to 1e9) every step still takes ~0.7 ms (a tokio sleep rounds up to the timer's 1 ms
tick), so a 64-token stream lasts ~44 ms however large the ratio; turnout's mocker steps in
tens of microseconds at the same ratio.

Smoke test: ``.venv/bin/python benchmarks/dynamo_peer.py`` (2 workers, 3 requests). The
side-by-side frontend CPU benchmark built on this module: ``frontend_vs_dynamo.py``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.process_groups import stop_process_groups

DEFAULT_DYNAMO_PYTHON = Path("/work/dynamo-venv/bin/python")
#: Vocabulary of the generated tokenizer: covers the benchmarks' token ids (< 50000).
VOCAB_SIZE = 50000
#: Dynamo's own log level for the stack's processes (``DYN_LOG``); per-request INFO lines
#: would cost CPU under load.
DEFAULT_LOG_LEVEL = "warn"


def dynamo_python() -> Path | None:
    """The interpreter of the Dynamo venv, or None when there is none."""
    env = os.environ.get("TURNOUT_DYNAMO_PYTHON")
    if env:
        return Path(env)
    if DEFAULT_DYNAMO_PYTHON.exists():
        return DEFAULT_DYNAMO_PYTHON
    return None


@functools.cache
def dynamo_unavailable() -> str | None:
    """None when Dynamo's frontend and mocker import, else one line saying why not."""
    python = dynamo_python()
    if python is None:
        return f"Dynamo is not installed (no $TURNOUT_DYNAMO_PYTHON, no {DEFAULT_DYNAMO_PYTHON})"
    if not python.exists():
        return f"Dynamo's python {python} does not exist"
    code = (
        "import importlib.metadata as m, dynamo.frontend.main, dynamo.mocker.main;"
        "print(m.version('ai-dynamo'))"
    )
    try:
        out = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=120,
            env=_child_env(None),
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"Dynamo's python {python} does not run: {exc}"
    if out.returncode != 0:
        lines = (out.stderr or out.stdout).strip().splitlines()
        return f"Dynamo fails to import with {python}: {lines[-1] if lines else out.returncode}"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_model_dir(path: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """A tokenizer-only "model" Dynamo accepts: word ``w{i}`` is token ``i``.

    ``tokenizer.json`` (WordLevel, whitespace split), ``tokenizer_config.json`` (with a
    trivial chat template), ``config.json`` (a Llama-8B-like shape: 32 layers, 8 KV heads of
    128, bf16, which the mocker reads for KV bytes per token) and ``generation_config.json``.
    """
    path.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update((f"w{i}", i) for i in range(len(specials), vocab_size))
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, tok in enumerate(specials)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": False,
                "model_max_length": 131072,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
            }
        )
    )
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "max_position_embeddings": 131072,
                "vocab_size": vocab_size,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "torch_dtype": "bfloat16",
            }
        )
    )
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


def request_body(model: str, tokens: Sequence[int], max_tokens: int) -> bytes:
    """A streamed token-id completion, as turnout's benchmarks send it (Dynamo takes it as is)."""
    return json.dumps(
        {
            "model": model,
            "prompt": list(tokens),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "nvext": {"extra_fields": ["worker_id"]},
        }
    ).encode()


def worker_label(worker_id: Any) -> str | None:
    """A hashable worker label from ``nvext.worker_id``: turnout sends a string, Dynamo an
    object ``{"prefill_worker_id", "decode_worker_id", ...}`` (the decode worker is used)."""
    if worker_id is None or isinstance(worker_id, str):
        return worker_id
    if isinstance(worker_id, dict):
        wid = worker_id.get("decode_worker_id", worker_id.get("prefill_worker_id"))
        rank = worker_id.get("decode_dp_rank", worker_id.get("prefill_dp_rank"))
        return f"{wid}" if not rank else f"{wid}/{rank}"
    return str(worker_id)


def _child_env(tmp: Path | None, log_level: str = DEFAULT_LOG_LEVEL) -> dict[str, str]:
    env = dict(os.environ)
    # Never let a turnout venv leak into Dynamo's interpreter.
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    env["HF_HUB_OFFLINE"] = "1"
    env["DYN_LOG"] = log_level
    if tmp is not None:
        env["HOME"] = str(tmp / "home")
        env["XDG_CACHE_HOME"] = str(tmp / "home" / ".cache")
        env["HF_HOME"] = str(tmp / "home" / "hf")
        env["TMPDIR"] = str(tmp)
        env["DYN_FILE_KV"] = str(tmp / "store_kv")
        env["DYN_DISCOVERY_BACKEND"] = "file"
        env["DYN_REQUEST_PLANE"] = "tcp"
        env["DYN_EVENT_PLANE"] = "zmq"
    return env


def _get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


@dataclass
class DynamoStack:
    """Dynamo's frontend and one mocker process (``num_workers`` workers) on a file store."""

    tmp: Path
    port: int = field(default_factory=free_port)
    log_level: str = DEFAULT_LOG_LEVEL
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, name: str, module: str, args: Sequence[str]) -> subprocess.Popen[bytes]:
        python = dynamo_python()
        assert python is not None
        with open(self.tmp / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [str(python), "-m", module, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_child_env(self.tmp, self.log_level),
                cwd=self.tmp,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, lines: int = 8) -> str:
        path = self.tmp / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def start(
        self,
        *,
        model_name: str,
        num_workers: int,
        block_size: int,
        num_gpu_blocks: int,
        speedup_ratio: float,
        router_mode: str = "kv",
        router_args: Sequence[str] = (),
        mocker_args: Sequence[str] = (),
        timeout: float = 180,
    ) -> str | None:
        """Start the frontend and the workers; None once ``/v1/models`` lists ``model_name``
        and the frontend sees ``num_workers`` instances, else a one-line reason + log tail."""
        why = dynamo_unavailable()
        if why is not None:
            return why
        self.tmp.mkdir(parents=True, exist_ok=True)
        (self.tmp / "home").mkdir(exist_ok=True)
        model_dir = write_model_dir(self.tmp / "model")
        plane = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
        self._spawn(
            "frontend",
            "dynamo.frontend",
            ["--http-host", "127.0.0.1", "--http-port", str(self.port),
             "--router-mode", router_mode, *plane, *router_args],
        )  # fmt: skip
        self._spawn(
            "mocker",
            "dynamo.mocker",
            ["--model-path", str(model_dir), "--model-name", model_name,
             "--num-workers", str(num_workers), "--block-size", str(block_size),
             "--num-gpu-blocks-override", str(num_gpu_blocks),
             "--speedup-ratio", repr(float(speedup_ratio)), *plane, *mocker_args],
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    return f"{name} exited with status {proc.returncode}: {self.log_tail(name)}"
            with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
                models = _get_json(self.url + "/v1/models").get("data", [])
                health = _get_json(self.url + "/health")
                seen = sum(
                    1 for i in health.get("instances", []) if i.get("endpoint") == "generate"
                )
                if any(m.get("id") == model_name for m in models) and seen >= num_workers:
                    return None
            time.sleep(0.2)
        return (
            f"Dynamo stack not ready in {timeout:.0f} s ({seen}/{num_workers} workers): "
            f"{self.log_tail('mocker', 4)} | {self.log_tail('frontend', 4)}"
        )

    def stop(self) -> None:
        """SIGINT every process group, wait, then SIGKILL what is left. Idempotent."""
        stop_process_groups(self.procs.values())
        self.procs.clear()

    def __enter__(self) -> DynamoStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ------------------------------------------------------------------------------ a client


@dataclass(slots=True)
class StreamResult:
    """One streamed completion as the client saw it (wall seconds from the send)."""

    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    worker: str | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] if self.token_times else None


def stream_completion(url: str, body: bytes, timeout: float = 120) -> StreamResult:
    """POST one streamed completion with the standard library; token arrival times."""
    result = StreamResult()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    result.error = str(obj["error"])
                    break
                choices = obj.get("choices") or []
                if choices and choices[0].get("text"):
                    result.token_times.append(time.perf_counter() - start)
                if choices and choices[0].get("finish_reason"):
                    result.finish_reason = choices[0]["finish_reason"]
                if choices and (nvext := obj.get("nvext")):
                    result.worker = worker_label(nvext.get("worker_id"))
                if usage := obj.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.completion_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
    except (OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _smoke() -> int:
    why = dynamo_unavailable()
    if why is not None:
        print(f"skipped: {why}")
        return 1
    model = "dynamo-smoke"
    with tempfile.TemporaryDirectory(prefix="dynamo-peer-") as tmp:
        stack = DynamoStack(Path(tmp))
        try:
            t0 = time.monotonic()
            err = stack.start(
                model_name=model, num_workers=2, block_size=64, num_gpu_blocks=4096,
                speedup_ratio=10.0,
            )  # fmt: skip
            if err is not None:
                print(f"start failed: {err}")
                return 1
            print(f"stack up in {time.monotonic() - t0:.1f} s at {stack.url}")
            rng = random.Random(0)
            prompt = [rng.randint(1000, 40000) for _ in range(300)]
            fresh = [rng.randint(1000, 40000) for _ in range(200)]
            for i, tokens in enumerate([prompt, prompt, fresh]):
                r = stream_completion(stack.url, request_body(model, tokens, 8))
                ttft = f"{r.ttft_s * 1000:.1f} ms" if r.ttft_s is not None else "-"
                print(
                    f"request {i}: error={r.error} prompt={r.prompt_tokens} "
                    f"output={r.completion_tokens} cached={r.cached_tokens} "
                    f"finish={r.finish_reason} worker={r.worker} ttft={ttft}"
                )
        finally:
            stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_smoke())
