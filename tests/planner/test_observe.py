"""What the planner reads from the frontends: the Prometheus text a real ``FrontendMetrics``
renders (recorded into the way the frontend's request path records), the interval between
two readings, and ``FrontendScraper`` against HTTP servers on real sockets (one that answers,
one that never does, one that wants a key)."""

from __future__ import annotations

import asyncio
import logging
from bisect import bisect_left
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import msgspec
import pytest
from aiohttp import web
from prometheus_client import generate_latest

from turnout.frontend.metrics.frontend import LATENCY_BUCKETS, FrontendMetrics
from turnout.planner.observe import FrontendScraper, Totals, interval, parse_totals
from turnout.protocols.frontend import FrontendRecord, frontend_key
from turnout.runtime.discovery.memory import MemoryStore
from turnout.runtime.histograms import quantile

MODEL = "m1"


class Frontend:
    """A frontend's metrics, recorded as its request path records them (``http/app.py``:
    in flight around the request, the request counted when answered, rejections by reason;
    ``chat_run.py``: prompt and output lengths, ``StreamTimer``: TTFT then ITL)."""

    def __init__(self) -> None:
        self.metrics = FrontendMetrics()
        self.waiting = 0
        self.metrics.watch_admission(lambda: float(self.waiting))

    def serve(
        self,
        n: int,
        *,
        model: str = MODEL,
        ttft: float = 0.05,
        itls: Sequence[float] = (0.01,),
        prompt: int = 100,
        output: int = 10,
    ) -> None:
        """``n`` requests that arrived and finished."""
        m = self.metrics.model(model)
        for _ in range(n):
            m.inflight.inc()
            m.input_tokens.observe(prompt)
            m.ttft.observe(ttft)
            for gap in itls:
                m.itl.observe(gap)
            m.output_tokens.observe(output)
            m.inflight.dec()
            self.metrics.count_request(model, "chat_completions", True, 200)

    def start(self, n: int, *, model: str = MODEL) -> None:
        """``n`` requests that arrived and are still running."""
        for _ in range(n):
            self.metrics.model(model).inflight.inc()

    def finish(self, n: int, *, model: str = MODEL) -> None:
        """``n`` of the running requests answer (an error: no tokens recorded)."""
        for _ in range(n):
            self.metrics.model(model).inflight.dec()
            self.metrics.count_request(model, "chat_completions", True, 500)

    def reject(self, n: int, *, model: str = MODEL, reason: str = "queue_full") -> None:
        for _ in range(n):
            self.metrics.rejections.labels(model, reason).inc()
            self.metrics.count_request(model, "chat_completions", True, 429)

    def text(self) -> str:
        return generate_latest(self.metrics.registry).decode()

    def read(self, model: str | None = None) -> Totals:
        return parse_totals(self.text(), model)


def bucket_counts(values: Sequence[float]) -> list[float]:
    """Observations per latency bucket (the last past every bound), as Prometheus' ``le``."""
    counts = [0.0] * (len(LATENCY_BUCKETS) + 1)
    for value in values:
        counts[bisect_left(LATENCY_BUCKETS, value)] += 1
    return counts


# -- parse_totals -------------------------------------------------------------------------


def test_parse_totals_reads_the_frontend_s_counters() -> None:
    fe = Frontend()
    fe.serve(3, prompt=100, output=10)
    fe.serve(1, prompt=300, output=30)
    fe.reject(2)
    fe.start(4)
    fe.waiting = 6
    totals = fe.read()
    assert totals.requests == 6  # 4 answered, 2 refused: every answer counts
    assert totals.rejections == 2
    assert totals.inflight == 4
    assert totals.queued == 6
    assert totals.histograms["input"].count == 4 and totals.histograms["input"].total == 600
    assert totals.histograms["output"].mean() == 15.0
    assert totals.histograms["ttft"].count == 4
    ttft = totals.histograms["ttft"]
    assert sorted(ttft.buckets)[:3] == [0.001, 0.0025, 0.005]
    assert ttft.buckets[0.05] == 4 and ttft.buckets[0.025] == 0 and ttft.buckets[float("inf")] == 4
    # Metrics the planner does not use are left alone (process, duration, queue wait).
    assert set(totals.histograms) == {"ttft", "itl", "input", "output"}


