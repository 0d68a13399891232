"""Each tenant's limits: requests per second, tokens per minute, requests in flight.

The HTTP service admits a request for its principal (``TenantLimits.admit``) before any
work, and holds the ``TenantTicket`` it gets until the request ends. In order, admission
refuses a tenant that has ``max_concurrent`` requests in flight, a tenant whose token budget
is in debt (output tokens of earlier requests overdrew it), and a request past the ``rps``
bucket. Once the prompt is tokenized, ``charge_prompt`` takes its tokens from the
tokens-per-minute bucket (refused if the bucket cannot pay them now); output tokens are
charged as they stream (``charge_output``), never refused: a stream is not cut, the debt
makes the tenant's next request wait. A ticket passes its output on to the bucket every
``OUTPUT_FLUSH_TOKENS`` tokens and when released (a bucket read per token would cost more
than the rest of the accounting), so admission sees a stream's output at most that many
tokens late. A refusal is ``TenantLimitExceeded``: HTTP 429 with
``Retry-After`` and a message naming the limit.

Buckets hold one second's requests (``rps``, at least one) and one minute's tokens
(``tokens_per_minute``). A policy that changes (a reloaded key file) is applied at the
tenant's next admission, keeping what its buckets hold.

Memory is bounded: only tenants with a limit have state, and at most ``max_tenants`` of
them. A tenant past that takes the place of the least recently admitted tenant with no
request in flight among the oldest ``EVICTION_SCAN`` (the oldest outright if all of them
have some). An evicted tenant starts again from full buckets; its tickets in flight keep
their own state, so a release is never lost. Eviction forgives a tenant's debt only when
more than ``max_tenants`` limited tenants were admitted since its last request.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NoReturn, Protocol

from turnout.errors import TurnoutError
from turnout.frontend.access.buckets import TokenBucket
from turnout.frontend.access.principal import Principal, TenantPolicy

#: ``RequestContext.metadata`` key: the request's ``Principal`` (set by the HTTP service).
PRINCIPAL_METADATA = "principal"

RPS = "rps"
TOKENS_PER_MINUTE = "tokens_per_minute"
MAX_CONCURRENT = "max_concurrent"
#: Seconds a tenant refused for ``max_concurrent`` is asked to wait: a slot frees when one of
#: its requests ends, which nothing here can foresee.
CONCURRENCY_RETRY_AFTER = 1.0
#: How many of the least recently admitted tenants an eviction looks through for one with
#: no request in flight.
EVICTION_SCAN = 32
#: Output tokens a ticket gathers before it charges them to its tenant's bucket.
OUTPUT_FLUSH_TOKENS = 16


class TenantLimitExceeded(TurnoutError):
    """A tenant is past one of its limits. ``limit`` is ``rps``, ``tokens_per_minute`` or
    ``max_concurrent`` (a bounded label), ``retry_after`` the seconds until the request
    could pass (HTTP ``Retry-After``)."""

    def __init__(self, tenant: str, limit: str, value: float, retry_after: float) -> None:
        shown = int(value) if float(value).is_integer() else value
        super().__init__(
            f"tenant '{tenant}' is over its '{limit}' limit ({shown}); "
            f"retry after {retry_after:.3g} s"
        )
        self.tenant = tenant
        self.limit = limit
        self.value = value
        self.retry_after = retry_after


class RejectionCounter(Protocol):
    """Where refusals are counted (``access.usage.TenantUsage``)."""

    def count_rejection(self, tenant: str, limit: str) -> None: ...


class _TenantState:
    """One limited tenant's buckets and requests in flight. ``inflight`` is changed only by
    ``TenantLimits.admit`` and ``TenantTicket.release``."""

    __slots__ = ("inflight", "policy", "rps", "tpm")

    def __init__(self, policy: TenantPolicy, clock: Callable[[], float]) -> None:
        self.policy = policy
        self.inflight = 0
        self.rps: TokenBucket | None = None
        self.tpm: TokenBucket | None = None
        self.configure(policy, clock)

    def configure(self, policy: TenantPolicy, clock: Callable[[], float]) -> None:
        self.policy = policy
        self.rps = _bucket(self.rps, policy.rps, max(policy.rps or 0.0, 1.0), clock)
        tpm = policy.tokens_per_minute
        self.tpm = _bucket(self.tpm, tpm, tpm or 0.0, clock, per=60.0)


def _bucket(
    bucket: TokenBucket | None,
    rate: float | None,
    capacity: float,
    clock: Callable[[], float],
    *,
    per: float = 1.0,
) -> TokenBucket | None:
    """``bucket`` set to ``capacity`` tokens refilled ``rate`` per ``per`` seconds (None:
    unlimited)."""
    if rate is None:
        return None
    if bucket is None:
        return TokenBucket(capacity, rate / per, clock)
    bucket.configure(capacity, rate / per)
    return bucket


def check_policy(policy: TenantPolicy) -> None:
    """Raise ``ValueError`` for a policy no bucket can hold (a key file's or a JWT's)."""
    for name, value in (
        (RPS, policy.rps),
        (TOKENS_PER_MINUTE, policy.tokens_per_minute),
        (MAX_CONCURRENT, policy.max_concurrent),
    ):
        if value is not None and (not value > 0 or math.isinf(value)):
            raise ValueError(f"'{name}' must be a finite number > 0, got {value}")


class TenantTicket:
    """An admitted request's hold on its tenant's limits. ``release`` when it ends."""

    __slots__ = ("_counter", "_owed", "_released", "_state", "_tenant", "_tpm")

    def __init__(
        self, tenant: str, state: _TenantState | None, counter: RejectionCounter | None
    ) -> None:
        self._tenant = tenant
        self._state = state
        self._counter = counter
        self._released = state is None
        #: The tenant's tokens-per-minute bucket when the request was admitted (None: none).
        self._tpm = state.tpm if state is not None else None
        #: Output tokens charged and not yet taken from ``_tpm``.
        self._owed = 0

    def charge_prompt(self, tokens: int) -> None:
        """Take the prompt's tokens from the tenant's tokens-per-minute budget; raises
        ``TenantLimitExceeded`` (nothing taken) when the budget cannot pay them now."""
        tpm = self._tpm
        if tpm is None:
            return
        wait = tpm.try_take(tokens)
        if wait > 0:
            state = self._state
            assert state is not None
            limit = state.policy.tokens_per_minute
            assert limit is not None
            if self._counter is not None:
                self._counter.count_rejection(self._tenant, TOKENS_PER_MINUTE)
            raise TenantLimitExceeded(self._tenant, TOKENS_PER_MINUTE, limit, wait)

    def charge_output(self, tokens: int) -> None:
        """Take generated tokens from the budget, into debt if need be (never refused)."""
        tpm = self._tpm
        if tpm is None:
            return
        owed = self._owed + tokens
        if owed < OUTPUT_FLUSH_TOKENS:
            self._owed = owed
            return
        self._owed = 0
        tpm.force_take(owed)

    def release(self) -> None:
        """Charge the output still owed and give the request's concurrency slot back
        (idempotent)."""
        if self._released:
            return
        self._released = True
        state = self._state
        assert state is not None
        state.inflight -= 1
        owed = self._owed
        if owed:
            self._owed = 0
            tpm = self._tpm
            assert tpm is not None
            tpm.force_take(owed)


#: The ticket of every request whose tenant has no limit: nothing to charge or release.
NO_LIMITS = TenantTicket("", None, None)


class TenantLimits:
    """See the module's docstring."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        max_tenants: int = 10_000,
        *,
        rejections: RejectionCounter | None = None,
    ) -> None:
        """``rejections``: where each refusal is counted by tenant and limit."""
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be at least 1, got {max_tenants}")
        self._clock = clock
        self._max_tenants = max_tenants
        self._rejections = rejections
        #: Limited tenants' state, least recently admitted first.
        self._states: OrderedDict[str, _TenantState] = OrderedDict()

    def __len__(self) -> int:
        """Tenants with state (at most ``max_tenants``)."""
        return len(self._states)

    def admit(self, principal: Principal) -> TenantTicket:
        """The request's ticket, or ``TenantLimitExceeded`` (nothing taken) when its tenant
        is at ``max_concurrent``, in token debt, or past its ``rps``. A tenant without limits
        gets ``NO_LIMITS``: no state, no clock read."""
        policy = principal.policy
        if (
            policy.rps is None
            and policy.tokens_per_minute is None
            and policy.max_concurrent is None
        ):
            return NO_LIMITS
        tenant = principal.tenant
        states = self._states
        state = states.get(tenant)
        if state is not None and state.policy is policy:
            states.move_to_end(tenant)
        else:
            state = self._state(tenant, policy)
        limit = policy.max_concurrent
        if limit is not None and state.inflight >= limit:
            self._refuse(tenant, MAX_CONCURRENT, limit, CONCURRENCY_RETRY_AFTER)
        tpm = state.tpm
        if tpm is not None and tpm.level < 0:  # not in debt at its last level: none now
            debt = tpm.debt_wait()
            if debt > 0:
                assert policy.tokens_per_minute is not None
                self._refuse(tenant, TOKENS_PER_MINUTE, policy.tokens_per_minute, debt)
        rps = state.rps
        if rps is not None:
            wait = rps.try_take(1)
            if wait > 0:
                assert policy.rps is not None
                self._refuse(tenant, RPS, policy.rps, wait)
        state.inflight += 1
        return TenantTicket(tenant, state, self._rejections)

    def _refuse(self, tenant: str, limit: str, value: float, retry_after: float) -> NoReturn:
        if self._rejections is not None:
            self._rejections.count_rejection(tenant, limit)
        raise TenantLimitExceeded(tenant, limit, value, retry_after)

    def _state(self, tenant: str, policy: TenantPolicy) -> _TenantState:
        states = self._states
        state = states.get(tenant)
        if state is not None:
            states.move_to_end(tenant)
            if state.policy != policy:
                state.configure(policy, self._clock)
            else:  # an equal policy of a reloaded ring: its identity takes ``admit``'s fast path
                state.policy = policy
            return state
        if len(states) >= self._max_tenants:
            self._evict()
        state = states[tenant] = _TenantState(policy, self._clock)
        return state

    def _evict(self) -> None:
        states = self._states
        victim = next(iter(states))
        for i, (name, state) in enumerate(states.items()):
            if i >= EVICTION_SCAN:
                break
            if state.inflight == 0:
                victim = name
                break
        del states[victim]
