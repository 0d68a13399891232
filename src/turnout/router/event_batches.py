"""Consume an event subscription a batch at a time: what is ready, per wake of the consumer.

A consumer that handles one message per ``await`` pays a loop round per message and cannot
fold messages that supersede each other (a worker's load report replaces its previous one).
``take_ready`` waits for one message, then takes those already queued behind it, without
waiting again: a queued message is taken without suspending (``EventBuffer.take`` returns at
once when it holds one), so the batch is whatever arrived since the consumer last ran.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Generic, TypeVar

import msgspec

from turnout.runtime.event_plane import Event, EventSubscription

__all__ = ["BatchDecoder", "take_ready"]

log = logging.getLogger("turnout.router")

T = TypeVar("T")

#: The most messages one batch takes (the rest stay queued for the next).
DEFAULT_BATCH_MAX = 1024


async def take_ready(
    sub: EventSubscription[Any], limit: int = DEFAULT_BATCH_MAX
) -> list[Event] | None:
    """The next message and up to ``limit - 1`` already queued after it, oldest first;
    ``None`` once the subscription has ended."""
    try:
        batch = [await anext(sub)]
    except StopAsyncIteration:
        return None
    for _ in range(min(sub.num_pending, limit - 1)):
        try:
            batch.append(await anext(sub))
        except StopAsyncIteration:  # closed meanwhile: the next call says so
            break
    return batch


class BatchDecoder(Generic[T]):
    """Decodes a batch's payloads as msgpack ``T``. A payload that does not decode (a peer
    running another version, a bug) is skipped and counted in ``num_invalid``; the first is
    logged with the error: one bad peer must not stop a consumer."""

    __slots__ = ("_decode", "_logged", "_what", "num_invalid")

    def __init__(self, type_: type[T], what: str) -> None:
        self._decode = msgspec.msgpack.Decoder(type_).decode
        self._what = what
        self._logged = False
        self.num_invalid = 0

    def decode(self, batch: Iterable[Event]) -> list[T]:
        decode = self._decode
        out = []
        for event in batch:
            try:
                out.append(decode(event.payload))
            except msgspec.DecodeError as exc:
                self.num_invalid += 1
                if not self._logged:
                    self._logged = True
                    log.warning(
                        "skipping an undecodable %s message (%s); later ones are only counted",
                        self._what,
                        exc,
                    )
        return out
