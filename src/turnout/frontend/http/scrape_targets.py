"""``GET /metrics/targets``: Prometheus HTTP service discovery (``http_sd_configs``) of the
fleet this frontend sees, so one scrape job finds every frontend, worker and planner.

The body is the JSON list Prometheus reads: ``[{"targets": ["host:port"], "labels": {...}}]``,
one entry per metrics endpoint, with ``__scheme__`` (``https`` for a frontend serving TLS),
``__metrics_path__``, ``turnout_role`` (``frontend``, ``worker`` or ``planner``) and, for
workers, ``turnout_namespace`` and ``turnout_component`` (planners: ``turnout_namespace``).
Frontends are their records' HTTP addresses plus ``/metrics``; workers are the
``metrics_url`` their instance records name (a worker or attach with ``--system-port``:
several instances of one process share one target); planners are their candidate records'
URLs plus ``/metrics``. Each call reads the store once (a timeout bounds it: 503 when
the store does not answer) and the answer holds at most ``MAX_TARGETS`` targets.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import msgspec

from turnout.errors import DiscoveryError
from turnout.frontend.access.principal import Principal
from turnout.frontend.http.admin import Handler
from turnout.frontend.http.errors import SERVER_ERROR
from turnout.frontend.openai.chunk_writer import JSON_HEADERS
from turnout.protocols.frontend import FRONTENDS_ROOT, FrontendRecord
from turnout.protocols.model import INSTANCES_ROOT, Instance
from turnout.protocols.planner import PLANNER_ROOT, Candidate
from turnout.runtime.discovery.base import DiscoveryStore
from turnout.runtime.http import Exchange, Scope
from turnout.runtime.http.wire import error_body

log = logging.getLogger(__name__)

#: The route's path.
SCRAPE_TARGETS = "/metrics/targets"
#: Most targets one answer lists (a larger fleet is cut, with a warning in the log).
MAX_TARGETS = 10_000
#: Longest wait for the store's answer.
STORE_TIMEOUT_S = 5.0

_json = msgspec.json.Encoder()


def _target(url: str) -> tuple[str, str, str] | None:
    """``(host:port, scheme, path)`` of an ``http(s)://host:port/path`` URL (None: not one)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    return parts.netloc, parts.scheme, parts.path or "/metrics"


def scrape_targets(
    frontends: list[FrontendRecord],
    instances: list[Instance],
    planners: Sequence[tuple[str, Candidate]] = (),
) -> list[Any]:
    """The service discovery body for these records (``planners``: (namespace, candidate)):
    one entry per metrics endpoint, in a stable order (frontends, then the others, each
    sorted by target), at most ``MAX_TARGETS``."""
    found: dict[tuple[str, str, str], dict[str, str]] = {}
    for record in frontends:
        if record.http_address:
            url = record.http_address.rstrip("/") + "/metrics"
            if (target := _target(url)) is not None:
                found.setdefault(target, {"turnout_role": "frontend"})
    for instance in instances:
        if instance.metrics_url and (target := _target(instance.metrics_url)) is not None:
            found.setdefault(
                target,
                {
                    "turnout_role": "worker",
                    "turnout_namespace": instance.endpoint.namespace,
                    "turnout_component": instance.endpoint.component,
                },
            )
    for namespace, candidate in planners:
        if candidate.url and (target := _target(candidate.url.rstrip("/") + "/metrics")):
            found.setdefault(target, {"turnout_role": "planner", "turnout_namespace": namespace})
    if len(found) > MAX_TARGETS:
        log.warning("%s lists %d of %d targets", SCRAPE_TARGETS, MAX_TARGETS, len(found))
    order = sorted(found.items(), key=lambda item: (item[1]["turnout_role"] != "frontend", item[0]))
    return [
        {"targets": [address], "labels": {"__scheme__": scheme, "__metrics_path__": path, **labels}}
        for (address, scheme, path), labels in order[:MAX_TARGETS]
    ]


async def read_records(
    store: DiscoveryStore,
) -> tuple[list[FrontendRecord], list[Instance], list[tuple[str, Candidate]]]:
    """The frontend, instance and planner records in the store (records that do not decode
    are skipped: a process of another version may write fields this one does not read)."""
    frontends: list[FrontendRecord] = []
    instances: list[Instance] = []
    planners: list[tuple[str, Candidate]] = []
    for kv in await store.get_prefix(f"{FRONTENDS_ROOT}/"):
        try:
            frontends.append(msgspec.json.decode(kv.value, type=FrontendRecord))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    for kv in await store.get_prefix(f"{INSTANCES_ROOT}/"):
        try:
            instances.append(msgspec.json.decode(kv.value, type=Instance))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    for kv in await store.get_prefix(f"{PLANNER_ROOT}/"):
        namespace = kv.key[len(PLANNER_ROOT) + 1 :].split("/", 1)[0]
        try:
            planners.append((namespace, msgspec.json.decode(kv.value, type=Candidate)))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    return frontends, instances, planners


class ScrapeTargetRoutes:
    """The route's handler over ``store``; ``routes`` maps (method, path) to it."""

    def __init__(self, store: DiscoveryStore) -> None:
        self._store = store

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {("GET", SCRAPE_TARGETS): self._targets}

    async def _targets(self, scope: Scope, proto: Exchange, _: Principal) -> None:
        try:
            records = await asyncio.wait_for(read_records(self._store), STORE_TIMEOUT_S)
        except (TimeoutError, OSError, DiscoveryError) as exc:
            log.warning("%s: the store did not answer: %r", SCRAPE_TARGETS, exc)
            body = error_body(
                "the discovery store did not answer", "store_unavailable", SERVER_ERROR
            )
            proto.response_bytes(503, JSON_HEADERS, body)
            return
        proto.response_bytes(200, JSON_HEADERS, _json.encode(scrape_targets(*records)))
