"""What every turnout process says about itself on ``/metrics``, whatever it serves: its build
(``turnout_build_info``) and its process (``process_*``: CPU seconds, resident memory, open
file descriptors, start time, read from ``/proc`` at scrape time).

An operator reads the build line to tell which version each process of a deployment runs
during an upgrade (frontends and workers may differ for a while); ``component`` says which
kind of process answered (``frontend``, ``worker``, ``attach``).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from turnout import __version__
from turnout.runtime.discovery.base import DiscoveryStore

BUILD_INFO = "turnout_build_info"


class BuildInfoCollector(Collector):
    """``turnout_build_info{version, python, component} 1``."""

    def __init__(self, component: str) -> None:
        self._labels = [__version__, platform.python_version(), component]

    def collect(self) -> Iterator[Any]:
        family = GaugeMetricFamily(
            BUILD_INFO,
            "turnout's version, the Python that runs it and the kind of process (always 1)",
            labels=["version", "python", "component"],
        )
        family.add_metric(self._labels, 1)
        yield family


def register_process_metrics(registry: CollectorRegistry, component: str) -> None:
    """Add the build line and the ``process_*`` metrics to ``registry``."""
    ProcessCollector(registry=registry)
    registry.register(BuildInfoCollector(component))


class StoreContactCollector(Collector):
    """``turnout_store_last_contact_seconds`` (since the discovery store last answered one of
    this process's lease keep-alives) and ``turnout_store_keepalive_failures_total``: an
    unreachable store shows here while the process still serves from what it knows. No
    sample before the process holds a lease."""

    def __init__(
        self,
        store: Callable[[], DiscoveryStore | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._clock = clock

    def collect(self) -> Iterator[Any]:
        since = GaugeMetricFamily(
            "turnout_store_last_contact_seconds",
            "Seconds since the discovery store last answered a lease keep-alive",
        )
        failures = CounterMetricFamily(
            "turnout_store_keepalive_failures", "Lease keep-alives the store did not answer"
        )
        store = self._store()
        contact = store.contact if store is not None else None
        if contact is not None and contact.last_ok is not None:
            since.add_metric([], max(0.0, self._clock() - contact.last_ok))
            failures.add_metric([], contact.failures)
        yield since
        yield failures
