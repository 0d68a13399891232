"""The key ring: every API key the frontend accepts, the tenant each speaks for, and the
tenants' policies.

Keys come from ``--api-key`` (repeatable; tenant ``default``, not admin) and from the TOML file
of ``--api-keys-file``, one ``[[keys]]`` table per key::

    [[keys]]
    sha256 = "9f86d08..."        # hex SHA-256 of the key (the form to store), or
    # key = "sk-..."             # the key itself
    tenant = "team-a"
    admin = false                # optional: may use the control routes (/busy_threshold, /admin/*)
    rps = 5                      # optional limits of the tenant (None: unlimited)
    tokens_per_minute = 60000
    max_concurrent = 8
    priority = 0

Parsing is strict: an unknown field, both or neither of ``key`` and ``sha256``, a value of the
wrong type or out of range is a ``ConfigError`` naming the file, the entry's index and the
field. A tenant's limits are per tenant: keys of one tenant that set the same limit must set
the same value (a limit set on one key applies to all of them).

The ring holds SHA-256 digests only, never a key: a lookup hashes the presented key, finds the
entry by digest and confirms it with ``hmac.compare_digest``. Nothing here logs a key; a
principal's ``key_id`` is the first hex digits of its digest.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from turnout.errors import ConfigError
from turnout.frontend.access.principal import DEFAULT_TENANT, Principal, TenantPolicy

#: Hex digits of a key's SHA-256 that name it (``Principal.key_id``) in logs and the audit log.
KEY_ID_DIGITS = 12
#: What a tenant's name may be: it becomes a metric label and joins the prefix cache's salt.
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}")

_ENTRY_FIELDS = {
    "key", "sha256", "tenant", "admin", "rps", "tokens_per_minute", "max_concurrent", "priority",
}  # fmt: skip
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


def key_digest(key: str) -> bytes:
    """The SHA-256 of a key (what the ring stores and looks up by)."""
    return hashlib.sha256(key.encode()).digest()


def key_id_of(digest: bytes) -> str:
    """The name of a key in logs: the first hex digits of its digest, never the key."""
    return digest.hex()[:KEY_ID_DIGITS]


def valid_tenant(name: object) -> bool:
    """Whether ``name`` may name a tenant (``TENANT_PATTERN``)."""
    return isinstance(name, str) and TENANT_PATTERN.fullmatch(name) is not None


@dataclass(frozen=True, slots=True)
class KeyRing:
    """Principals by their key's digest, and each tenant's policy. Immutable: a reload
    builds a new ring and swaps the reference."""

    #: The key's stored digest and its principal, by that digest.
    by_digest: Mapping[bytes, tuple[bytes, Principal]]
    policies: Mapping[str, TenantPolicy]

    def __len__(self) -> int:
        return len(self.by_digest)

    def lookup(self, key: str) -> Principal | None:
        """The principal of ``key``, or None for a key the ring does not hold."""
        digest = hashlib.sha256(key.encode()).digest()  # ``key_digest``, inlined: per request
        entry = self.by_digest.get(digest)
        if entry is None:
            return None
        # Found by the digest's hash; the digests themselves are compared in constant time.
        stored, principal = entry
        return principal if hmac.compare_digest(stored, digest) else None

    def policy_of(self, tenant: str) -> TenantPolicy:
        """``tenant``'s policy (unlimited for a tenant the ring has no key of)."""
        return self.policies.get(tenant, _UNLIMITED)


_UNLIMITED = TenantPolicy()


@dataclass(frozen=True, slots=True)
class _Entry:
    """One key as read: its digest, tenant, admin flag, the limits it sets, and where it
    was given (for errors)."""

    digest: bytes
    tenant: str
    admin: bool
    limits: dict[str, Any]
    where: str


