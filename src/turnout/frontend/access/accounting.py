"""One admitted request's account with its tenant: the limits' ticket it holds, the tokens
charged to it as the request runs, and the usage recorded when it ends.

The HTTP service opens the account (the tenant's limits admit the request), puts it in the
request context's metadata under ``ACCOUNT_METADATA``, and closes it when the request ends,
whatever the path. The generation run (``openai.chat_run``) charges the prompt once it is
tokenized (a tenant past its token budget is refused then, before anything is sent), the
output tokens as they stream, and settles the request's usage when it closes.
"""

from __future__ import annotations

from typing import Protocol

from turnout.frontend.access.principal import Principal, TenantPolicy

#: ``RequestContext.metadata`` key: the request's ``TenantAccount``.
ACCOUNT_METADATA = "tenant_account"


class LimitsTicket(Protocol):
    """What a tenant's limits hand an admitted request (``access.limits.TenantTicket``)."""

    def charge_prompt(self, tokens: int) -> None: ...

    def charge_output(self, tokens: int) -> None: ...

    def release(self) -> None: ...


class TenantAdmission(Protocol):
    """The tenants' limits (``access.limits.TenantLimits``)."""

    def admit(self, principal: Principal) -> LimitsTicket: ...


class UsageRecorder(Protocol):
    """Per-tenant usage counters (``access.usage.TenantUsage``): recorded per request, read
    whole by ``/admin/usage``."""

    def record(self, tenant: str, *, prompt: int, cached: int, output: int) -> None: ...

    def begin(self, tenant: str) -> None: ...

    def end(self, tenant: str) -> None: ...

    def snapshot(self) -> dict[str, dict[str, int]]: ...


class TenantAccount:
    """See the module's docstring. ``ticket`` None: the tenants are not limited (usage is
    still recorded)."""

    __slots__ = ("_closed", "_settled", "_ticket", "_usage", "tenant")

    def __init__(
        self, tenant: str, ticket: LimitsTicket | None, usage: UsageRecorder | None
    ) -> None:
        self.tenant = tenant
        self._ticket = ticket
        self._usage = usage
        self._settled = False
        self._closed = False
        if usage is not None:
            usage.begin(tenant)

    def charge_prompt(self, tokens: int) -> None:
        """Charge the request's prompt; raises the limits' ``TenantLimitExceeded`` when the
        tenant's token budget cannot take it."""
        if self._ticket is not None:
            self._ticket.charge_prompt(tokens)

    def charge_output(self, tokens: int) -> None:
        """Charge tokens generated (never refused: they are already made)."""
        if self._ticket is not None:
            self._ticket.charge_output(tokens)

    def settle(self, *, prompt: int, cached: int, output: int) -> None:
        """Record the request's usage (once)."""
        if self._settled or self._usage is None:
            return
        self._settled = True
        self._usage.record(self.tenant, prompt=prompt, cached=cached, output=output)

    def close(self) -> None:
        """Give the request's concurrency slot back, and count it out of the tenant's
        requests in flight (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._ticket is not None:
            self._ticket.release()
        if self._usage is not None:
            self._usage.end(self.tenant)


def request_priority(asked: int | None, policy: TenantPolicy) -> int:
    """The admission queue's priority of a request: the tenant's priority, which the
    request's own (``nvext.priority``) may lower but never raise; the request's own when
    the tenant has none; 0 when neither says."""
    ceiling = policy.priority
    if ceiling is None:
        return asked or 0
    return ceiling if asked is None else min(asked, ceiling)
