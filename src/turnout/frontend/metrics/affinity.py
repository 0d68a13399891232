"""``turnout_session_affinity_*``: each model's session bindings, read at scrape time (no cost
on the request path), from the tables ``PipelineFactory.session_tables`` holds."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from turnout.router.session_affinity import SessionTable


class SessionAffinityCollector(Collector):
    """Bindings held, new sessions refused a binding (the table was full of sessions with
    requests in flight), and bindings freed because their instance left, was set aside,
    could not be reached or broke a stream. Counters restart with a model's table (when the
    model leaves discovery and comes back)."""

    def __init__(self, tables: Mapping[str, SessionTable]) -> None:
        self._tables = tables

    def collect(self) -> Iterator[Any]:
        sessions = GaugeMetricFamily(
            "turnout_session_affinity_sessions",
            "Sessions bound to an instance (in flight or idle within the TTL)",
            labels=["model"],
        )
        refused = CounterMetricFamily(
            "turnout_session_affinity_refused",
            "New sessions routed without a binding because every binding was in use",
            labels=["model"],
        )
        rebound = CounterMetricFamily(
            "turnout_session_affinity_rebound",
            "Bindings freed because their instance left, was set aside or failed",
            labels=["model"],
        )
        for model, table in list(self._tables.items()):
            sessions.add_metric([model], len(table))
            refused.add_metric([model], table.num_refused)
            rebound.add_metric([model], table.num_rebound)
        yield sessions
        yield refused
        yield rebound