def test_parse_totals_keeps_one_model_s_series() -> None:
    fe = Frontend()
    fe.serve(3, model="m1", prompt=100)
    fe.serve(5, model="m2", prompt=1000)
    fe.reject(1, model="m2")
    fe.waiting = 2  # the admission queue names no model: it counts for each
    m1 = fe.read("m1")
    assert (m1.requests, m1.rejections, m1.queued) == (3, 0, 2)
    assert m1.histograms["input"].mean() == 100.0
    m2 = fe.read("m2")
    assert (m2.requests, m2.rejections) == (6, 1)
    assert m2.histograms["input"].mean() == 1000.0
    every = fe.read()
    assert (every.requests, every.rejections) == (9, 1)
    assert every.histograms["input"].count == 8
    assert fe.read("m3").requests == 0


# -- interval -----------------------------------------------------------------------------


def test_interval_rate_lengths_and_rejections_between_two_readings() -> None:
    fe = Frontend()
    fe.serve(20, prompt=4000, output=400)  # before the interval: not in it
    fe.reject(5)
    fe.start(2)
    earlier = fe.read()
    fe.serve(10, prompt=100, output=10)
    fe.serve(10, prompt=300, output=50)
    fe.reject(3)
    fe.start(4)  # 6 in flight now: 4 of them arrived in the interval
    fe.waiting = 7
    observed = interval([(earlier, fe.read())], 10.0, 90)
    # Arrivals: 23 answered (20 served, 3 refused) plus 4 more in flight, over 10 s.
    assert observed.load.request_rate == pytest.approx(2.7)
    assert observed.load.prompt_tokens == 200.0  # (10 x 100 + 10 x 300) / 20
    assert observed.load.output_tokens == 30.0
    assert (observed.rejected, observed.queued, observed.samples) == (3, 7, 20)


def test_requests_that_end_in_the_interval_arrived_in_an_earlier_one() -> None:
    fe = Frontend()
    fe.start(5)
    earlier = fe.read()
    fe.finish(5)  # 5 answered, none in flight: nothing arrived
    observed = interval([(earlier, fe.read())], 5.0, 90)
    assert observed.load.request_rate == 0.0
    assert observed.ttft_s is None and observed.itl_s is None and observed.samples == 0


def test_interval_latency_percentiles_are_those_of_the_interval_s_buckets() -> None:
    fe = Frontend()
    fe.serve(30, ttft=20.0, itls=(0.9,))  # slow ones before: they must not count
    earlier = fe.read()
    ttfts = [0.02] * 5 + [0.3] * 3 + [4.0] * 2
    itls = [0.004, 0.008, 0.03, 0.03, 0.07]
    for ttft in ttfts:
        fe.serve(1, ttft=ttft, itls=itls)
    observed = interval([(earlier, fe.read())], 10.0, 90)
    # The 9th of 10: 5 in (0.01, 0.025], 3 in (0.25, 0.5], so the 1st of 2 in (2.5, 5]:
    # halfway, 3.75 s.
    assert observed.ttft_s == pytest.approx(3.75)
    assert observed.ttft_s == quantile(0.9, LATENCY_BUCKETS, bucket_counts(ttfts))
    assert observed.itl_s == quantile(0.9, LATENCY_BUCKETS, bucket_counts(itls * 10))
    # 45 of 50 gaps: 10 + 10 + 20 below 0.05, so the 5th of 10 in (0.05, 0.1]: 0.075 s.
    assert observed.itl_s == pytest.approx(0.075)
    p50 = interval([(earlier, fe.read())], 10.0, 50)
    assert p50.ttft_s == quantile(0.5, LATENCY_BUCKETS, bucket_counts(ttfts))
    assert p50.ttft_s == pytest.approx(0.025)  # the 5th of 5 in (0.01, 0.025]


def test_interval_sums_the_frontends() -> None:
    a, b = Frontend(), Frontend()
    ea, eb = a.read(), b.read()
    a.serve(6, ttft=0.02, prompt=100)
    b.serve(4, ttft=0.3, prompt=600)
    b.reject(2)
    a.waiting, b.waiting = 1, 2
    observed = interval([(ea, a.read()), (eb, b.read())], 2.0, 90)
    assert observed.load.request_rate == 6.0  # (6 + 4 + 2) / 2 s
    assert observed.load.prompt_tokens == 300.0  # (600 + 2400) / 10
    assert (observed.rejected, observed.queued, observed.samples) == (2, 3, 10)
    ttfts = [0.02] * 6 + [0.3] * 4
    assert observed.ttft_s == quantile(0.9, LATENCY_BUCKETS, bucket_counts(ttfts))


