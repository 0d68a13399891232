"""``EventBuffer``: the bounded, counted queue behind every subscription."""

from __future__ import annotations

import asyncio
import logging

import pytest

from turnout.protocols.kv import BlockRemoved, KvCacheEvent
from turnout.runtime.event_plane import Event, EventBuffer, decode_msg, encode_msg


def ev(i: int) -> Event:
    return Event("t", bytes([i]))


async def test_fifo_and_wakes_a_waiting_consumer() -> None:
    buf = EventBuffer(4)
    waiting = asyncio.create_task(buf.take())
    await asyncio.sleep(0)
    assert buf.offer(ev(1)) and buf.offer(ev(2))
    assert await asyncio.wait_for(waiting, 1) == ev(1)
    assert await buf.take() == ev(2)
    assert len(buf) == 0 and buf.num_offered == 2 and buf.num_dropped == 0


async def test_overflow_drops_newest_counts_and_logs_once_per_episode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="turnout.runtime.event_plane")
    buf = EventBuffer(4, name="t", low_water=1)
    accepted = [buf.offer(ev(i)) for i in range(10)]
    assert accepted == [True] * 4 + [False] * 6
    assert len(buf) == 4 and buf.num_dropped == 6
    assert [r.getMessage() for r in caplog.records if "is slow" in r.getMessage()] != []
    assert len(caplog.records) == 1

    assert [(await buf.take()).payload[0] for _ in range(3)] == [0, 1, 2]  # type: ignore[union-attr]
    # Drained to the low water mark: one line with the episode's count, then re-armed.
    assert "6 messages were dropped" in caplog.records[-1].getMessage()
    for i in range(10, 20):
        buf.offer(ev(i))
    slow = [r for r in caplog.records if "is slow" in r.getMessage()]
    assert len(slow) == 2 and buf.num_dropped == 6 + 7


async def test_close_discards_and_ends() -> None:
    buf = EventBuffer(2)
    buf.offer(ev(1))
    waiting = asyncio.create_task(EventBuffer(1).take())  # another buffer: unaffected
    buf.close()
    assert await buf.take() is None
    assert not buf.offer(ev(2)) and len(buf) == 0
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_cancelled_take_leaves_buffer_usable() -> None:
    buf = EventBuffer(2)
    waiting = asyncio.create_task(buf.take())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    buf.offer(ev(5))
    assert await asyncio.wait_for(buf.take(), 1) == ev(5)


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        EventBuffer(0)


def test_msgpack_helpers_round_trip_tagged_unions() -> None:
    event = KvCacheEvent(worker_id=2, event_id=9, data=BlockRemoved(block_hashes=[1, 2**63]))
    assert decode_msg(encode_msg(event), KvCacheEvent) == event
