"""Usage per tenant: the snapshot the admin route reads, the metrics on a registry, and the
bound on tenants (past it, one ``_other``)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from turnout.frontend.access.usage import OTHER_TENANT, OUTCOMES, TenantUsage, outcome_of


def record(usage: TenantUsage, tenant: str, *, prompt: int, cached: int, output: int) -> None:
    """One request's tokens into its tenant's tally, as a request's account settles them."""
    tally = usage.tally(tenant)
    tally.prompt += prompt
    tally.cached += cached
    tally.output += output


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_snapshot_sums_each_tenants_requests_and_tokens() -> None:
    usage = TenantUsage(None)
    record(usage, "alice", prompt=100, cached=64, output=20)
    record(usage, "alice", prompt=10, cached=0, output=5)
    record(usage, "bob", prompt=7, cached=0, output=1)
    usage.count_request("alice", "ok")
    usage.count_request("alice", "rate_limited")
    usage.count_request("bob", "ok")
    assert usage.snapshot() == {
        "alice": {"requests": 2, "prompt_tokens": 110, "cached_tokens": 64, "output_tokens": 25},
        "bob": {"requests": 1, "prompt_tokens": 7, "cached_tokens": 0, "output_tokens": 1},
    }


def test_metrics_render_on_the_registry() -> None:
    registry = CollectorRegistry()
    usage = TenantUsage(registry)
    record(usage, "alice", prompt=100, cached=64, output=20)
    usage.count_request("alice", "ok")
    usage.count_request("alice", "ok")
    usage.count_rejection("alice", "rps")
    usage.tally("alice").inflight += 2  # two requests began, one ended
    usage.tally("alice").inflight -= 1
    assert sample(registry, "turnout_tenant_requests_total", tenant="alice", outcome="ok") == 2
    for kind, n in (("prompt", 100), ("cached", 64), ("output", 20)):
        assert sample(registry, "turnout_tenant_tokens_total", tenant="alice", kind=kind) == n
    assert sample(registry, "turnout_tenant_rejections_total", tenant="alice", limit="rps") == 1
    assert sample(registry, "turnout_tenant_inflight", tenant="alice") == 1
    text = generate_latest(registry).decode()
    assert "# TYPE turnout_tenant_tokens_total counter" in text
    assert "# TYPE turnout_tenant_inflight gauge" in text


def test_tenants_past_the_cap_share_one_label_and_one_tally() -> None:
    registry = CollectorRegistry()
    usage = TenantUsage(registry, max_tenants=2)
    for i in range(50):
        record(usage, f"t{i}", prompt=1, cached=0, output=0)
        usage.count_request(f"t{i}", "ok")
    record(usage, "t0", prompt=5, cached=0, output=0)  # a tenant with its own tally keeps it
    snapshot = usage.snapshot()
    assert set(snapshot) == {"t0", "t1", OTHER_TENANT}
    assert snapshot["t0"]["prompt_tokens"] == 6
    assert snapshot[OTHER_TENANT] == {
        "requests": 48, "prompt_tokens": 48, "cached_tokens": 0, "output_tokens": 0,
    }  # fmt: skip
    tenants = {
        s.labels["tenant"]
        for metric in registry.collect()
        for s in metric.samples
        if s.name == "turnout_tenant_requests_total"
    }
    assert tenants == {"t0", "t1", OTHER_TENANT}


def test_an_unknown_outcome_is_a_bug_not_a_label() -> None:
    usage = TenantUsage(None)
    with pytest.raises(ValueError, match="outcome"):
        usage.count_request("alice", "teapot")
    assert usage.snapshot() == {}


@pytest.mark.parametrize(
    ("status", "outcome"),
    [(200, "ok"), (401, "unauthorized"), (403, "unauthorized"), (429, "rate_limited"),
     (499, "cancelled"), (400, "client_error"), (404, "client_error"),
     (503, "server_error"), (500, "server_error")],
)  # fmt: skip
def test_outcome_of_status(status: int, outcome: str) -> None:
    assert outcome_of(status) == outcome
    assert outcome in OUTCOMES


def test_two_usages_register_on_separate_registries() -> None:
    TenantUsage(CollectorRegistry())
    TenantUsage(CollectorRegistry())
