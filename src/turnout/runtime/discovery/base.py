"""The discovery store interface: a small, etcd-shaped key-value store with leases and watches.

Contract:

* ``put``/``get``/``get_prefix``/``delete`` act on string keys and byte values.
* A key put under a lease is deleted (and every watcher sees a DELETE) when the lease ends:
  revoked, or not kept alive within its TTL.
* ``watch_prefix`` first yields the current keys under the prefix as PUT events (a snapshot at
  some revision R), then every change after R, in revision order, each exactly once. Passing
  ``start_revision`` resumes after a known revision instead of taking a snapshot.
* Revisions increase by one with every change of the store (etcd: the keys of one ending
  lease are deleted in one transaction and share its revision).
* History is finite (``compact`` drops it up to a revision; stores also trim it themselves).
  A watcher resuming from a revision no longer in the history is brought up to date as if
  it had not missed anything: PUTs of the keys added or changed since, DELETEs of the keys
  that vanished since, in revision order; then the changes that follow. No key that vanished
  is ever left behind, however the caller learned of it: from an earlier watch, or from
  ``get``/``get_prefix`` (reading the keys, then watching from the newest revision read, is
  a supported way to start). A DELETE of a key the watcher never saw may come, and is
  harmless: watchers treat a DELETE of an unknown key as a no-op.
* What a store keeps to report deletions to resuming watchers (tombstones, known keys) is
  bounded: a deletion is forgotten once every open watch is past it and it is older than
  ``DELETE_GRACE_SECONDS``. So the promise above holds for open watches however far behind
  they are, and for a caller between watches (it read with ``get_prefix``, or its watch
  failed and it re-opens after a backoff) that resumes within that grace.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncGenerator
from dataclasses import dataclass

#: How long a store remembers a deletion for callers it cannot see (between two watches),
#: at least; open watches keep the deletions they have not yet passed regardless.
DELETE_GRACE_SECONDS = 300.0


class WatchEventKind(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    revision: int
    lease_id: int | None = None


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: WatchEventKind
    #: For DELETE, ``value`` is empty: the watcher remembers what it saw under the key.
    kv: KeyValue


class StoreContact:
    """How this process's keep-alives of its leases on a store have gone: when the store last
    answered one, and how many failed. A store that stops answering shows here (as seconds
    since the last answer) before its leases, and the instances under them, expire."""

    __slots__ = ("failures", "last_ok")

    def __init__(self) -> None:
        #: ``time.monotonic()`` of the last answered keep-alive; None before the first.
        self.last_ok: float | None = None
        self.failures = 0


class DiscoveryStore(abc.ABC):
    """Abstract discovery store; see the module docstring for the contract."""

    #: Registry name: ``memory``, ``file``, ``etcd``.
    kind: str
    _contact: StoreContact | None = None

    @property
    def contact(self) -> StoreContact:
        """This process's keep-alive record with the store (``runtime.lease`` writes it)."""
        if self._contact is None:
            self._contact = StoreContact()
        return self._contact

    @abc.abstractmethod
    async def grant_lease(self, ttl: float) -> int:
        """A new lease id that lives ``ttl`` seconds unless kept alive."""

    @abc.abstractmethod
    async def keep_alive(self, lease_id: int) -> bool:
        """Extend the lease by its TTL; False when it has already ended."""

    @abc.abstractmethod
    async def revoke_lease(self, lease_id: int) -> None:
        """End the lease now, deleting its keys."""

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, *, lease_id: int | None = None) -> int:
        """Set ``key``; returns the store revision of the change."""

    @abc.abstractmethod
    async def get(self, key: str) -> KeyValue | None: ...

    @abc.abstractmethod
    async def get_prefix(self, prefix: str) -> list[KeyValue]: ...

    @abc.abstractmethod
    async def delete(self, key: str) -> bool:
        """Delete ``key``; False when it did not exist."""

    @abc.abstractmethod
    def watch_prefix(
        self, prefix: str, *, start_revision: int | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        """Snapshot-then-changes stream of the keys under ``prefix`` (see module docstring).

        The iterator ends when the store is closed; ``aclose()`` stops it early.
        """

    async def compact(self, revision: int) -> None:
        """Drop the history of changes up to ``revision`` (inclusive)."""
        raise NotImplementedError(f"{type(self).__name__} cannot compact")

    @abc.abstractmethod
    async def close(self) -> None: ...
