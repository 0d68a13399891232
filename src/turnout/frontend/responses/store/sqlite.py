"""``sqlite:PATH``: the response store in a SQLite file (the default, beside the frontend's
state; see ``default_sqlite_path``).

All database work runs on one thread of this store's own, holding the one connection: the
event loop never waits on disk, and writes from this process are serialized without locks.
WAL mode lets other processes on the machine (more frontends on the same file) read while one
writes; a writer waits for another's lock up to ``BUSY_TIMEOUT_MS``. The file is made 0600
before SQLite opens it (the records hold prompts), as the file discovery store's is.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from turnout.errors import ConfigError
from turnout.frontend.responses.store.base import ResponseStoreError
from turnout.frontend.responses.store.sql import schema
from turnout.runtime.discovery.file_path import private_file, secure_folder

#: How long a write waits for another process's lock on the file.
BUSY_TIMEOUT_MS = 5000
#: Ids per ``IN (...)`` list (below every SQLite build's variable limit).
_CHUNK = 500

_T = TypeVar("_T")


def default_sqlite_path() -> str:
    """``$XDG_STATE_HOME/turnout/responses.db`` (default ``~/.local/state``): state that
    should outlive a restart of the frontend, kept by user (the runtime folder of the file
    discovery store is emptied at logout and boot, which would lose every chain)."""
    state = os.environ.get("XDG_STATE_HOME", "")
    if not state or not os.path.isabs(state):
        state = os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "turnout", "responses.db")


class SqliteResponseStore:
    """The store in one SQLite file; ``clock`` decides expiry (tests inject one)."""

    def __init__(self, path: str | None = None, clock: Callable[[], float] = time.time) -> None:
        """``path``: the database file (None: ``default_sqlite_path()``, in a folder made
        private to this user, as the discovery store's is)."""
        self._default = path is None
        self.path = default_sqlite_path() if path is None else path
        self.description = f"sqlite:{self.path}"
        self._clock = clock
        self._executor: ThreadPoolExecutor | None = None
        self._db: sqlite3.Connection | None = None

    async def open(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="response-store")
        await self._run(self._open)

    def _open(self) -> None:
        folder = os.path.dirname(os.path.abspath(self.path))
        try:
            if self._default:
                secure_folder(folder)
            else:
                os.makedirs(folder, exist_ok=True)
            private_file(self.path)
        except ConfigError as exc:
            raise ConfigError(f"--response-store {self.description}: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"--response-store {self.description}: {exc}") from None
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        with _transaction(db):
            for statement in schema(postgres=False):
                db.execute(statement)
        self._db = db

    async def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is None:
            return
        db, self._db = self._db, None
        if db is not None:
            await asyncio.get_running_loop().run_in_executor(executor, db.close)
        executor.shutdown(wait=False)

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        if self._executor is None:
            raise ResponseStoreError("the response store is closed")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except sqlite3.Error as exc:
            raise ResponseStoreError(f"{self.description}: {exc}") from exc

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise ResponseStoreError("the response store is not open")
        return self._db

    # -------------------------------------------------------------- responses

    async def put_response(
        self,
        tenant: str,
        response_id: str,
        data: bytes,
        expires_at: float,
        touch: Sequence[str] = (),
    ) -> None:
        def put() -> None:
            db = self._conn()
            with _transaction(db):
                db.execute(
                    "INSERT OR REPLACE INTO turnout_responses (tenant, id, expires_at, data) "
                    "VALUES (?, ?, ?, ?)",
                    (tenant, response_id, expires_at, data),
                )
                for chunk in _chunks(touch):
                    db.execute(
                        "UPDATE turnout_responses SET expires_at = ? WHERE tenant = ? AND id IN "
                        f"({_marks(chunk)})",
                        (expires_at, tenant, *chunk),
                    )

        await self._run(put)

    async def get_responses(self, tenant: str, response_ids: Sequence[str]) -> dict[str, bytes]:
        def get() -> dict[str, bytes]:
            db = self._conn()
            now = self._clock()
            out: dict[str, bytes] = {}
            for chunk in _chunks(response_ids):
                rows = db.execute(
                    "SELECT id, data FROM turnout_responses WHERE tenant = ? AND expires_at > ? "
                    f"AND id IN ({_marks(chunk)})",
                    (tenant, now, *chunk),
                )
                out.update((row[0], bytes(row[1])) for row in rows)
            return out

        return await self._run(get)

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        def delete() -> bool:
            cur = self._conn().execute(
                "DELETE FROM turnout_responses WHERE tenant = ? AND id = ? AND expires_at > ?",
                (tenant, response_id, self._clock()),
            )
            return cur.rowcount > 0

        return await self._run(delete)

    # -------------------------------------------------------------- conversations

    async def put_conversation(
        self, tenant: str, conversation_id: str, data: bytes, expires_at: float
    ) -> None:
        def put() -> None:
            self._conn().execute(
                "INSERT OR REPLACE INTO turnout_conversations (tenant, id, expires_at, data) "
                "VALUES (?, ?, ?, ?)",
                (tenant, conversation_id, expires_at, data),
            )

        await self._run(put)

    async def get_conversation(self, tenant: str, conversation_id: str) -> bytes | None:
        def get() -> bytes | None:
            row = (
                self._conn()
                .execute(
                    "SELECT data FROM turnout_conversations WHERE tenant = ? AND id = ? "
                    "AND expires_at > ?",
                    (tenant, conversation_id, self._clock()),
                )
                .fetchone()
            )
            return None if row is None else bytes(row[0])

        return await self._run(get)

    async def delete_conversation(self, tenant: str, conversation_id: str) -> bool:
        def delete() -> bool:
            db = self._conn()
            with _transaction(db):
                cur = db.execute(
                    "DELETE FROM turnout_conversations WHERE tenant = ? AND id = ? "
                    "RETURNING expires_at",
                    (tenant, conversation_id),
                )
                rows = cur.fetchall()
                db.execute(
                    "DELETE FROM turnout_conversation_items WHERE tenant = ? "
                    "AND conversation_id = ?",
                    (tenant, conversation_id),
                )
            return any(row[0] > self._clock() for row in rows)

        return await self._run(delete)

    async def add_items(
        self,
        tenant: str,
        conversation_id: str,
        items: Sequence[tuple[str, bytes]],
        expires_at: float,
    ) -> bool:
        def add() -> bool:
            db = self._conn()
            with _transaction(db):
                cur = db.execute(
                    "UPDATE turnout_conversations SET expires_at = ? WHERE tenant = ? AND id = ? "
                    "AND expires_at > ?",
                    (expires_at, tenant, conversation_id, self._clock()),
                )
                if cur.rowcount == 0:
                    return False
                db.executemany(
                    "INSERT OR REPLACE INTO turnout_conversation_items "
                    "(tenant, conversation_id, item_id, data) VALUES (?, ?, ?, ?)",
                    [(tenant, conversation_id, item_id, data) for item_id, data in items],
                )
            return True

        return await self._run(add)

    async def list_items(self, tenant: str, conversation_id: str) -> list[tuple[str, bytes]]:
        def items() -> list[tuple[str, bytes]]:
            db = self._conn()
            live = db.execute(
                "SELECT 1 FROM turnout_conversations WHERE tenant = ? AND id = ? "
                "AND expires_at > ?",
                (tenant, conversation_id, self._clock()),
            ).fetchone()
            if live is None:
                return []
            rows = db.execute(
                "SELECT item_id, data FROM turnout_conversation_items WHERE tenant = ? "
                "AND conversation_id = ? ORDER BY rowid",
                (tenant, conversation_id),
            )
            return [(row[0], bytes(row[1])) for row in rows]

        return await self._run(items)

    async def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> bool:
        def delete() -> bool:
            cur = self._conn().execute(
                "DELETE FROM turnout_conversation_items WHERE tenant = ? AND conversation_id = ? "
                "AND item_id = ? AND EXISTS (SELECT 1 FROM turnout_conversations WHERE "
                "tenant = ? AND id = ? AND expires_at > ?)",
                (tenant, conversation_id, item_id, tenant, conversation_id, self._clock()),
            )
            return cur.rowcount > 0

        return await self._run(delete)

    # -------------------------------------------------------------- retention

    async def sweep(self) -> int:
        def sweep() -> int:
            db = self._conn()
            now = self._clock()
            with _transaction(db):
                gone = db.execute(
                    "DELETE FROM turnout_responses WHERE expires_at <= ?", (now,)
                ).rowcount
                convs = db.execute(
                    "DELETE FROM turnout_conversations WHERE expires_at <= ? RETURNING tenant, id",
                    (now,),
                ).fetchall()
                db.executemany(
                    "DELETE FROM turnout_conversation_items WHERE tenant = ? "
                    "AND conversation_id = ?",
                    convs,
                )
            return int(gone) + len(convs)

        return await self._run(sweep)


class _transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (or ``ROLLBACK`` on an error) on an autocommit
    connection: the write lock is taken up front, so a transaction never fails half-way for
    another process's lock (it waits ``busy_timeout`` at BEGIN instead)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.db.execute("ROLLBACK" if exc_type is not None else "COMMIT")


def _chunks(ids: Sequence[str]) -> list[Sequence[str]]:
    return [ids[i : i + _CHUNK] for i in range(0, len(ids), _CHUNK)]


def _marks(chunk: Sequence[str]) -> str:
    return ", ".join("?" * len(chunk))