def test_a_restarted_frontend_counts_from_zero() -> None:
    before = Frontend()
    before.serve(50, ttft=10.0)
    before.reject(9)
    earlier = before.read()
    after = Frontend()  # the same frontend, restarted: its counters start over
    after.serve(4, ttft=0.02, prompt=100, output=10)
    after.reject(1)
    observed = interval([(earlier, after.read())], 10.0, 90)
    assert observed.load.request_rate == pytest.approx(0.5)  # 5 since the restart, not -45
    assert observed.rejected == 1
    assert observed.load.prompt_tokens == 100.0
    assert observed.ttft_s == quantile(0.9, LATENCY_BUCKETS, bucket_counts([0.02] * 4))
    assert observed.samples == 4


def test_a_first_reading_has_no_interval_yet() -> None:
    seen, new = Frontend(), Frontend()
    earlier = seen.read()
    seen.serve(4)
    new.serve(100)
    new.reject(10)
    observed = interval([(None, new.read()), (earlier, seen.read())], 4.0, 90)
    assert observed.load.request_rate == 1.0
    assert (observed.rejected, observed.samples) == (0, 4)
    nothing = interval([(None, new.read())], 4.0, 90)
    assert nothing.load.request_rate == 0.0 and nothing.ttft_s is None


def test_interval_of_one_model() -> None:
    fe = Frontend()
    earlier_m1, earlier_m2 = fe.read("m1"), fe.read("m2")
    fe.serve(3, model="m1", ttft=0.02)
    fe.serve(7, model="m2", ttft=4.0)
    m1 = interval([(earlier_m1, fe.read("m1"))], 1.0, 90)
    assert m1.load.request_rate == 3.0
    assert m1.ttft_s == quantile(0.9, LATENCY_BUCKETS, bucket_counts([0.02] * 3))
    m2 = interval([(earlier_m2, fe.read("m2"))], 1.0, 90)
    assert m2.load.request_rate == 7.0


# -- FrontendScraper ----------------------------------------------------------------------


