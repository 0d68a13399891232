"""llama.cpp's own HTTP server (``xllamacpp.Server`` on a port) as a test server process.

``python -m tests.servers.llamacpp PORT MODEL [--n-ctx N] [--parallel N]`` runs it in the
foreground until killed; ``LlamaCppServer`` starts it as a child process and waits for
``/health``. One thread per server and small contexts: the test machine has two cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Self

import httpx

from .process import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[2]


class LlamaCppServer(ServerProcess):
    """A llama.cpp server on ``127.0.0.1:port`` serving ``model`` (a GGUF path)."""

    def __init__(
        self,
        model: str,
        log_dir: Path,
        *,
        n_ctx: int = 2048,
        parallel: int = 2,
        name: str = "llama",
    ) -> None:
        super().__init__()
        self.model = model
        self.port = free_port("127.0.0.1")
        self.n_ctx = n_ctx
        self.parallel = parallel
        self.log_path = log_dir / f"{name}-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        args = [sys.executable, "-m", "tests.servers.llamacpp", str(self.port), self.model,
                "--n-ctx", str(self.n_ctx), "--parallel", str(self.parallel)]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited:\n{self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"llama.cpp server on {self.port} not ready in {timeout} s")

    def slots(self) -> list[dict[str, object]]:
        answer: list[dict[str, object]] = httpx.get(self.url + "/slots", timeout=5).json()
        return answer


def main() -> None:
    import xllamacpp

    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("model")
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--parallel", type=int, default=2)
    args = parser.parse_args()
    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.n_ctx = args.n_ctx
    params.n_parallel = args.parallel
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.endpoint_metrics = True
    params.endpoint_slots = True
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    params.verbosity = -1
    server = xllamacpp.Server(params)
    print("listening", server.listening_address, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
