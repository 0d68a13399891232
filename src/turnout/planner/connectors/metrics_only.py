"""``metrics-only``: the planner decides and exports ``turnout_planner_desired_replicas{pool}``;
an external autoscaler (a Kubernetes HPA through prometheus-adapter, or KEDA's Prometheus
scaler) acts on it. See ``deploy/kubernetes/autoscaling``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge


def desired_replicas_gauge(registry: CollectorRegistry) -> Gauge:
    """The gauge every planner exports, whatever its connector."""
    return Gauge(
        "turnout_planner_desired_replicas",
        "Replicas the planner wants in each pool",
        ["pool"],
        registry=registry,
    )


class MetricsOnlyConnector:
    """Sets the desired-replicas gauge; never changes a pool itself."""

    name = "metrics-only"

    def __init__(self, desired: Gauge) -> None:
        self._desired = desired

    async def start(self) -> None:
        return None

    async def replicas(self, pool: str) -> int | None:
        return None  # discovery counts the pool's instances

    async def scale(self, pool: str, replicas: int, *, drain_first: list[int]) -> None:
        self._desired.labels(pool).set(replicas)

    async def close(self, *, stop_workers: bool) -> None:
        return None
