"""``x-request-id`` through real HTTP: a client's id comes back as it was sent (on answers and
on errors, streamed or not), a request without one is given one, and an id that cannot name
a request is a 400 naming the header."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from tests.frontend.stack import Stack

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def test_a_client_id_is_echoed_on_answers_streams_and_errors(echo_stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=echo_stack.url, timeout=30) as http:
        answer = await http.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "a-1"})
        assert answer.status_code == 200 and answer.headers["x-request-id"] == "a-1"
        async with http.stream(
            "POST",
            "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"x-request-id": "s-2"},
        ) as stream:
            assert stream.headers["x-request-id"] == "s-2"
            assert [line async for line in stream.aiter_lines() if line][-1] == "data: [DONE]"
        missing = await http.post(
            "/v1/chat/completions", json={**CHAT, "model": "nope"}, headers={"x-request-id": "e-3"}
        )
        assert missing.status_code == 404 and missing.headers["x-request-id"] == "e-3"


async def test_a_request_without_an_id_is_given_a_fresh_one(echo_stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=echo_stack.url + "/v1", api_key="unused")
    ids = set()
    for _ in range(2):
        raw = await client.chat.completions.with_raw_response.create(**CHAT)  # type: ignore[call-overload]
        ids.add(raw.headers["x-request-id"])
        raw.parse()  # the body is still a strict ChatCompletion
    assert len(ids) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    await client.close()


@pytest.mark.parametrize("bad", ["x" * 129, "has space", "tab\there", "ünï"])
async def test_an_id_that_cannot_name_a_request_is_a_400_naming_the_header(
    echo_stack: Stack, bad: str
) -> None:
    async with httpx.AsyncClient(base_url=echo_stack.url, timeout=30) as http:
        response = await http.post(
            "/v1/chat/completions", json=CHAT, headers={"x-request-id": bad.encode()}
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "x-request-id" and "x-request-id" in error["message"]
    assert error["type"] == "invalid_request_error"
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])
