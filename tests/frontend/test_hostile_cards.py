"""Nothing in a model card is trusted: whoever can write the discovery store can write one.

A real frontend (KV routing, tcp request plane) serves a real echo worker (model ``echo``);
hostile cards are written straight into the store, as any writer of the store could. Each is
refused with one error line naming the model, the instance and the field, no traceback, once
for all instances of that card, and the frontend goes on serving ``echo``. Chat templates
run on a budget: one that spins on any input is refused when its card is read, one that
spins on some input fails that request alone, quickly, as the model's fault (500).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
from tests.frontend.stack import ENDPOINT, Stack, echo_engine, make_stack
from tests.helpers import assert_no_leaked_tasks

from turnout.engines.echo import EchoEngine
from turnout.protocols.model import ModelDeploymentCard, RuntimeConfig, mdc_key
from turnout.router.mode import RouterMode

WATCHER = "turnout.frontend.models.watcher"
TIMEOUT = 10.0
#: Two nested loops the sandbox's range cap allows: 10^10 iterations.
SPIN = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


@pytest.fixture
async def kv_stack(gguf_path: str) -> AsyncIterator[Stack]:
    """A KV-routing frontend with one echo worker (model ``echo``)."""
    before = set(asyncio.all_tasks())
    stack = await make_stack(router_mode=RouterMode.KV)
    await stack.add_worker(echo_engine(gguf_path), model_name="echo")
    await stack.wait_for_model("echo")
    yield stack
    await stack.close()
    await assert_no_leaked_tasks(before)


async def served_card(stack: Stack) -> ModelDeploymentCard:
    (kv,) = await stack.runtime.store.get_prefix(f"v1/mdc/{ENDPOINT.path()}/")
    return msgspec.json.decode(kv.value, type=ModelDeploymentCard)


async def put_card(stack: Stack, card: ModelDeploymentCard, *, suffix: str | None = None) -> str:
    key = mdc_key(card.endpoint, card.instance_id, suffix)
    await stack.runtime.store.put(key, msgspec.json.encode(card))
    return key


async def barrier(stack: Stack, card: ModelDeploymentCard, n: int) -> None:
    """A valid card of a fresh model (the real worker's, renamed), written after the events
    under test: once it is served, the watcher has read everything before it; once it has
    settled, it has handled all of it (models' events are handled concurrently)."""
    name = f"barrier-{n}"
    await put_card(stack, msgspec.structs.replace(card, display_name=name), suffix=name)
    watcher = stack.frontend.watcher
    assert watcher is not None
    async with asyncio.timeout(TIMEOUT):
        while not stack.frontend.manager.has_model_any(name):
            await asyncio.sleep(0.01)
        await watcher.settled()


def refusals(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == WATCHER and r.levelno >= logging.ERROR]


async def chat(stack: Stack, model: str, content: str, timeout: float = TIMEOUT) -> httpx.Response:
    async with httpx.AsyncClient(base_url=stack.url, timeout=timeout) as http:
        return await http.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 4,
            },
        )


def _tokenizer_of(size: int) -> Any:
    def change(card: ModelDeploymentCard) -> dict[str, Any]:
        assert card.tokenizer is not None
        return {"tokenizer": msgspec.structs.replace(card.tokenizer, size=size)}

    return change


HOSTILE: list[tuple[str, Any, str]] = [
    ("context 2^62", {"context_length": 2**62}, "context_length"),
    ("context 0", {"context_length": 0}, "context_length"),
    ("block 0", {"kv_cache_block_size": 0}, "kv_cache_block_size"),
    ("block 2^20", {"kv_cache_block_size": 1 << 20}, "kv_cache_block_size"),
    ("tokenizer 20 GB", _tokenizer_of(20 * 2**30), "tokenizer.size"),
    (
        "dp 2^40",
        {"runtime_config": RuntimeConfig(data_parallel_size=1 << 40)},
        "runtime_config.data_parallel_size",
    ),
    ("eos id 2^40", {"eos_token_ids": [1 << 40]}, "eos_token_ids"),
    ("template 1 MiB", {"chat_template": "x" * ((1 << 20) + 1)}, "chat_template"),
    ("template spins", {"chat_template": SPIN}, "chat_template"),
    ("template broken", {"chat_template": "{% if %}"}, "chat_template"),
]


