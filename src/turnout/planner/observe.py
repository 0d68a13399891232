"""What the frontends saw in the last interval: read from their ``/metrics``.

Each frontend's Prometheus text is parsed into cumulative ``Totals`` (one model's series, or
all), and an interval is the difference of two readings of the same frontend, summed over
frontends (``interval``). A frontend whose counters went back (it restarted) counts from
zero. Latency percentiles come from the difference of the histogram buckets, as Prometheus'
``histogram_quantile`` computes them.

Frontends are the ``--frontend-url`` ones, else every frontend record in the discovery store.
A frontend that does not answer within the timeout is left out of the interval and logged.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from turnout.planner.decide import Observed
from turnout.planner.predict import Load
from turnout.protocols.frontend import FRONTENDS_ROOT, FrontendRecord
from turnout.runtime.discovery.base import DiscoveryStore
from turnout.runtime.histograms import quantile

log = logging.getLogger("turnout.planner")

#: Seconds one frontend's ``/metrics`` may take.
SCRAPE_TIMEOUT_S = 5.0
#: Frontends read at most (records beyond it are logged and left out).
MAX_FRONTENDS = 256
#: Largest ``/metrics`` body read from one frontend.
MAX_METRICS_BYTES = 8 * 1024 * 1024

_HISTOGRAMS = {
    "turnout_time_to_first_token_seconds": "ttft",
    "turnout_inter_token_latency_seconds": "itl",
    "turnout_input_sequence_tokens": "input",
    "turnout_output_sequence_tokens": "output",
}


@dataclass(slots=True)
class Histogram:
    """Cumulative bucket counts by upper bound (``inf`` last), with sum and count."""

    buckets: dict[float, float] = field(default_factory=dict)
    total: float = 0.0
    count: float = 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        return Histogram(
            {le: n - earlier.buckets.get(le, 0.0) for le, n in self.buckets.items()},
            self.total - earlier.total,
            self.count - earlier.count,
        )

    def plus(self, other: Histogram) -> Histogram:
        keys = set(self.buckets) | set(other.buckets)
        return Histogram(
            {le: self.buckets.get(le, 0.0) + other.buckets.get(le, 0.0) for le in keys},
            self.total + other.total,
            self.count + other.count,
        )

    def quantile(self, q: float) -> float | None:
        bounds = sorted(le for le in self.buckets if math.isfinite(le))
        cumulative = [self.buckets[le] for le in bounds] + [self.buckets.get(math.inf, 0.0)]
        earlier = [0.0, *cumulative[:-1]]
        per_bucket = [max(b - a, 0.0) for a, b in zip(earlier, cumulative, strict=True)]
        return quantile(q, bounds, per_bucket) if bounds else None

    def mean(self) -> float:
        return self.total / self.count if self.count > 0 else 0.0


@dataclass(slots=True)
class Totals:
    """One frontend's cumulative counters at one reading (gauges as read)."""

    requests: float = 0.0
    rejections: float = 0.0
    inflight: float = 0.0
    queued: float = 0.0
    histograms: dict[str, Histogram] = field(default_factory=dict)

    def went_back(self, earlier: Totals) -> bool:
        """A counter is lower than before: the frontend restarted."""
        return self.requests < earlier.requests or self.rejections < earlier.rejections


def parse_totals(text: str, model: str | None = None) -> Totals:
    """The counters ``observe`` needs from a frontend's ``/metrics`` text (``model``: that
    model's series only)."""
    totals = Totals()
    for family in text_string_to_metric_families(text):
        kind = _HISTOGRAMS.get(family.name)
        for sample in family.samples:
            if model is not None and sample.labels.get("model", model) != model:
                continue
            name = sample.name
            if kind is not None:
                histogram = totals.histograms.setdefault(kind, Histogram())
                if name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    histogram.buckets[le] = histogram.buckets.get(le, 0.0) + sample.value
                elif name.endswith("_sum"):
                    histogram.total += sample.value
                elif name.endswith("_count"):
                    histogram.count += sample.value
            elif name == "turnout_requests_total":
                totals.requests += sample.value
            elif name == "turnout_rejections_total":
                totals.rejections += sample.value
            elif name == "turnout_inflight_requests":
                totals.inflight += sample.value
            elif name == "turnout_queued_requests":
                totals.queued += sample.value
    return totals


