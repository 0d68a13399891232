"""Request-scoped log fields (``runtime.log_context``): which request a line is about, in the
text and JSON formats, from the task that serves the request and the tasks it starts."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest

from turnout.runtime.context import RequestContext
from turnout.runtime.log_context import (
    INSTANCE_METADATA,
    MODEL_METADATA,
    TENANT_METADATA,
    bind_request,
    current_request,
    log_handler,
)


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO, logging.Handler]]:
    """A logger writing through a ``log_handler`` into a buffer (format set per test)."""
    buffer = io.StringIO()
    logger = logging.getLogger("turnout.test_log_context")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    handler = log_handler("json")
    handler.setStream(buffer)  # type: ignore[attr-defined]
    logger.addHandler(handler)
    yield logger, buffer, handler
    logger.removeHandler(handler)


def lines(buffer: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


async def test_json_lines_name_the_bound_request_and_what_is_known_of_it(captured) -> None:
    logger, buffer, _ = captured

    async def serve() -> None:
        ctx = RequestContext("req-1")
        bind_request(ctx)
        logger.info("arrived")
        ctx.metadata[MODEL_METADATA] = "smol"
        ctx.metadata[TENANT_METADATA] = "team-a"
        logger.info("decoded")
        ctx.metadata[INSTANCE_METADATA] = 0x1F2E
        logger.warning("routed %d", 7)

    await asyncio.create_task(serve())
    logger.info("between requests")
    first, second, third, outside = lines(buffer)
    assert first["request_id"] == "req-1" and "model" not in first and "instance" not in first
    assert (second["model"], second["tenant"]) == ("smol", "team-a")
    assert third == {**third, "instance": "1f2e", "level": "warning", "message": "routed 7"}
    assert third["logger"] == "turnout.test_log_context" and isinstance(third["pid"], int)
    assert str(third["time"]).endswith("Z")
    assert not {"request_id", "model", "instance", "tenant"} & set(outside)


async def test_tasks_started_by_a_request_carry_it_and_concurrent_requests_stay_apart(
    captured,
) -> None:
    logger, buffer, _ = captured
    both_bound = asyncio.Barrier(2)

    async def serve(request_id: str) -> None:
        bind_request(RequestContext(request_id))
        await both_bound.wait()  # both requests bound before either logs

        async def helper() -> None:
            logger.info("helper of %s", request_id)

        await asyncio.create_task(helper())
        logger.info("done %s", request_id)

    await asyncio.gather(serve("a"), serve("b"))
    for entry in lines(buffer):
        assert str(entry["message"]).endswith(" " + str(entry["request_id"]))
    assert current_request() is None  # the test's own task was never bound


def test_json_lines_carry_tracebacks_and_unicode_on_one_line(captured) -> None:
    logger, buffer, _ = captured
    try:
        raise ValueError("bad “value”\nsecond line")
    except ValueError:
        logger.exception("failed: %s", "ünïcode")
    (entry,) = lines(buffer)
    assert entry["message"] == "failed: ünïcode" and entry["level"] == "error"
    assert "ValueError: bad “value”" in str(entry["exception"])
    assert buffer.getvalue().count("\n") == 1


async def test_text_lines_end_with_the_request_id_only_while_one_is_bound() -> None:
    buffer = io.StringIO()
    handler = log_handler("text")
    handler.setStream(buffer)  # type: ignore[attr-defined]
    logger = logging.getLogger("turnout.test_log_context.text")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        logger.warning("no request")

        async def serve() -> None:
            bind_request(RequestContext("r-9"))
            logger.warning("with request")

        await asyncio.create_task(serve())
    finally:
        logger.removeHandler(handler)
    plain, bound = buffer.getvalue().splitlines()
    assert plain.endswith("no request") and "request_id" not in plain
    assert bound.endswith("with request request_id=r-9")
    assert " WARNING turnout.test_log_context.text pid=" in bound


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown log format 'xml'"):
        log_handler("xml")