@pytest.mark.parametrize(
    ("changes", "field"), [(c, f) for _, c, f in HOSTILE], ids=[i for i, _, _ in HOSTILE]
)
async def test_a_hostile_card_is_refused_once_with_one_line(
    kv_stack: Stack, changes: Any, field: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    stack = kv_stack
    real = await served_card(stack)
    changes = changes(real) if callable(changes) else changes
    bad = msgspec.structs.replace(real, display_name="evil", instance_id=0xE1, **changes)
    started = time.monotonic()
    await put_card(stack, bad)
    await barrier(stack, real, 1)
    took = time.monotonic() - started

    lines = [r.getMessage() for r in refusals(caplog)]
    assert len(lines) == 1, lines
    assert "model=evil" in lines[0] and "instance=e1" in lines[0], lines[0]
    assert f"field={field}:" in lines[0], lines[0]
    assert took < 5.0, f"refusing the card took {took:.1f}s"
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert not stack.frontend.manager.has_model_any("evil")

    # A second instance of the same card: refused too, not logged again.
    await put_card(stack, msgspec.structs.replace(bad, instance_id=0xE2))
    await barrier(stack, real, 2)
    assert len(refusals(caplog)) == 1
    assert not stack.frontend.manager.has_model_any("evil")

    # Every other model is still served.
    reply = await chat(stack, "echo", "hello")
    assert reply.status_code == 200, reply.text
    async with httpx.AsyncClient(base_url=stack.url, timeout=TIMEOUT) as http:
        models = (await http.get("/v1/models")).json()["data"]
    assert "evil" not in {m["id"] for m in models}


async def test_a_served_card_replaced_by_a_hostile_one_leaves(
    kv_stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """A key that held a served card and now holds a refused one: its model goes."""
    caplog.set_level(logging.ERROR, logger=WATCHER)
    stack = kv_stack
    real = await served_card(stack)
    good = msgspec.structs.replace(real, display_name="twin")
    key = await put_card(stack, good, suffix="twin")
    await barrier(stack, real, 1)
    assert stack.frontend.manager.has_model_any("twin")

    await stack.runtime.store.put(
        key, msgspec.json.encode(msgspec.structs.replace(good, context_length=2**62))
    )
    await barrier(stack, real, 2)
    assert not stack.frontend.manager.has_model_any("twin")
    assert ["field=context_length:" in r.getMessage() for r in refusals(caplog)] == [True]


#: Renders every message, but spins on one whose content is "boom" (so a probe passes).
TRAP = (
    "{% for m in messages %}{% if m.content == 'boom' %}"
    "{% for i in range(99999) %}{% for j in range(2000) %}{% endfor %}{% endfor %}"
    "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ eos_token }}"
)


class TrapEcho(EchoEngine):
    """An echo worker whose card's chat template spins on some input."""

    def model_card_template(self) -> ModelDeploymentCard:
        return msgspec.structs.replace(super().model_card_template(), chat_template=TRAP)


async def test_a_template_that_spins_on_some_input_fails_that_request_alone(
    gguf_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The request that sets the trap off gets a 500 that says what happened, within a
    fraction of the ~20 s the template would take; the next request is served normally."""
    before = set(asyncio.all_tasks())
    stack = await make_stack()
    try:
        await stack.add_worker(TrapEcho(gguf_path), model_name="trap")
        await stack.wait_for_model("trap")
        started = time.monotonic()
        reply = await chat(stack, "trap", "boom")
        took = time.monotonic() - started
        assert reply.status_code == 500, reply.text
        error = reply.json()["error"]
        assert error["code"] == "chat_template_limit", error
        assert "chat template" in error["message"]
        assert took < 3.0, f"the request took {took:.1f}s"
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"

        ok = await chat(stack, "trap", "hello")
        assert ok.status_code == 200, ok.text
    finally:
        await stack.close()
    await assert_no_leaked_tasks(before)
