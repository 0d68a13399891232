"""``nvext.backend_instance_id`` takes the instance id as every output prints it (hex, as in
``/health``, ``turnout status``, logs and headers) or as an integer; a malformed id is a 400
naming the field. Through the OpenAI client (``extra_body``), on chat and completions, with two
workers so that honouring the pin is visible in the answer's ``worker_id``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from tests.frontend.stack import Stack, echo_engine, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.router.mode import RouterMode

PIN = "nvext.backend_instance_id"


@pytest.fixture
async def two_workers(gguf_path: str) -> AsyncIterator[Stack]:
    before = set(asyncio.all_tasks())
    stack = await make_stack(router_mode=RouterMode.DIRECT)
    await stack.add_worker(echo_engine(gguf_path))
    await stack.add_worker(echo_engine(gguf_path))
    await stack.wait_for_model("echo", instances=2)
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


def instance_ids(stack: Stack) -> list[int]:
    ids = [w.serving.instance_id for w in stack.workers if w.serving is not None]
    assert len(ids) == 2
    return ids


async def answered_by(api: openai.AsyncOpenAI, route: str, pin: object) -> str:
    """The ``worker_id`` (hex) that answered a request pinned with ``pin``."""
    extra: dict[str, Any] = {"nvext": {"backend_instance_id": pin, "extra_fields": ["worker_id"]}}
    if route == "chat":
        chat = await api.chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body=extra,
        )
        nvext = (chat.model_extra or {})["nvext"]
    else:
        completion = await api.completions.create(
            model="echo", prompt="hello there", max_tokens=2, extra_body=extra
        )
        nvext = (completion.model_extra or {})["nvext"]
    return str(nvext["worker_id"])


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_a_pin_in_hex_or_as_an_integer_reaches_that_instance(
    two_workers: Stack, route: str
) -> None:
    api = openai.AsyncOpenAI(base_url=two_workers.url + "/v1", api_key="unused", max_retries=0)
    for iid in instance_ids(two_workers):
        printed = f"{iid:x}"
        for pin in (printed, f"0x{printed}", printed.upper(), iid):
            assert await answered_by(api, route, pin) == printed, pin
    await api.close()


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize(
    "pin",
    ["xyz", "", "0x", "1a 2b", "-1a", "8000000000000000", "1" * 17, -1, 2**63],
)
async def test_a_malformed_pin_is_a_400_naming_the_field(
    two_workers: Stack, route: str, pin: object
) -> None:
    api = openai.AsyncOpenAI(base_url=two_workers.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        await answered_by(api, route, pin)
    error = caught.value.response.json()["error"]
    assert error["param"] == PIN, error
    assert "backend_instance_id" in error["message"]
    await api.close()
