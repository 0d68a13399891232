"""Which cache space a request's prompt hashes into: its tenant's own, by default.

Every tenant's prompts hash into a block space of their own (``llm.cache_salt``), so no tenant
is served, or can time, another's cached prefix. The un-tenanted space (no salt of turnout's)
holds the requests of the ``default`` tenant (``--api-key`` keys, and every caller of a
frontend without credentials) and those of the tenants named by ``--shared-cache-tenants``,
which share their cached prefixes with each other. So a deployment with one tenant salts
nothing, and runs on engines that cannot partition their cache. A client's own
``cache_salt`` partitions further within its space.
"""

from __future__ import annotations

from collections.abc import Iterable

from turnout.frontend.access.limits import PRINCIPAL_METADATA
from turnout.frontend.access.principal import DEFAULT_TENANT, Principal
from turnout.runtime.context import RequestContext


class CacheSpaces:
    """The tenants that share the un-tenanted space; ``tenant_of`` names a request's space."""

    __slots__ = ("shared",)

    def __init__(self, shared: Iterable[str] = ()) -> None:
        self.shared = frozenset(shared) | {DEFAULT_TENANT}

    def tenant_of(self, ctx: RequestContext) -> str | None:
        """The tenant whose space the request's prompt hashes into (None: the un-tenanted
        space), from the principal the HTTP service put in its metadata."""
        principal: Principal | None = ctx.metadata.get(PRINCIPAL_METADATA)
        if principal is None or principal.tenant in self.shared:
            return None
        return principal.tenant
