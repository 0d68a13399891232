"""Who a request speaks for: the caller its credential names, and that tenant's policy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """What one tenant may use (None: unlimited), from its key's table or its JWT's claims."""

    #: Requests per second (a token bucket of one second's worth).
    rps: float | None = None
    #: Prompt tokens at admission plus output tokens as they stream, per minute.
    tokens_per_minute: float | None = None
    #: Requests in flight at once.
    max_concurrent: int | None = None
    #: The admission queue's priority of the tenant's requests (higher first); a request's
    #: ``nvext.priority`` may lower it, never raise it.
    priority: int | None = None


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller.

    ``key_id`` names the credential in logs and the audit log without revealing it: the first
    hex digits of the key's SHA-256, or ``jwt:<subject>``; never the key itself.
    """

    tenant: str
    key_id: str
    admin: bool = False
    policy: TenantPolicy = TenantPolicy()


#: The tenant of ``--api-key`` keys and of the frontend without credentials. Its prompts hash
#: into the un-tenanted cache space (``access.cache_space``).
DEFAULT_TENANT = "default"

#: The caller of a frontend that runs without credentials configured: one tenant, no limits.
ANONYMOUS = Principal(tenant=DEFAULT_TENANT, key_id="anonymous")
