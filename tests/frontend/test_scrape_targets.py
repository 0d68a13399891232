"""``GET /metrics/targets``'s body: one entry per metrics endpoint of the records, frontends
first, instances of one process folded into one target, workers without a metrics endpoint
left out, and a cap on the count."""

from __future__ import annotations

import pytest

from turnout.frontend.http import scrape_targets as st
from turnout.protocols.frontend import FrontendRecord
from turnout.protocols.model import EndpointId, Instance, TransportAddress

ENDPOINT = EndpointId(namespace="prod", component="backend", name="generate")


def instance(instance_id: int, metrics_url: str) -> Instance:
    return Instance(
        endpoint=ENDPOINT,
        instance_id=instance_id,
        transport=TransportAddress(kind="tcp", address="10.0.0.2:9000"),
        metrics_url=metrics_url,
    )


def test_frontends_and_workers_with_metrics_are_listed_once_each() -> None:
    frontends = [
        FrontendRecord(frontend_id=2, http_address="http://10.0.0.9:8000"),
        FrontendRecord(frontend_id=1, http_address="http://10.0.0.1:8000/"),
        FrontendRecord(frontend_id=3),  # no address yet: nothing to scrape
    ]
    instances = [
        instance(1, "http://10.0.0.2:8081/metrics"),
        instance(2, "http://10.0.0.2:8081/metrics"),  # same process, one target
        instance(3, ""),  # no --system-port
        instance(4, "not a url"),
    ]
    assert st.scrape_targets(frontends, instances) == [
        {"targets": ["10.0.0.1:8000"],
         "labels": {"__metrics_path__": "/metrics", "turnout_role": "frontend"}},
        {"targets": ["10.0.0.9:8000"],
         "labels": {"__metrics_path__": "/metrics", "turnout_role": "frontend"}},
        {"targets": ["10.0.0.2:8081"],
         "labels": {"__metrics_path__": "/metrics", "turnout_role": "worker",
                    "turnout_namespace": "prod", "turnout_component": "backend"}},
    ]  # fmt: skip


def test_the_list_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(st, "MAX_TARGETS", 3)
    instances = [instance(i, f"http://10.0.1.{i}:8081/metrics") for i in range(10)]
    assert len(st.scrape_targets([], instances)) == 3
