"""``UnaryCaller``: one reply per request, sent again elsewhere when an attempt fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from turnout.errors import (
    EngineBadRequest,
    EngineOverloaded,
    NoInstanceAvailable,
    RemoteError,
    RequestTimedOut,
    StreamBroken,
)
from turnout.protocols.unary import EmbeddingOutput
from turnout.router.push_router import PIN_METADATA
from turnout.router.unary import UnaryCaller
from turnout.runtime.context import AVOID_METADATA, RequestContext

OK = EmbeddingOutput(embeddings=b"\0" * 4, count=1, dimensions=1, prompt_tokens=1)


class Script:
    """A fake router: attempt ``i`` answers ``answers[i]`` (a reply, an exception, or None
    for a stream that ends without a reply) from instance ``i``."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.attempts = 0
        self.closed = 0

    async def generate(self, request: object, ctx: RequestContext) -> AsyncIterator[object]:
        answer = self.answers[self.attempts]
        ctx.metadata["worker_instance_id"] = self.attempts
        self.attempts += 1
        try:
            if isinstance(answer, BaseException):
                raise answer
            if answer == "hang":
                await asyncio.sleep(3600)
            if answer is not None:
                yield answer
        finally:
            self.closed += 1


async def test_a_reply_is_returned_and_the_stream_closed() -> None:
    script = Script(OK)
    assert await UnaryCaller(script.generate).call("req", RequestContext("r")) == OK
    assert script.closed == 1


async def test_failed_engines_and_broken_streams_are_retried_elsewhere() -> None:
    failed = EmbeddingOutput(error="boom", error_kind="engine_failed")
    script = Script(failed, StreamBroken("cut"), None, OK)
    down: list[int] = []
    retries: list[None] = []
    caller = UnaryCaller(
        script.generate, retries=3, report_down=down.append, on_retry=lambda: retries.append(None)
    )
    assert await caller.call("req", RequestContext("r")) == OK
    assert script.attempts == 4 and script.closed == 4
    assert down == [0]  # the instance whose engine failed is set aside
    assert len(retries) == 3


async def test_retries_are_bounded() -> None:
    script = Script(StreamBroken("a"), StreamBroken("b"), OK)
    with pytest.raises(StreamBroken, match="b"):
        await UnaryCaller(script.generate, retries=1).call("req", RequestContext("r"))


async def test_a_pinned_request_is_not_moved() -> None:
    script = Script(StreamBroken("a"), OK)
    ctx = RequestContext("r")
    ctx.metadata[PIN_METADATA] = 0
    with pytest.raises(StreamBroken):
        await UnaryCaller(script.generate).call("req", ctx)
    assert script.attempts == 1


@pytest.mark.parametrize(
    ("kind", "error"),
    [("bad_request", EngineBadRequest), (None, RemoteError)],
)
async def test_error_kinds_become_their_exceptions(kind: str | None, error: type) -> None:
    script = Script(EmbeddingOutput(error="no", error_kind=kind), OK)
    with pytest.raises(error, match="no"):
        await UnaryCaller(script.generate).call("req", RequestContext("r"))
    assert script.attempts == 1  # not retried


OVERLOADED = EmbeddingOutput(error="queue full", error_kind="overloaded")


async def test_an_overloaded_reply_goes_to_another_instance_without_a_retry() -> None:
    script = Script(OVERLOADED, OVERLOADED, OK)
    busy: list[int] = []
    retries: list[None] = []
    ctx = RequestContext("r")
    caller = UnaryCaller(
        script.generate, retries=0, report_busy=busy.append, on_retry=lambda: retries.append(None)
    )
    assert await caller.call("req", ctx) == OK
    assert busy == [0, 1]
    assert ctx.metadata[AVOID_METADATA] == {0, 1}  # what the router leaves out
    assert retries == []


async def test_overloaded_everywhere_is_a_503() -> None:
    """The router below finds no instance left once every one answered overloaded."""
    script = Script(OVERLOADED, NoInstanceAvailable("no live instance (1 avoided)"))
    with pytest.raises(EngineOverloaded, match="every instance tried answered overloaded"):
        await UnaryCaller(script.generate).call("req", RequestContext("r"))


async def test_an_overloaded_pinned_request_is_a_503_at_once() -> None:
    script = Script(OVERLOADED, OK)
    ctx = RequestContext("r")
    ctx.metadata[PIN_METADATA] = 0
    with pytest.raises(EngineOverloaded, match="queue full"):
        await UnaryCaller(script.generate).call("req", ctx)
    assert script.attempts == 1


async def test_the_deadline_after_an_overloaded_reply_is_a_503() -> None:
    script = Script(OVERLOADED, "hang")
    with pytest.raises(EngineOverloaded, match="deadline"):
        await UnaryCaller(script.generate).call("req", RequestContext("r"), timeout=0.05)


async def test_the_deadline_covers_every_attempt_and_cancels_the_work() -> None:
    script = Script(StreamBroken("a"), "hang")
    ctx = RequestContext("r")
    caller = UnaryCaller(script.generate, request_timeout=30.0)
    with pytest.raises(RequestTimedOut, match=r"0\.05s"):
        await caller.call("req", ctx, timeout=0.05)  # the request's own, shorter
    assert ctx.is_cancelled and script.closed == 2
