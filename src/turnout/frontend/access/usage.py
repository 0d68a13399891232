"""Usage accounting per tenant: requests by outcome, prompt/cached/output tokens, refusals by
limit, requests in flight. Read whole by the admin route (``snapshot``) and exported on the
frontend's ``/metrics``:

* ``turnout_tenant_requests_total{tenant,outcome}`` (``OUTCOMES``);
* ``turnout_tenant_tokens_total{tenant,kind}`` (kind: ``prompt``, ``cached``, ``output``);
* ``turnout_tenant_rejections_total{tenant,limit}`` (``access.limits``' limit names);
* ``turnout_tenant_inflight{tenant}``.

Bounded: the first ``max_tenants`` tenants seen have their own tally and label; every tenant
after them is counted under ``OTHER_TENANT`` (``_other``), in the snapshot as in the metrics,
so neither a flood of tenants (JWT claims) nor a long uptime grows either without bound.

The tallies are plain integers written from the event loop; the metrics are rendered from
them by a ``prometheus_client`` collector when ``/metrics`` is read, so counting costs no
lock and no label lookup. A request's account looks its tenant's tally up once and counts
everything of the request into it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: The tenant label (and snapshot key) of every tenant past ``max_tenants``.
OTHER_TENANT = "_other"
#: A request's outcome, by its HTTP status (``outcome_of``).
OUTCOMES = ("ok", "client_error", "unauthorized", "rate_limited", "cancelled", "server_error")
#: Token kinds of ``turnout_tenant_tokens_total``.
TOKEN_KINDS = ("prompt", "cached", "output")


def outcome_of(status: int) -> str:
    """A request's outcome label from its HTTP status."""
    if status < 400:
        return "ok"
    if status in (401, 403):
        return "unauthorized"
    if status == 429:
        return "rate_limited"
    if status == 499:
        return "cancelled"
    return "client_error" if status < 500 else "server_error"


class TenantTally:
    """One tenant's counters (or ``_other``'s), written by ``TenantUsage`` and by the
    requests' accounts (``access.accounting``), which hold their tenant's tally and add to
    its fields directly: one lookup per request, not one per count."""

    __slots__ = ("cached", "inflight", "output", "prompt", "rejections", "requests")

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.rejections: dict[str, int] = {}
        self.prompt = 0
        self.cached = 0
        self.output = 0
        self.inflight = 0

    def count_request(self, outcome: str) -> None:
        """Count one request that ended with ``outcome`` (one of ``OUTCOMES``)."""
        requests = self.requests
        requests[outcome] = requests.get(outcome, 0) + 1


class TenantUsage(Collector):
    """See the module's docstring."""

    def __init__(self, registry: CollectorRegistry | None, max_tenants: int = 100) -> None:
        """``registry``: where the metrics render (the frontend's; None: not exported)."""
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be at least 1, got {max_tenants}")
        self._max_tenants = max_tenants
        self._tallies: dict[str, TenantTally] = {}
        if registry is not None:
            registry.register(self)

    def tally(self, tenant: str) -> TenantTally:
        """``tenant``'s tally (``_other``'s past ``max_tenants``), made on first use."""
        tallies = self._tallies
        tally = tallies.get(tenant)
        if tally is None:
            own = len(tallies) - (OTHER_TENANT in tallies) < self._max_tenants
            key = tenant if own else OTHER_TENANT
            tally = tallies.get(key)
            if tally is None:
                tally = tallies[key] = TenantTally()
        return tally

    def count_request(self, tenant: str, outcome: str) -> None:
        """Count one request that ended with ``outcome`` (one of ``OUTCOMES``)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown request outcome {outcome!r}; one of {OUTCOMES}")
        self.tally(tenant).count_request(outcome)

    def count_rejection(self, tenant: str, limit: str) -> None:
        """Count one request refused by the tenant's ``limit`` (``access.limits``)."""
        rejections = self.tally(tenant).rejections
        rejections[limit] = rejections.get(limit, 0) + 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Each tenant's totals: ``requests``, ``prompt_tokens``, ``cached_tokens``,
        ``output_tokens`` (tenants past the cap under ``_other``)."""
        return {
            tenant: {
                "requests": sum(t.requests.values()),
                "prompt_tokens": t.prompt,
                "cached_tokens": t.cached,
                "output_tokens": t.output,
            }
            for tenant, t in self._tallies.items()
        }

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "turnout_tenant_requests",
            "Requests by tenant and outcome",
            labels=["tenant", "outcome"],
        )
        tokens = CounterMetricFamily(
            "turnout_tenant_tokens",
            "Tokens by tenant and kind (prompt, cached prompt, output)",
            labels=["tenant", "kind"],
        )
        rejections = CounterMetricFamily(
            "turnout_tenant_rejections",
            "Requests refused by a tenant's limit",
            labels=["tenant", "limit"],
        )
        inflight = GaugeMetricFamily(
            "turnout_tenant_inflight", "Requests in flight by tenant", labels=["tenant"]
        )
        for tenant, t in self._tallies.items():
            for outcome, n in t.requests.items():
                requests.add_metric([tenant, outcome], n)
            for kind, n in zip(TOKEN_KINDS, (t.prompt, t.cached, t.output), strict=True):
                tokens.add_metric([tenant, kind], n)
            for limit, n in t.rejections.items():
                rejections.add_metric([tenant, limit], n)
            inflight.add_metric([tenant], t.inflight)
        yield requests
        yield tokens
        yield rejections
        yield inflight
