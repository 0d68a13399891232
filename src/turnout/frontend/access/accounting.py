"""One admitted request's account with its tenant: the limits' ticket it holds, the tokens
charged to it as the request runs, and the usage recorded when it ends.

The HTTP service opens the account (the tenant's limits admit the request), puts it in the
request context's metadata under ``ACCOUNT_METADATA``, and closes it with the response's
status when the request ends, whatever the path. The generation run (``openai.chat_run``)
charges the prompt once it is tokenized (a tenant past its token budget is refused then,
before anything is sent), the output tokens as they stream, and settles the request's usage
when it closes. A relayed Text-input response (``openai.responder.RelayMeter``) charges the
usage its worker's chunks report, prompt included, as debt (``charge_relayed``), and settles it
when the relay ends.

The account holds its tenant's usage tally (``access.usage.TenantTally``), looked up once
when it opens: opening, settling and closing add to its fields, with no lookup and no call
into ``TenantUsage``.
"""

from __future__ import annotations

from typing import Protocol

from turnout.frontend.access.principal import Principal, TenantPolicy
from turnout.frontend.access.usage import TenantTally, outcome_of

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
    """Per-tenant usage counters (``access.usage.TenantUsage``), read whole by
    ``/admin/usage``; the accounts add to them through ``TenantUsage.tally``."""

    def snapshot(self) -> dict[str, dict[str, int]]: ...


class TenantAccount:
    """See the module's docstring. ``ticket``: the limits' (``access.limits.NO_LIMITS`` for
    a tenant without limits, or none configured); ``tally``: the tenant's usage counters
    (None: usage is not kept)."""

    __slots__ = ("_closed", "_settled", "_tally", "_ticket", "tenant")

    def __init__(self, tenant: str, ticket: LimitsTicket, tally: TenantTally | None) -> None:
        self.tenant = tenant
        self._ticket = ticket
        self._tally = tally
        self._settled = False
        self._closed = False
        if tally is not None:
            tally.inflight += 1

    def charge_prompt(self, tokens: int) -> None:
        """Charge the request's prompt; raises the limits' ``TenantLimitExceeded`` when the
        tenant's token budget cannot take it."""
        self._ticket.charge_prompt(tokens)

    def charge_output(self, tokens: int) -> None:
        """Charge tokens generated (never refused: they are already made)."""
        self._ticket.charge_output(tokens)

    def charge_relayed(self, tokens: int) -> None:
        """Charge tokens a relayed (Text-input) response reports, prompt and output alike
        (never refused: the worker reports them once it is already streaming, so the
        tenant's next request pays any debt, as with ``charge_output``)."""
        self._ticket.charge_output(tokens)

    def settle(self, *, prompt: int, cached: int, output: int) -> None:
        """Record the request's usage (once)."""
        tally = self._tally
        if self._settled or tally is None:
            return
        self._settled = True
        tally.prompt += prompt
        tally.cached += cached
        tally.output += output

    def close(self, status: int) -> None:
        """Give the request's concurrency slot back, and count the request out of its
        tenant's requests in flight and under the outcome of its HTTP ``status``
        (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._ticket.release()
        tally = self._tally
        if tally is not None:
            tally.inflight -= 1
            tally.count_request(outcome_of(status))


def request_priority(asked: int | None, policy: TenantPolicy, *, authenticated: bool) -> int:
    """The admission queue's priority of a request: the tenant's priority, which the
    request's own (``nvext.priority``) may lower but never raise. An authenticated tenant
    without one has 0 as its ceiling, so no caller can queue ahead of a tenant the operator
    ranked higher, or push its waiters out of a full queue. Without credentials configured
    (``authenticated`` False) the request's own, or 0."""
    ceiling = policy.priority
    if ceiling is None:
        if not authenticated:
            return asked or 0
        ceiling = 0
    return ceiling if asked is None else min(asked, ceiling)
