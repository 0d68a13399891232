"""What the Responses API's store keeps, and the interface every backend implements.

The store is three collections of opaque, already-encoded records, each scoped by tenant:

* **responses**: one record a stored response (its input items, its final body, the ids of
  the chain it continues), with an absolute expiry;
* **conversations**: one record a conversation (creation time, metadata), with an expiry;
* **conversation items**: per conversation, an ordered list of ``(item_id, record)``; they
  live and die with their conversation.

Backends know nothing of the records' contents: ``frontend.responses.history`` encodes and
decodes them, bounds their size and decides expiries. That keeps four backends (memory,
SQLite, PostgreSQL, Redis) small and alike, and the policy in one place.

Tenants: every key carries a tenant, and every lookup names one, so no lookup can forget to
scope itself: a record of another tenant is not found. ``NO_TENANT`` (``""``) holds the
``default`` tenant's records (``history.store_tenant``).

Expiry: a record whose ``expires_at`` has passed is never returned, whether or not the
backend's ``sweep`` (or Redis's own expiry) has removed it yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from turnout.errors import ResponseStoreError

__all__ = ["NO_TENANT", "ResponseStore", "ResponseStoreError"]

#: The store's tenant of the ``default`` tenant (every caller of a frontend without
#: credentials, and ``--api-key`` keys): its records need no tenant of their own.
NO_TENANT = ""


class ResponseStore(Protocol):
    """A backend of the response store. Every method may raise ``ResponseStoreError``;
    times are seconds since the epoch (the store's clock decides what has expired)."""

    #: How the store was named (``sqlite:/path``, ``postgres://host/db``), for logs.
    description: str

    async def open(self) -> None:
        """Connect and create the schema if missing; raises ``ResponseStoreError``."""
        ...

    async def close(self) -> None: ...

    # -------------------------------------------------------------- responses

    async def put_response(
        self,
        tenant: str,
        response_id: str,
        data: bytes,
        expires_at: float,
        touch: Sequence[str] = (),
    ) -> None:
        """Store a response (replacing one of the same id), and move the expiry of the
        responses ``touch`` names (its chain: a chain lives as long as its last turn) to
        ``expires_at``."""
        ...

    async def get_responses(self, tenant: str, response_ids: Sequence[str]) -> dict[str, bytes]:
        """The live records among ``response_ids``, by id (missing and expired ones absent)."""
        ...

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        """Delete a response; whether a live one was there."""
        ...

    # -------------------------------------------------------------- conversations

    async def put_conversation(
        self, tenant: str, conversation_id: str, data: bytes, expires_at: float
    ) -> None:
        """Create a conversation, or replace its record (and expiry); items are untouched."""
        ...

    async def get_conversation(self, tenant: str, conversation_id: str) -> bytes | None:
        """A live conversation's record, or None."""
        ...

    async def delete_conversation(self, tenant: str, conversation_id: str) -> bool:
        """Delete a conversation and its items; whether a live one was there."""
        ...

    async def add_items(
        self,
        tenant: str,
        conversation_id: str,
        items: Sequence[tuple[str, bytes]],
        expires_at: float,
    ) -> bool:
        """Append ``(item_id, record)`` pairs to a live conversation, in order, and move its
        expiry to ``expires_at``; False (nothing added) when it does not exist."""
        ...

    async def list_items(self, tenant: str, conversation_id: str) -> list[tuple[str, bytes]]:
        """A live conversation's items, oldest first (empty when it does not exist)."""
        ...

    async def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> bool:
        """Remove one item of a live conversation; whether it was there."""
        ...

    # -------------------------------------------------------------- retention

    async def sweep(self) -> int:
        """Remove what has expired (responses and conversations, with their items); how many
        records went. Backends that expire by themselves (Redis) return 0."""
        ...
