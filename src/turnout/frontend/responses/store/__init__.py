"""The Responses API's store: stored responses (``store: true``, ``previous_response_id``) and
conversations, in one of four backends named by ``--response-store``:

* ``sqlite:PATH`` (the default, ``sqlite:`` alone: ``default_sqlite_path()``): one machine;
* ``postgres://...`` and ``redis://...``: several frontends, which see each other's records;
* ``memory:``: this process only (tests);
* ``off``: nothing is stored, and what needs the store is refused.

``base`` states the interface; ``frontend.responses.history`` is its one caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from turnout.errors import ConfigError
from turnout.frontend.responses.store.base import NO_TENANT, ResponseStore, ResponseStoreError
from turnout.frontend.responses.store.memory import MemoryResponseStore
from turnout.frontend.responses.store.sqlite import SqliteResponseStore, default_sqlite_path

__all__ = [
    "DEFAULT_RESPONSE_STORE",
    "NO_TENANT",
    "MemoryResponseStore",
    "ResponseStore",
    "ResponseStoreError",
    "SqliteResponseStore",
    "default_sqlite_path",
    "make_response_store",
]

#: ``--response-store``'s default: SQLite at ``default_sqlite_path()``.
DEFAULT_RESPONSE_STORE = "sqlite:"


def make_response_store(spec: str, clock: Callable[[], float] = time.time) -> ResponseStore | None:
    """The backend ``spec`` names (not opened yet); None for ``off``. ``ConfigError`` naming
    the flag for anything else."""
    if spec in ("off", "none"):
        return None
    if spec in ("memory", "memory:"):
        return MemoryResponseStore(clock)
    if spec == "sqlite" or spec.startswith("sqlite:"):
        path = spec.partition(":")[2]
        if path.startswith("//"):  # sqlite:///abs/path, as SQLAlchemy writes it
            path = path[2:]
        return SqliteResponseStore(path or None, clock)
    if spec.startswith(("postgres://", "postgresql://")):
        from turnout.frontend.responses.store.postgres import PostgresResponseStore

        return PostgresResponseStore(spec, clock)
    if spec.startswith(("redis://", "rediss://")):
        from turnout.frontend.responses.store.redis import RedisResponseStore

        return RedisResponseStore(spec, clock)
    raise ConfigError(
        f"--response-store {spec!r}: say sqlite:PATH, postgres://..., redis://..., memory: or off"
    )
