"""``postgres://...``: the response store in PostgreSQL, shared by several frontends (each
sees every response any of them stored), through ``asyncpg``'s connection pool.

The schema is made at start-up under a transaction-scoped advisory lock, so frontends that
start together do not race to create the same tables. Every call has a deadline
(``COMMAND_TIMEOUT_S``); a lost connection is the pool's to replace.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from turnout.frontend.responses.store.base import ResponseStoreError
from turnout.frontend.responses.store.sql import schema
from turnout.runtime.redact import redact_url

#: Seconds one statement may take, and to open a connection.
COMMAND_TIMEOUT_S = 10.0
#: Connections a frontend keeps open.
POOL_MIN, POOL_MAX = 1, 8
#: The advisory lock key that serializes schema creation (any fixed 64-bit number).
_SCHEMA_LOCK = 0x7475726E6F7574

_T = TypeVar("_T")


class PostgresResponseStore:
    """The store in a PostgreSQL database; ``clock`` decides expiry (tests inject one)."""

    def __init__(self, dsn: str, clock: Callable[[], float] = time.time) -> None:
        self.dsn = dsn
        self.description = redact_url(dsn)
        self._clock = clock
        self._pool: Any = None

    async def open(self) -> None:
        try:
            import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints
        except ImportError as exc:
            raise ResponseStoreError(
                "--response-store postgres:// needs asyncpg (pip install 'turnout[stores]')"
            ) from exc
        try:
            self._pool = await asyncpg.create_pool(
                self.dsn,
                min_size=POOL_MIN,
                max_size=POOL_MAX,
                timeout=COMMAND_TIMEOUT_S,
                command_timeout=COMMAND_TIMEOUT_S,
            )
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
                for statement in schema(postgres=True):
                    await conn.execute(statement)
        except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
            await self.close()
            raise ResponseStoreError(
                f"--response-store: cannot open {self.description}: {exc}"
            ) from exc

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def _call(self, fn: Callable[[Any], Awaitable[_T]]) -> _T:
        """``fn(connection)`` on a pooled connection, its failures as ``ResponseStoreError``."""
        import asyncpg

        if self._pool is None:
            raise ResponseStoreError("the response store is not open")
        try:
            async with self._pool.acquire(timeout=COMMAND_TIMEOUT_S) as conn:
                return await fn(conn)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            raise ResponseStoreError(f"{self.description}: {exc}") from exc

    # -------------------------------------------------------------- responses

    async def put_response(
        self,
        tenant: str,
        response_id: str,
        data: bytes,
        expires_at: float,
        touch: Sequence[str] = (),
    ) -> None:
        async def put(conn: Any) -> None:
            async with conn.transaction():
                await conn.execute(
                    "INSERT INTO turnout_responses (tenant, id, expires_at, data) "
                    "VALUES ($1, $2, $3, $4) ON CONFLICT (tenant, id) DO UPDATE "
                    "SET expires_at = EXCLUDED.expires_at, data = EXCLUDED.data",
                    tenant, response_id, expires_at, data,
                )  # fmt: skip
                if touch:
                    await conn.execute(
                        "UPDATE turnout_responses SET expires_at = $1 "
                        "WHERE tenant = $2 AND id = ANY($3::text[])",
                        expires_at, tenant, list(touch),
                    )  # fmt: skip

        await self._call(put)

    async def get_responses(self, tenant: str, response_ids: Sequence[str]) -> dict[str, bytes]:
        async def get(conn: Any) -> dict[str, bytes]:
            rows = await conn.fetch(
                "SELECT id, data FROM turnout_responses WHERE tenant = $1 "
                "AND id = ANY($2::text[]) AND expires_at > $3",
                tenant, list(response_ids), self._clock(),
            )  # fmt: skip
            return {row[0]: bytes(row[1]) for row in rows}

        return await self._call(get)

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        async def delete(conn: Any) -> bool:
            status = await conn.execute(
                "DELETE FROM turnout_responses WHERE tenant = $1 AND id = $2 AND expires_at > $3",
                tenant, response_id, self._clock(),
            )  # fmt: skip
            return _count(status) > 0

        return await self._call(delete)

    # -------------------------------------------------------------- conversations

    async def put_conversation(
        self, tenant: str, conversation_id: str, data: bytes, expires_at: float
    ) -> None:
        async def put(conn: Any) -> None:
            await conn.execute(
                "INSERT INTO turnout_conversations (tenant, id, expires_at, data) "
                "VALUES ($1, $2, $3, $4) ON CONFLICT (tenant, id) DO UPDATE "
                "SET expires_at = EXCLUDED.expires_at, data = EXCLUDED.data",
                tenant, conversation_id, expires_at, data,
            )  # fmt: skip

        await self._call(put)

    async def get_conversation(self, tenant: str, conversation_id: str) -> bytes | None:
        async def get(conn: Any) -> bytes | None:
            value = await conn.fetchval(
                "SELECT data FROM turnout_conversations WHERE tenant = $1 AND id = $2 "
                "AND expires_at > $3",
                tenant, conversation_id, self._clock(),
            )  # fmt: skip
            return None if value is None else bytes(value)

        return await self._call(get)

    async def delete_conversation(self, tenant: str, conversation_id: str) -> bool:
        async def delete(conn: Any) -> bool:
            async with conn.transaction():
                expires = await conn.fetchval(
                    "DELETE FROM turnout_conversations WHERE tenant = $1 AND id = $2 "
                    "RETURNING expires_at",
                    tenant, conversation_id,
                )  # fmt: skip
                await conn.execute(
                    "DELETE FROM turnout_conversation_items WHERE tenant = $1 "
                    "AND conversation_id = $2",
                    tenant, conversation_id,
                )  # fmt: skip
            return expires is not None and expires > self._clock()

        return await self._call(delete)

    async def add_items(
        self,
        tenant: str,
        conversation_id: str,
        items: Sequence[tuple[str, bytes]],
        expires_at: float,
    ) -> bool:
        async def add(conn: Any) -> bool:
            async with conn.transaction():
                # The row lock taken here orders concurrent adds to one conversation (and a
                # concurrent delete) across frontends.
                status = await conn.execute(
                    "UPDATE turnout_conversations SET expires_at = $1 WHERE tenant = $2 "
                    "AND id = $3 AND expires_at > $4",
                    expires_at, tenant, conversation_id, self._clock(),
                )  # fmt: skip
                if _count(status) == 0:
                    return False
                await conn.executemany(
                    "INSERT INTO turnout_conversation_items (tenant, conversation_id, item_id, "
                    "data) VALUES ($1, $2, $3, $4) ON CONFLICT (tenant, conversation_id, "
                    "item_id) DO UPDATE SET data = EXCLUDED.data",
                    [(tenant, conversation_id, item_id, data) for item_id, data in items],
                )
            return True

        return await self._call(add)

    async def list_items(self, tenant: str, conversation_id: str) -> list[tuple[str, bytes]]:
        async def items(conn: Any) -> list[tuple[str, bytes]]:
            rows = await conn.fetch(
                "SELECT i.item_id, i.data FROM turnout_conversation_items i "
                "JOIN turnout_conversations c ON c.tenant = i.tenant "
                "AND c.id = i.conversation_id WHERE i.tenant = $1 AND i.conversation_id = $2 "
                "AND c.expires_at > $3 ORDER BY i.seq",
                tenant, conversation_id, self._clock(),
            )  # fmt: skip
            return [(row[0], bytes(row[1])) for row in rows]

        return await self._call(items)

    async def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> bool:
        async def delete(conn: Any) -> bool:
            status = await conn.execute(
                "DELETE FROM turnout_conversation_items WHERE tenant = $1 "
                "AND conversation_id = $2 AND item_id = $3 AND EXISTS (SELECT 1 FROM "
                "turnout_conversations WHERE tenant = $1 AND id = $2 AND expires_at > $4)",
                tenant, conversation_id, item_id, self._clock(),
            )  # fmt: skip
            return _count(status) > 0

        return await self._call(delete)

    # -------------------------------------------------------------- retention

    async def sweep(self) -> int:
        async def sweep(conn: Any) -> int:
            now = self._clock()
            async with conn.transaction():
                gone = await conn.execute(
                    "DELETE FROM turnout_responses WHERE expires_at <= $1", now
                )
                convs = await conn.fetch(
                    "DELETE FROM turnout_conversations WHERE expires_at <= $1 RETURNING tenant, id",
                    now,
                )
                if convs:
                    await conn.executemany(
                        "DELETE FROM turnout_conversation_items WHERE tenant = $1 "
                        "AND conversation_id = $2",
                        [(row[0], row[1]) for row in convs],
                    )
            return _count(gone) + len(convs)

        return await self._call(sweep)


def _count(status: str) -> int:
    """The row count of a command status (``DELETE 3`` -> 3)."""
    tail = status.rsplit(" ", 1)[-1]
    return int(tail) if tail.isdigit() else 0