def load_key_ring(keys: Iterable[str] = (), path: str | None = None) -> KeyRing:
    """The ring of ``--api-key`` values and the entries of the TOML file at ``path``."""
    entries: list[_Entry] = []
    for i, key in enumerate(keys):
        if not key:
            raise ConfigError(f"--api-key #{i + 1} is empty")
        entries.append(_Entry(key_digest(key), DEFAULT_TENANT, False, {}, f"--api-key #{i + 1}"))
    if path is not None:
        entries += _read_file(path)
    policies = _tenant_policies(entries)
    by_digest: dict[bytes, tuple[bytes, Principal]] = {}
    for entry in entries:
        digest = entry.digest
        if digest in by_digest:
            raise ConfigError(f"{entry.where}: the same key is listed twice")
        principal = Principal(
            tenant=entry.tenant,
            key_id=key_id_of(digest),
            admin=entry.admin,
            policy=policies[entry.tenant],
        )
        by_digest[digest] = (digest, principal)
    return KeyRing(by_digest, policies)


def _read_file(path: str) -> list[_Entry]:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--api-keys-file {path}: cannot read it: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--api-keys-file {path}: not valid TOML: {exc}") from None
    unknown = set(doc) - {"keys"}
    if unknown:
        raise ConfigError(
            f"--api-keys-file {path}: unknown top-level field(s) {', '.join(sorted(unknown))} "
            "(only [[keys]] tables)"
        )
    tables = doc.get("keys", [])
    if not isinstance(tables, list):
        raise ConfigError(f"--api-keys-file {path}: 'keys' must be an array of [[keys]] tables")
    return [_entry(path, i, table) for i, table in enumerate(tables)]


def _entry(path: str, index: int, table: object) -> _Entry:
    where = f"--api-keys-file {path}: keys[{index}]"

    def bad(field: str, why: str) -> ConfigError:
        return ConfigError(f"{where}.{field}: {why}")

    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table")
    for name in table:
        if name not in _ENTRY_FIELDS:
            raise bad(name, f"unknown field (known: {', '.join(sorted(_ENTRY_FIELDS))})")
    if ("key" in table) == ("sha256" in table):
        raise ConfigError(f"{where}: give exactly one of 'key' and 'sha256'")
    if "key" in table:
        key = table["key"]
        if not isinstance(key, str) or not key:
            raise bad("key", "must be a non-empty string")
        digest = key_digest(key)
    else:
        hexdigest = table["sha256"]
        if not isinstance(hexdigest, str) or not _HEX64.fullmatch(hexdigest):
            raise bad("sha256", "must be the 64 hex digits of the key's SHA-256")
        digest = bytes.fromhex(hexdigest)
    if "tenant" not in table:
        raise bad("tenant", "missing")
    tenant = table["tenant"]
    if not valid_tenant(tenant):
        raise bad("tenant", f"must be a string matching {TENANT_PATTERN.pattern}")
    admin = table.get("admin", False)
    if not isinstance(admin, bool):
        raise bad("admin", "must be true or false")
    limits: dict[str, Any] = {}
    for name in ("rps", "tokens_per_minute"):
        if name in table:
            value = table[name]
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 < value < math.inf
            ):
                raise bad(name, "must be a positive number")
            limits[name] = float(value)
    if "max_concurrent" in table:
        value = table["max_concurrent"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad("max_concurrent", "must be an integer >= 1")
        limits["max_concurrent"] = value
    if "priority" in table:
        value = table["priority"]
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("priority", "must be an integer")
        limits["priority"] = value
    return _Entry(digest, tenant, admin, limits, where)


def _tenant_policies(entries: list[_Entry]) -> dict[str, TenantPolicy]:
    """Each tenant's policy, merged from its keys' limits (which must not disagree)."""
    merged: dict[str, dict[str, Any]] = {}
    for entry in entries:
        tenant = entry.tenant
        seen = merged.setdefault(tenant, {})
        for name, value in entry.limits.items():
            if name in seen and seen[name] != value:
                raise ConfigError(
                    f"{entry.where}.{name}: tenant {tenant!r} has {name} = {seen[name]} on "
                    "another key; a tenant's limits are the same on all of its keys"
                )
            seen[name] = value
    return {tenant: TenantPolicy(**limits) for tenant, limits in merged.items()}