async def start_server(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


class Servers:
    """HTTP servers on real sockets, stopped at the end of the test."""

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []
        self.release = asyncio.Event()
        #: While set, the ``metrics_of`` servers answer 503.
        self.unavailable = False

    async def metrics_of(self, fe: Frontend, *, key: str | None = None) -> str:
        """A server of ``fe``'s ``/metrics``, rendered at each request (``key``: the bearer
        token it wants)."""

        async def handler(request: web.Request) -> web.StreamResponse:
            if key is not None and request.headers.get("authorization") != f"Bearer {key}":
                return web.json_response({"error": "unauthorized"}, status=401)
            if self.unavailable:
                return web.json_response({"error": "unavailable"}, status=503)
            return web.Response(body=fe.text().encode(), content_type="text/plain")

        runner, url = await start_server(handler)
        self.runners.append(runner)
        return url

    async def silent(self) -> str:
        """A server that takes the request and never answers (until the test ends)."""

        async def handler(request: web.Request) -> web.StreamResponse:
            await self.release.wait()
            return web.Response(text="")

        runner, url = await start_server(handler)
        self.runners.append(runner)
        return url

    async def close(self) -> None:
        self.release.set()
        for runner in self.runners:
            await runner.cleanup()


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    s = Servers()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    s = MemoryStore()
    try:
        yield s
    finally:
        await s.close()


async def test_scraper_reads_intervals_from_a_frontend_url(
    servers: Servers, store: MemoryStore
) -> None:
    fe = Frontend()
    fe.serve(5)
    url = await servers.metrics_of(fe)
    scraper = FrontendScraper(store, urls=[url + "/"], model=MODEL, timeout=5.0)
    try:
        assert await scraper.frontends() == [url]
        first, covered = await asyncio.wait_for(scraper.observe(10.0, 90), 30.0)
        assert covered == 0 and first.load.request_rate == 0.0  # no interval yet
        fe.serve(20, ttft=0.3, prompt=500, output=50)
        fe.reject(4)
        observed, covered = await asyncio.wait_for(scraper.observe(10.0, 90), 30.0)
        assert covered == 1
        assert observed.load.request_rate == pytest.approx(2.4)
        assert (observed.load.prompt_tokens, observed.load.output_tokens) == (500.0, 50.0)
        assert observed.rejected == 4 and observed.samples == 20
        assert observed.ttft_s == quantile(0.9, LATENCY_BUCKETS, bucket_counts([0.3] * 20))
        fe.serve(1, model="other")  # another model's requests are not this planner's
        observed, covered = await asyncio.wait_for(scraper.observe(10.0, 90), 30.0)
        assert covered == 1 and observed.load.request_rate == 0.0
    finally:
        await scraper.close()


async def test_a_frontend_that_does_not_answer_is_left_out_within_the_timeout(
    servers: Servers, store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    fe = Frontend()
    good = await servers.metrics_of(fe)
    silent = await servers.silent()
    scraper = FrontendScraper(store, urls=[good, silent], timeout=0.5)
    caplog.set_level(logging.WARNING, logger="turnout.planner")
    try:
        await asyncio.wait_for(scraper.observe(10.0, 90), 30.0)
        fe.serve(30)
        # Bounded by the scraper's timeout (the outer 30 s is only the test's guard).
        observed, covered = await asyncio.wait_for(scraper.observe(10.0, 90), 30.0)
        assert covered == 1  # the good one; the silent one left out
        assert observed.load.request_rate == 3.0
        warnings = [r.getMessage() for r in caplog.records if silent in r.getMessage()]
        assert len(warnings) == 1 and "cannot read" in warnings[0]
        # Logged once while it stays silent, not every interval.
        await asyncio.wait_for(scraper.observe(10.0, 90), 30.0)
        assert len([r for r in caplog.records if silent in r.getMessage()]) == 1
    finally:
        await scraper.close()


async def test_a_frontend_wanting_a_key_answers_401_without_it(
    servers: Servers, store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    fe = Frontend()
    url = await servers.metrics_of(fe, key="sekrit")
    caplog.set_level(logging.WARNING, logger="turnout.planner")
    keyless = FrontendScraper(store, urls=[url], timeout=5.0)
    keyed = FrontendScraper(store, urls=[url], api_key="sekrit", timeout=5.0)
    try:
        await asyncio.wait_for(keyless.observe(10.0, 90), 30.0)
        await asyncio.wait_for(keyed.observe(10.0, 90), 30.0)
        fe.serve(10)
        observed, covered = await asyncio.wait_for(keyless.observe(10.0, 90), 30.0)
        assert covered == 0 and observed.load.request_rate == 0.0
        assert any("HTTP 401" in r.getMessage() and url in r.getMessage() for r in caplog.records)
        observed, covered = await asyncio.wait_for(keyed.observe(10.0, 90), 30.0)
        assert covered == 1 and observed.load.request_rate == 1.0
    finally:
        await keyless.close()
        await keyed.close()


async def test_a_frontend_back_after_failing_is_compared_with_its_last_reading(
    servers: Servers, store: MemoryStore
) -> None:
    """While it does not answer its last reading is kept: when it answers again, the interval
    covers everything since, not only what came after."""
    fe = Frontend()
    url = await servers.metrics_of(fe)
    scraper = FrontendScraper(store, urls=[url], timeout=5.0)
    try:
        await asyncio.wait_for(scraper.observe(10.0, 90), 30.0)
        fe.serve(8)
        servers.unavailable = True  # one interval it answers 503
        _, covered = await asyncio.wait_for(scraper.observe(10.0, 90), 30.0)
        assert covered == 0
        servers.unavailable = False
        fe.serve(4)
        observed, covered = await asyncio.wait_for(scraper.observe(10.0, 90), 30.0)
        assert covered == 1 and observed.load.request_rate == 1.2  # 12 since the last reading
    finally:
        await scraper.close()


async def test_without_urls_the_frontends_come_from_the_store(
    servers: Servers, store: MemoryStore
) -> None:
    a, b = Frontend(), Frontend()
    url_a, url_b = await servers.metrics_of(a), await servers.metrics_of(b)
    await store.put(
        frontend_key(1),
        msgspec.json.encode(FrontendRecord(frontend_id=1, http_address=url_a + "/")),
    )
    await store.put(
        frontend_key(2), msgspec.json.encode(FrontendRecord(frontend_id=2, http_address=url_b))
    )
    await store.put(frontend_key(3), msgspec.json.encode(FrontendRecord(frontend_id=3)))  # no HTTP
    await store.put(frontend_key(4), b"not a record")
    scraper = FrontendScraper(store, urls=[], timeout=5.0)
    try:
        assert sorted(await scraper.frontends()) == sorted([url_a, url_b])
        await asyncio.wait_for(scraper.observe(1.0, 90), 30.0)
        a.serve(2)
        b.serve(3)
        observed, covered = await asyncio.wait_for(scraper.observe(1.0, 90), 30.0)
        assert covered == 2 and observed.load.request_rate == 5.0
    finally:
        await scraper.close()
