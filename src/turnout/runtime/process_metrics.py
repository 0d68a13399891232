"""What every turnout process says about itself on ``/metrics``, whatever it serves: its build
(``turnout_build_info``) and its process (``process_*``: CPU seconds, resident memory, open
file descriptors, start time, read from ``/proc`` at scrape time).

An operator reads the build line to tell which version each process of a deployment runs
during an upgrade (frontends and workers may differ for a while); ``component`` says which
kind of process answered (``frontend``, ``worker``, ``attach``).
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from turnout import __version__

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
