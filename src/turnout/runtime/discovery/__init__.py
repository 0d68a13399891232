"""Discovery stores: where instances and model cards are registered, under leases, and watched.

``make_store(kind, path, **options)`` builds one by registry name: ``memory`` (one process),
``file`` (the processes of one machine, sharing a SQLite file) or ``etcd`` (a deployment
across hosts). ``open_store`` does the same and, for a store that lives elsewhere, checks
that it answers: a process that cannot reach its store fails at start with one line naming
it, not at its first registration.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from turnout.errors import ConfigError
from turnout.runtime.discovery.base import (
    DiscoveryStore,
    KeyValue,
    WatchEvent,
    WatchEventKind,
)
from turnout.runtime.discovery.etcd import EtcdStore, open_etcd_store
from turnout.runtime.discovery.file import FileStore
from turnout.runtime.discovery.file_path import runtime_folder
from turnout.runtime.discovery.memory import MemoryStore

__all__ = [
    "DiscoveryStore",
    "EtcdStore",
    "FileStore",
    "KeyValue",
    "MemoryStore",
    "WatchEvent",
    "WatchEventKind",
    "default_file_store_path",
    "make_store",
    "open_store",
    "store_kinds",
]

#: The options each kind takes besides ``path`` (which only ``file`` uses; others ignore it,
#: so a ``TURNOUT_STORE_PATH`` left in the environment does not break them).
_OPTIONS: dict[str, frozenset[str]] = {
    "memory": frozenset(),
    "file": frozenset({"poll_interval"}),
    "etcd": frozenset(
        {"endpoints", "ca_cert", "cert", "key", "user", "password", "connect_timeout"}
    ),
}


def default_file_store_path(deployment: str | None = None) -> str:
    """``$TURNOUT_STORE_PATH``, else ``<folder>/discovery.sqlite``, or with a ``deployment``
    name ``<folder>/<deployment>/discovery.sqlite``, where the folder is
    ``$XDG_RUNTIME_DIR/turnout`` when that is usable, else ``/tmp/turnout-<uid>`` (see
    ``file_path``: the store is refused unless the folder is this user's alone).

    The name keeps unrelated deployments of one user apart: two ``turnout serve`` trees on one
    machine sharing a store would route each other's models and see each other's workers.
    """
    given = os.environ.get("TURNOUT_STORE_PATH")
    if given:
        return given
    if deployment is not None:
        if not deployment or "/" in deployment or deployment in (".", ".."):
            raise ConfigError(f"a deployment name is one path component, got {deployment!r}")
        return os.path.join(runtime_folder(), deployment, "discovery.sqlite")
    return os.path.join(runtime_folder(), "discovery.sqlite")


def _make_memory(path: str | None, options: dict[str, Any]) -> DiscoveryStore:
    return MemoryStore()


def _make_file(path: str | None, options: dict[str, Any]) -> DiscoveryStore:
    return FileStore(path or default_file_store_path(), **options)


def _make_etcd(path: str | None, options: dict[str, Any]) -> DiscoveryStore:
    return EtcdStore(**options)


_STORES: dict[str, Callable[[str | None, dict[str, Any]], DiscoveryStore]] = {
    "memory": _make_memory,
    "file": _make_file,
    "etcd": _make_etcd,
}


def store_kinds() -> list[str]:
    return sorted(_STORES)


def _check_options(kind: str, options: dict[str, Any]) -> dict[str, Any]:
    if kind not in _STORES:
        raise ConfigError(
            f"unknown discovery store {kind!r}; choose one of: {', '.join(store_kinds())}"
        )
    # None means "not given" (CLI flags left unset), whatever the kind.
    given = {name: value for name, value in options.items() if value is not None}
    unknown = sorted(set(given) - _OPTIONS[kind])
    if unknown:
        accepted = ", ".join(sorted(_OPTIONS[kind])) or "none"
        raise ConfigError(
            f"the {kind} discovery store does not take {', '.join(unknown)} "
            f"(its options: {accepted})"
        )
    return given


def make_store(kind: str, path: str | None = None, **options: Any) -> DiscoveryStore:
    """Build the discovery store named ``kind``; nothing is contacted yet.

    ``path`` is the SQLite file of ``file``. ``etcd`` takes ``endpoints`` (list of
    ``http(s)://host:port``, or one comma-separated string), ``ca_cert``, ``cert``, ``key``,
    ``user``, ``password``, ``connect_timeout``. An option the kind does not take, or a bad
    value, is a ``ConfigError``.
    """
    given = _check_options(kind, options)
    return _STORES[kind](path, given)


async def open_store(kind: str, path: str | None = None, **options: Any) -> DiscoveryStore:
    """``make_store``, then check the store is usable: for ``etcd``, one read within the
    connect timeout (and the credentials accepted), else ``ConfigError("cannot reach etcd at
    [...]: reason")``; for ``file``, the file opened (``ConfigError`` for a folder that is not
    this user's alone). The caller closes the store."""
    given = _check_options(kind, options)
    if kind == "etcd":
        return await open_etcd_store(**given)
    store = _STORES[kind](path, given)
    if isinstance(store, FileStore):
        try:
            await store.open()  # a folder that is not ours: ConfigError now, one line
        except BaseException:
            await store.close()
            raise
    return store