def interval(
    pairs: Iterable[tuple[Totals | None, Totals]], seconds: float, percentile: float
) -> Observed:
    """The load and latency of one interval from (earlier, now) readings of each frontend.
    A frontend read for the first time (earlier None) has no interval yet: it is left out;
    one whose counters went back (it restarted) counts from zero."""
    arrivals = rejected = queued = 0.0
    merged: dict[str, Histogram] = {}
    for earlier, now in pairs:
        if earlier is None:
            continue
        if now.went_back(earlier):
            earlier = Totals()
        # Requests that arrived: those that ended, plus the growth of those in flight.
        arrivals += (now.requests - earlier.requests) + (now.inflight - earlier.inflight)
        rejected += now.rejections - earlier.rejections
        queued += now.queued
        for kind, histogram in now.histograms.items():
            delta = histogram.minus(earlier.histograms.get(kind, Histogram()))
            merged[kind] = merged[kind].plus(delta) if kind in merged else delta
    empty = Histogram()
    load = Load(
        request_rate=max(arrivals, 0.0) / seconds if seconds > 0 else 0.0,
        prompt_tokens=merged.get("input", empty).mean(),
        output_tokens=merged.get("output", empty).mean(),
    )
    q = percentile / 100
    return Observed(
        load=load,
        ttft_s=merged.get("ttft", empty).quantile(q),
        itl_s=merged.get("itl", empty).quantile(q),
        queued=int(queued),
        rejected=int(max(rejected, 0.0)),
        samples=int(max(merged.get("ttft", empty).count, 0.0)),
    )


class FrontendScraper:
    """Reads every frontend's ``/metrics`` once per interval and keeps the last reading of
    each (bounded: frontends that left are dropped)."""

    def __init__(
        self,
        store: DiscoveryStore,
        *,
        urls: list[str],
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = SCRAPE_TIMEOUT_S,
    ) -> None:
        self._store = store
        self._urls = [u.rstrip("/") for u in urls]
        self._model = model
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._last: dict[str, Totals] = {}
        self._session: aiohttp.ClientSession | None = None
        self._failing: set[str] = set()

    async def frontends(self) -> list[str]:
        """The base URLs to read: the configured ones, else the frontends in the store."""
        if self._urls:
            return self._urls
        records = await asyncio.wait_for(
            self._store.get_prefix(FRONTENDS_ROOT + "/"), self._timeout
        )
        urls: list[str] = []
        for kv in records:
            try:
                record = msgspec.json.decode(kv.value, type=FrontendRecord)
            except msgspec.DecodeError as exc:
                log.warning("skipping the malformed frontend record %s: %s", kv.key, exc)
                continue
            if record.http_address:
                urls.append(record.http_address.rstrip("/"))
        if len(urls) > MAX_FRONTENDS:
            log.warning("%d frontends in the store; reading the first %d", len(urls), MAX_FRONTENDS)
            urls = sorted(urls)[:MAX_FRONTENDS]
        return urls

    async def _read(self, url: str) -> Totals | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self._timeout)
            )
        try:
            async with self._session.get(f"{url}/metrics", headers=self._headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}")
                body = await resp.content.read(MAX_METRICS_BYTES + 1)
                if len(body) > MAX_METRICS_BYTES:
                    raise RuntimeError(f"metrics over {MAX_METRICS_BYTES} bytes")
            totals = parse_totals(body.decode("utf-8", "replace"), self._model)
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
            if url not in self._failing:
                self._failing.add(url)
                log.warning("cannot read %s/metrics (left out until it answers): %s", url, exc)
            return None
        if url in self._failing:
            self._failing.discard(url)
            log.info("reading %s/metrics again", url)
        return totals

    async def observe(self, seconds: float, percentile: float) -> tuple[Observed, int]:
        """The interval since the last call, and how many frontends it covers (those that
        answered now and at the last call)."""
        try:
            urls = await self.frontends()
        except Exception as exc:  # the store is down or slow: reuse what we knew
            log.warning("cannot list frontends in the store: %s", exc)
            urls = list(self._last)
        readings = await asyncio.gather(*(self._read(u) for u in urls))
        pairs: list[tuple[Totals | None, Totals]] = []
        current: dict[str, Totals] = {}
        for url, totals in zip(urls, readings, strict=True):
            if totals is None:
                if url in self._last:
                    current[url] = self._last[url]  # compare with it when it answers again
                continue
            pairs.append((self._last.get(url), totals))
            current[url] = totals
        self._last = current
        covered = sum(1 for earlier, _ in pairs if earlier is not None)
        return interval(pairs, seconds, percentile), covered

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
