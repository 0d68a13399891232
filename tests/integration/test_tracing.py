"""Traces across real processes: a frontend and two mocker workers on the tcp plane export
over OTLP/HTTP to a receiver in the test (the official protobuf messages, decoded as a
collector would). One streamed request that continues a client's ``traceparent`` and migrates
when its worker is killed mid-stream yields one tree of spans under the client's span, across
the frontend and the worker that finished it, with an ``attempt`` span per worker tried."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from tests.integration.procs import ProcessSet, health, wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
#: The mocker at its real step times: a few milliseconds a token, so the stream is still
#: running when its worker is killed.
WORKER = ("--engine", "mocker", "--model-name", "m", "--speedup-ratio", "1")


class Receiver:
    """An OTLP/HTTP trace receiver: every span POSTed to ``/v1/traces``, with its service."""

    def __init__(self) -> None:
        self.spans: list[dict[str, object]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                ok = self.path == "/v1/traces" and self.headers["content-type"] == (
                    "application/x-protobuf"
                )
                if ok:
                    receiver.take(body)
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value for a in resource_spans.resource.attributes}
            service = attributes["service.name"].string_value
            pid = attributes["process.pid"].int_value
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    entry = {
                        "service": service,
                        "pid": pid,
                        "name": span.name,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent": span.parent_span_id.hex(),
                        "events": [e.name for e in span.events],
                        "attributes": {
                            a.key: a.value.string_value or a.value.int_value
                            for a in span.attributes
                        },
                        "error": span.status.code == span.status.STATUS_CODE_ERROR,
                        "start": span.start_time_unix_nano,
                    }
                    with self.lock:
                        self.spans.append(entry)

    def snapshot(self) -> list[dict[str, object]]:
        with self.lock:
            return list(self.spans)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def test_a_migrated_stream_is_one_trace_across_the_frontend_and_workers(
    tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export every 0.2 s
    trace = ("--otlp-endpoint", receiver.url)
    procs = ProcessSet(tmp_path)
    try:
        first = procs.worker(*WORKER, *trace)
        procs.frontend("--migration-limit", "3", *trace)
        wait_until(lambda: len(health(procs.url).get("m", [])) == 1, 60, "worker 1", procs.logs)
        (first_instance,) = health(procs.url)["m"]
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 400,
            "min_tokens": 400,
            "stream": True,
        }
        with httpx.stream(
            "POST",
            procs.url + "/v1/chat/completions",
            json=body,
            headers={"traceparent": TRACEPARENT, "x-request-id": "traced-1"},
            timeout=120,
        ) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            chunks = 0
            for line in lines:  # a few tokens from the only worker, then a second one
                chunks += line.startswith("data: {")
                if chunks == 5:
                    break
            procs.worker(*WORKER, *trace)
            wait_until(lambda: len(health(procs.url)["m"]) == 2, 60, "worker 2", procs.logs)
            os.killpg(first.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
        (second_instance,) = set(health(procs.url)["m"]) - {first_instance} or {None}

        def spans() -> list[dict[str, object]]:
            return [s for s in receiver.snapshot() if s["trace_id"] == TRACE_ID]

        def complete() -> bool:
            names = [(s["service"], s["name"]) for s in spans()]
            return ("turnout-frontend", "POST /v1/chat/completions") in names and (
                "turnout-worker",
                "generate",
            ) in names

        wait_until(complete, 30, "the request's spans", procs.logs)
    finally:
        procs.close()
    got = spans()
    assert all(s["trace_id"] == TRACE_ID for s in got)
    by_id = {s["span_id"]: s for s in got}
    # One tree under the client's span.
    # The killed worker exported the spans it had ended (its engine's prefill stage), never
    # their parent (its generate span, still open when it died): the only spans besides the
    # root whose parent the collector never got.
    orphans = [s for s in got if s["parent"] not in by_id and s["parent"] != CLIENT_SPAN]
    assert all(s["pid"] == first.pid for s in orphans), orphans
    (root,) = [s for s in got if s["parent"] == CLIENT_SPAN]
    assert all(s["parent"] in by_id for s in got if s not in orphans and s is not root)
    assert root["parent"] == CLIENT_SPAN and root["name"] == "POST /v1/chat/completions"
    assert root["attributes"]["http.response.status_code"] == 200
    assert str(root["attributes"]["turnout.request_id"]).startswith("traced-1.")
    assert "migration" in root["events"] and "first_token" in root["events"]
    names = {s["name"] for s in got}
    assert {"preprocess", "route", "attempt", "generate"} <= names, names
    # The killed worker's stream broke; the request may try it once more (discovery may not
    # have dropped it yet: that attempt fails unsent), then goes to the second worker.
    attempts = sorted((s for s in got if s["name"] == "attempt"), key=lambda s: s["start"])
    tried = [a["attributes"]["turnout.instance"] for a in attempts]
    assert tried[0] == first_instance and tried[-1] == second_instance, tried
    *broken, finished = attempts
    assert all(a["error"] for a in broken) and not finished["error"]
    # Numbered in order; the one after the killed worker's says it is the migration, and why.
    numbers = [a["attributes"]["turnout.attempt"] for a in attempts]
    assert numbers == list(range(1, len(attempts) + 1)), numbers
    moved = attempts[1]["attributes"]
    assert moved["turnout.attempt.cause"] == "migration" and moved["turnout.attempt.reason"]
    assert "stream_end" in finished["events"]
    (generate,) = [s for s in got if s["name"] == "generate"]  # the killed worker exported none
    assert generate["service"] == "turnout-worker" and generate["parent"] == finished["span_id"]
    assert generate["attributes"]["turnout.instance"] == second_instance
    assert "first_token" in generate["events"]
    stages = [s["name"] for s in got if s["parent"] == generate["span_id"]]
    assert sorted(stages) == ["mocker.decode", "mocker.prefill"], stages


def test_a_bad_endpoint_is_refused_at_start_and_an_absent_collector_costs_no_request(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    bad = subprocess.run(
        [sys.executable, "-m", "turnout", "frontend", "--otlp-endpoint", "localhost:4318"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert (
        bad.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "--otlp-endpoint must be an http:// or https:// URL with a host, got 'localhost:4318'"
        )
    )
    # Nothing listens on the port: exports fail in the SDK's thread, requests do not.
    from turnout.frontend.service import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    procs = ProcessSet(tmp_path)
    try:
        procs.worker("--engine", "mocker", "--model-name", "m", "--otlp-endpoint", dead)
        procs.frontend("--otlp-endpoint", dead)
        wait_until(lambda: bool(health(procs.url).get("m")), 60, "the worker", procs.logs)
        for _ in range(5):
            answer = httpx.post(
                procs.url + "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 3},
                timeout=30,
            )  # fmt: skip
            assert answer.status_code == 200, answer.text
    finally:
        procs.close()
