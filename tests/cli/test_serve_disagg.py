"""``turnout serve --num-prefill-workers``: real processes (frontend, a decode worker process
and a prefill worker process) on the file store, tcp request plane and zmq event plane."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.procs import start_serve, stop_serve, wait_until

from turnout.cli.main import build_parser
from turnout.cli.serve import ServeTree, prefill_endpoint, worker_argv
from turnout.errors import ConfigError, TurnoutError
from turnout.frontend.service import free_port


def disaggregation(url: str) -> dict[str, Any]:
    body = httpx.get(url + "/health", timeout=5).json()
    model = next((m for m in body["models"] if m["name"] == "mock"), None)
    return (model or {}).get("disaggregation") or {}


@pytest.mark.slow
def test_serve_runs_prefill_and_decode_workers(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(
        tmp_path, port, "--engine", "mocker", "--num-workers", "1", "--num-prefill-workers", "1",
        "--model-name", "mock", "--speedup-ratio", "0", "--num-gpu-blocks", "512",
        "--block-size", "16", "--prefill-min-tokens", "64", "--lease-ttl", "2",
    )  # fmt: skip

    def logs() -> str:
        return (tmp_path / "serve.log").read_text(errors="replace")[-4000:]

    try:
        wait_until(lambda: len(disaggregation(url).get("prefill_instances", [])) == 1, 60,
                   "the prefill worker", logs)  # fmt: skip
        assert disaggregation(url)["roles"] == ["decode"]
        body = {"model": "mock", "prompt": list(range(1000, 1300)), "max_tokens": 6,
                "nvext": {"extra_fields": ["routing"]}}  # fmt: skip
        r = httpx.post(url + "/v1/completions", timeout=30, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] == 6
        routing = out["nvext"]["routing"]
        assert routing["disaggregated"] is True, routing
        assert routing["kv_transfer"]["mode"] == "pull"
    finally:
        stop_serve(proc)


def serve_args(*extra: str) -> Any:
    return build_parser().parse_args(["serve", "--engine", "mocker", *extra])


def test_prefill_workers_get_their_own_process_and_endpoint() -> None:
    args = serve_args("--num-workers", "3", "--num-prefill-workers", "2")
    decode = worker_argv(args, "/s", 1, role="decode")
    prefill = worker_argv(args, "/s", 1, role="prefill", count=2)
    assert decode[decode.index("--role") + 1] == "decode"
    assert decode[decode.index("--num-workers") + 1] == "3"
    assert prefill[prefill.index("--role") + 1] == "prefill"
    assert prefill[prefill.index("--num-workers") + 1] == "2"
    assert prefill[prefill.index("--endpoint") + 1] == prefill_endpoint(args.endpoint)
    assert prefill_endpoint("ns/backend/generate") == "ns/prefill/generate"
    plain = worker_argv(serve_args(), "/s", 1)
    assert "--role" not in plain


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--num-prefill-workers", "-1"], "--num-prefill-workers must be 0 or more"),
        (["--num-prefill-workers", "1", "--num-workers", "0"], "needs decode workers"),
    ],
)
def test_bad_prefill_settings_are_refused(extra: list[str], words: str) -> None:
    with pytest.raises(TurnoutError, match=words):
        ServeTree(serve_args(*extra))


def test_prefill_workers_need_the_mocker() -> None:
    args = build_parser().parse_args(["serve", "--engine", "echo", "--num-prefill-workers", "1"])
    with pytest.raises(TurnoutError, match="only the mocker engine"):
        ServeTree(args)


def test_serve_passes_the_parsers_to_its_workers_and_refuses_unknown_ones() -> None:
    args = serve_args("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    argv = worker_argv(args, "/s", 1)
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes"
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    assert "--tool-call-parser" not in worker_argv(serve_args(), "/s", 1)
    with pytest.raises(ConfigError, match="unknown tool-call parser 'hermez'"):
        ServeTree(serve_args("--tool-call-parser", "hermez"))
