"""``memory:``: the response store in this process's memory (tests, and single frontends that
need nothing to survive a restart). Bounded like the others: by expiry, swept."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

#: (tenant, id)
_Key = tuple[str, str]


@dataclass(slots=True)
class _Conversation:
    data: bytes
    expires_at: float
    #: item id -> record, in insertion order (dicts keep it).
    items: dict[str, bytes] = field(default_factory=dict)


class MemoryResponseStore:
    """Dicts keyed by (tenant, id); ``clock`` decides expiry (tests inject one)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.description = "memory:"
        self._clock = clock
        self._responses: dict[_Key, tuple[bytes, float]] = {}
        self._conversations: dict[_Key, _Conversation] = {}

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        self._responses.clear()
        self._conversations.clear()

    async def put_response(
        self,
        tenant: str,
        response_id: str,
        data: bytes,
        expires_at: float,
        touch: Sequence[str] = (),
    ) -> None:
        self._responses[(tenant, response_id)] = (data, expires_at)
        for other in touch:
            known = self._responses.get((tenant, other))
            if known is not None:
                self._responses[(tenant, other)] = (known[0], expires_at)

    async def get_responses(self, tenant: str, response_ids: Sequence[str]) -> dict[str, bytes]:
        now = self._clock()
        out = {}
        for response_id in response_ids:
            known = self._responses.get((tenant, response_id))
            if known is not None and known[1] > now:
                out[response_id] = known[0]
        return out

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        known = self._responses.pop((tenant, response_id), None)
        return known is not None and known[1] > self._clock()

    async def put_conversation(
        self, tenant: str, conversation_id: str, data: bytes, expires_at: float
    ) -> None:
        known = self._live((tenant, conversation_id))
        if known is None:
            self._conversations[(tenant, conversation_id)] = _Conversation(data, expires_at)
        else:
            known.data, known.expires_at = data, expires_at

    async def get_conversation(self, tenant: str, conversation_id: str) -> bytes | None:
        known = self._live((tenant, conversation_id))
        return None if known is None else known.data

    async def delete_conversation(self, tenant: str, conversation_id: str) -> bool:
        live = self._live((tenant, conversation_id)) is not None
        self._conversations.pop((tenant, conversation_id), None)
        return live

    async def add_items(
        self,
        tenant: str,
        conversation_id: str,
        items: Sequence[tuple[str, bytes]],
        expires_at: float,
    ) -> bool:
        known = self._live((tenant, conversation_id))
        if known is None:
            return False
        known.items.update(items)
        known.expires_at = expires_at
        return True

    async def list_items(self, tenant: str, conversation_id: str) -> list[tuple[str, bytes]]:
        known = self._live((tenant, conversation_id))
        return [] if known is None else list(known.items.items())

    async def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> bool:
        known = self._live((tenant, conversation_id))
        return known is not None and known.items.pop(item_id, None) is not None

    async def sweep(self) -> int:
        now = self._clock()
        gone = [k for k, (_, expires) in self._responses.items() if expires <= now]
        for key in gone:
            del self._responses[key]
        convs = [k for k, c in self._conversations.items() if c.expires_at <= now]
        for key in convs:
            del self._conversations[key]
        return len(gone) + len(convs)

    def _live(self, key: _Key) -> _Conversation | None:
        known = self._conversations.get(key)
        if known is None or known.expires_at <= self._clock():
            return None
        return known
