"""Discovery stores: where instances and model cards are registered, under leases, and watched.

``make_store(kind)`` builds one by registry name: ``memory`` (one process) or ``file`` (the
processes of one machine, sharing a SQLite file).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from turnout.errors import ConfigError
from turnout.runtime.discovery.base import (
    DiscoveryStore,
    KeyValue,
    WatchEvent,
    WatchEventKind,
)
from turnout.runtime.discovery.file import FileStore
from turnout.runtime.discovery.memory import MemoryStore

__all__ = [
    "DiscoveryStore",
    "FileStore",
    "KeyValue",
    "MemoryStore",
    "WatchEvent",
    "WatchEventKind",
    "default_file_store_path",
    "make_store",
    "store_kinds",
]


def default_file_store_path() -> str:
    """``$TURNOUT_STORE_PATH``, else ``/tmp/turnout-<uid>/discovery.sqlite``."""
    return os.environ.get("TURNOUT_STORE_PATH") or f"/tmp/turnout-{os.getuid()}/discovery.sqlite"


def _make_memory(path: str | None) -> DiscoveryStore:
    return MemoryStore()


def _make_file(path: str | None) -> DiscoveryStore:
    return FileStore(path or default_file_store_path())


_STORES: dict[str, Callable[[str | None], DiscoveryStore]] = {
    "memory": _make_memory,
    "file": _make_file,
}


def store_kinds() -> list[str]:
    return sorted(_STORES)


def make_store(kind: str, path: str | None = None) -> DiscoveryStore:
    """Build the discovery store named ``kind``; ``path`` is the file for ``file``."""
    try:
        factory = _STORES[kind]
    except KeyError:
        raise ConfigError(
            f"unknown discovery store {kind!r}; choose one of: {', '.join(store_kinds())}"
        ) from None
    return factory(path)
