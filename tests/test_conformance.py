"""The suite's conformance check itself: it must catch what the openai client's types reject,
or every test that relies on it could pass with broken bodies."""

from __future__ import annotations

import json

import httpx
import pytest
from tests.conformance import Conformance

CHUNK = {"id": "c1", "object": "text_completion", "created": 1, "model": "m",
         "choices": [{"index": 0, "text": "a", "finish_reason": None}]}  # fmt: skip
WHOLE = {**CHUNK, "choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]}


def serve(status: int, body: bytes, content_type: str) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        # A stream, as from a socket (a response built with content= is read already).
        return httpx.Response(
            status, stream=httpx.ByteStream(body), headers={"content-type": content_type}
        )

    return httpx.Client(transport=httpx.MockTransport(handler), base_url="http://t")


def fetch(
    conformance: Conformance,
    status: int,
    body: bytes,
    content_type: str,
    path: str = "/v1/completions",
) -> None:
    with serve(status, body, content_type) as client:
        request = client.build_request("POST", path)
        response = client.send(request, stream=True)
        conformance.watch(response)
        response.read()


@pytest.mark.no_conformance
def test_a_body_without_its_object_is_caught() -> None:
    conformance = Conformance()
    body = {k: v for k, v in WHOLE.items() if k != "object"}
    fetch(conformance, 200, json.dumps(body).encode(), "application/json")
    assert len(conformance.violations) == 1
    assert "object" in conformance.violations[0]


@pytest.mark.no_conformance
def test_valid_bodies_and_streams_pass() -> None:
    conformance = Conformance()
    fetch(conformance, 200, json.dumps(WHOLE).encode(), "application/json")
    stream = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in (CHUNK, WHOLE))
    fetch(conformance, 200, stream + b"data: [DONE]\n\n", "text/event-stream")
    error = {"error": {"message": "no", "type": "invalid_request_error", "param": None,
                       "code": "model_not_found"}}  # fmt: skip
    fetch(conformance, 404, json.dumps(error).encode(), "application/json")
    assert conformance.violations == []


@pytest.mark.no_conformance
def test_a_bad_stream_event_and_a_numeric_error_code_are_caught() -> None:
    conformance = Conformance()
    bad = {**CHUNK, "created": "yesterday"}
    fetch(conformance, 200, f"data: {json.dumps(bad)}\n\n".encode(), "text/event-stream")
    error = {"error": {"message": "no", "type": "x", "param": None, "code": 404}}
    fetch(conformance, 404, json.dumps(error).encode(), "application/json")
    assert len(conformance.violations) == 2, conformance.violations


@pytest.mark.no_conformance
def test_responses_and_messages_bodies_are_checked_too() -> None:
    conformance = Conformance()
    fetch(conformance, 200, b'{"id": "resp_1", "object": "response"}', "application/json",
          "/v1/responses")  # fmt: skip
    event = {"type": "response.output_text.delta", "sequence_number": 1, "delta": "a"}
    fetch(conformance, 200, f"data: {json.dumps(event)}\n\n".encode(), "text/event-stream",
          "/v1/responses")  # fmt: skip
    message = {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
               "model": "m"}  # fmt: skip
    fetch(conformance, 200, json.dumps(message).encode(), "application/json", "/v1/messages")
    start = {"type": "content_block_start", "index": "first", "content_block": {}}
    fetch(conformance, 200, f"data: {json.dumps(start)}\n\n".encode(), "text/event-stream",
          "/v1/messages")  # fmt: skip
    openai_shaped = {"error": {"message": "no", "type": "invalid_request_error"}}
    fetch(conformance, 400, json.dumps(openai_shaped).encode(), "application/json",
          "/v1/messages")  # fmt: skip
    assert len(conformance.violations) == 5, conformance.violations


@pytest.mark.no_conformance
def test_anthropic_error_types_are_checked() -> None:
    """Anthropic's documented 413 type passes; an unknown type, or request_too_large on
    another status, does not."""
    conformance = Conformance()
    for status, kind in ((413, "request_too_large"), (529, "overloaded_error")):
        body = {"type": "error", "error": {"type": kind, "message": "no"}}
        fetch(conformance, status, json.dumps(body).encode(), "application/json", "/v1/messages")
    assert conformance.violations == []
    for status, kind in ((400, "request_too_large"), (500, "server_error")):
        body = {"type": "error", "error": {"type": kind, "message": "no"}}
        fetch(conformance, status, json.dumps(body).encode(), "application/json", "/v1/messages")
    assert len(conformance.violations) == 2, conformance.violations
