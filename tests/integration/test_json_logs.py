"""``--log-format json`` on real processes: every line a frontend and a worker write is one
JSON object, and the lines about one request carry its id in both processes (the worker's
with the model and the instance that served it)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from tests.integration.procs import ProcessSet, health, start_serve, stop_serve, wait_until

from turnout.frontend.service import free_port

FLAGS = ("--log-format", "json", "--log-level", "debug", "--log-prompts")


def json_lines(path: Path) -> list[dict[str, object]]:
    """Every line of ``path`` decoded; a line that is not one JSON object fails the test."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        entry = json.loads(line)
        assert isinstance(entry, dict), f"{path.name}:{number} is not an object: {line}"
        assert {"time", "level", "logger", "pid", "message"} <= set(entry), line
        entries.append(entry)
    return entries


def test_frontend_and_worker_lines_are_json_and_share_the_request_id(tmp_path: Path) -> None:
    procs = ProcessSet(tmp_path)
    try:
        procs.worker("--engine", "mocker", "--model-name", "m", *FLAGS)
        procs.frontend(*FLAGS)
        wait_until(lambda: bool(health(procs.url).get("m")), 60, "the model", procs.logs)
        with httpx.stream(
            "POST",
            procs.url + "/v1/chat/completions",
            json={
                "model": "m",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 4,
                "stream": True,
            },
            headers={"x-request-id": "trace-me-42"},
            timeout=30,
        ) as response:
            assert response.headers["x-request-id"] == "trace-me-42"
            assert [line for line in response.iter_lines() if line][-1] == "data: [DONE]"
        (instance,) = health(procs.url)["m"]

        def lines_of(kind: str) -> list[dict[str, object]]:
            (path,) = tmp_path.glob(f"{kind}-*.log")
            return [
                e
                for e in json_lines(path)
                if str(e.get("request_id", "")).startswith("trace-me-42.")
            ]

        wait_until(lambda: bool(lines_of("worker")), 10, "the worker's line", procs.logs)
        frontend, worker = lines_of("frontend"), lines_of("worker")
        assert frontend and worker
        ids = {e["request_id"] for e in frontend + worker}
        assert len(ids) == 1, ids  # one request, one id, in both processes
        assert any(e.get("model") == "m" for e in frontend)
        assert all(e["model"] == "m" and e["instance"] == instance for e in worker), worker
    finally:
        procs.close()
    for path in tmp_path.glob("*.log"):
        json_lines(path)  # every line, the start-up and shut-down ones included


def test_serve_passes_the_json_format_to_its_workers(tmp_path: Path) -> None:
    port = free_port()
    proc = start_serve(tmp_path, port, "--engine", "mocker", "--log-format", "json")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: any(health(url).values()), 90, "serve's workers")
    finally:
        stop_serve(proc)
    entries = json_lines(tmp_path / "serve.log")
    pids = {e["pid"] for e in entries}
    assert len(pids) >= 2, entries  # serve's own lines and its worker's, all JSON
    assert proc.returncode == 0, proc.returncode
