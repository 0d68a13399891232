"""Who a request speaks for, and its account with its tenant: the HTTP service's side of
``frontend.access``.

With credentials configured (``auth``), every route but the open ones needs a key, checked
before the body is read (401 in the route's error shape otherwise), and the control routes
need an admin's (403, audited). A request then opens its tenant's account
(``access.accounting``): the tenant's limits admit it (429 with ``Retry-After`` past one),
and the account is closed with the request's status when it ends, however it ends. Without
credentials every caller is ``ANONYMOUS``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection

from turnout.frontend.access.accounting import ACCOUNT_METADATA, TenantAccount, TenantAdmission
from turnout.frontend.access.audit import AuditLog
from turnout.frontend.access.authenticator import Authenticator, require_admin
from turnout.frontend.access.limits import NO_LIMITS, PRINCIPAL_METADATA, TenantLimitExceeded
from turnout.frontend.access.principal import ANONYMOUS, Principal
from turnout.frontend.access.usage import TenantUsage, outcome_of
from turnout.frontend.http.errors import HttpError, to_http_error
from turnout.runtime.context import RequestContext
from turnout.runtime.http import ClientDisconnected, Scope

#: Routes anyone may call, with credentials configured or not.
OPEN_ROUTES = frozenset({"/health", "/live", "/ready"})
#: Routes ``public_routes`` (``--public-route``) may open to callers without a key.
PUBLIC_ROUTE_CHOICES = (
    "/metrics",
    "/metrics/targets",
    "/v1/models",
    "/openapi.json",
    "/dashboard",
    "/dashboard/state.json",
)


class AccessGate:
    """See the module's docstring."""

    def __init__(
        self,
        auth: Authenticator | None,
        audit: AuditLog,
        *,
        public_routes: Collection[str] = (),
        admin_paths: Collection[str] = (),
        tenants: TenantAdmission | None = None,
        usage: TenantUsage | None = None,
    ) -> None:
        """``auth``: who may call (None: anyone, as ``ANONYMOUS``); ``public_routes``: of
        ``PUBLIC_ROUTE_CHOICES``, those open without a key; ``admin_paths``: those that need
        an admin key. ``tenants``: the tenants' limits (None: unlimited); ``usage``: where
        each tenant's requests and tokens are counted (None: nowhere)."""
        unknown = set(public_routes) - set(PUBLIC_ROUTE_CHOICES)
        if unknown:
            raise ValueError(f"not a route that can be public: {', '.join(sorted(unknown))}")
        self.auth = auth
        self.audit = audit
        #: Paths callers reach without a key (every path when ``auth`` is None).
        self.open_paths = OPEN_ROUTES | frozenset(public_routes)
        self._admin_paths = frozenset(admin_paths)
        self.tenants = tenants
        self.usage = usage

    def caller(self, scope: Scope, path: str) -> Principal:
        """Who the request speaks for: ``ANONYMOUS`` without credentials configured and on
        open paths; else its credential's principal (401 without a valid one), which must
        be an admin's on the control routes (403, audited)."""
        auth = self.auth
        if auth is None or path in self.open_paths:
            return ANONYMOUS
        principal = auth.authenticate(scope.headers)
        if path in self._admin_paths and not principal.admin:
            self.audit.record(
                principal, method=scope.method, route=path, client=scope.client, allowed=False
            )
            require_admin(principal)
        return principal

    def open_account(self, principal: Principal, ctx: RequestContext) -> TenantAccount | None:
        """A generation's account with its tenant, in ``ctx`` for the run to charge (None:
        neither limits nor usage to keep); raises the limits' ``TenantLimitExceeded``. The
        principal goes in ``ctx`` too: the preprocessor salts the prompt's blocks by tenant."""
        metadata = ctx.metadata
        if self.auth is not None:
            metadata[PRINCIPAL_METADATA] = principal
        account = self._account(principal)
        if account is not None:
            metadata[ACCOUNT_METADATA] = account
        return account

    def close(self, account: TenantAccount | None, principal: Principal, status: int) -> None:
        """End a request's accounting with its ``status`` (``account`` None: it was refused
        before its account opened, and is still counted)."""
        if account is not None:
            account.close(status)
        elif self.usage is not None:
            self.usage.count_request(principal.tenant, outcome_of(status))

    def _account(self, principal: Principal) -> TenantAccount | None:
        """An account the tenant's limits admit (None: neither limits nor usage to keep);
        raises the limits' ``TenantLimitExceeded``."""
        tenants, usage = self.tenants, self.usage
        if tenants is None and usage is None:
            return None
        tenant = principal.tenant
        ticket = tenants.admit(principal) if tenants is not None else NO_LIMITS
        return TenantAccount(tenant, ticket, usage.tally(tenant) if usage is not None else None)

    async def accounted(self, principal: Principal, serve: Callable[[], Awaitable[None]]) -> None:
        """Run a route's handler (the response store's) under its tenant's account, as a
        generation runs: the tenant's ``rps`` and ``max_concurrent`` admit it (a refusal is a
        429 with ``Retry-After``, in OpenAI's error shape), its usage counts it, and the
        account closes with the route's status on every path."""
        status = 200
        account: TenantAccount | None = None
        try:
            try:
                account = self._account(principal)
            except TenantLimitExceeded as exc:
                raise to_http_error(exc) from exc
            await serve()
        except HttpError as exc:
            status = exc.status
            raise
        except ClientDisconnected as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        except BaseException:
            status = 500
            raise
        finally:
            self.close(account, principal, status)
