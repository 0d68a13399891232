"""The dashboard in a real browser: Debian's headless Chromium, driven through its
chromedriver by Selenium, against a running ``turnout serve --engine mocker`` under load. The
page shows the instances and a TTFT chart with data, logs no console error, refreshes itself,
and has its tables with JavaScript off. A screenshot is kept with the test's files."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from tests.integration.procs import health, running_serve, wait_until

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="Debian's chromium and chromium-driver are not installed (scripts/setup.sh does it)",
)


def browser(tmp: Path, *, javascript: bool = True):  # type: ignore[no-untyped-def]
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # type: ignore[assignment]
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1000", f"--user-data-dir={tmp}"):  # fmt: skip
        options.add_argument(flag)
    if not javascript:
        options.add_experimental_option(
            "prefs", {"profile.managed_default_content_settings.javascript": 2}
        )
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium Manager never tries to download one.
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[str]:
    with running_serve(tmp_path, "--engine", "mocker", "--router-mode", "kv") as url:
        yield url


def load(url: str, stop: threading.Event) -> None:
    """Streamed chats until ``stop`` (or a minute), a few at a time."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=30)
    model = client.models.list().data[0].id
    deadline = time.monotonic() + 60
    n = 0
    while not stop.is_set() and time.monotonic() < deadline:
        n += 1
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"a shared question, variant {n % 3}"}],
            max_tokens=16,
            stream=True,
        )
        for _ in stream:
            pass


def test_the_dashboard_shows_the_fleet_under_load_in_chromium(serve: str, tmp_path: Path) -> None:
    stop = threading.Event()
    loaders = [threading.Thread(target=load, args=(serve, stop)) for _ in range(3)]
    for t in loaders:
        t.start()
    driver = browser(tmp_path / "profile")
    try:
        instances = set(health(serve).values().__iter__().__next__())
        # The first latency point comes after one sampling interval (5 s).
        wait_until(
            lambda: any(
                p["ttft_s"][0] is not None
                for p in httpx.get(serve + "/dashboard/state.json", timeout=5).json()["series"]
            ),
            30,
            "a TTFT point",
        )
        driver.get(serve + "/dashboard")
        text = driver.find_element("tag name", "main").text
        assert all(i in text for i in instances), text
        ttft = driver.find_element("xpath", "//figure[figcaption='Time to first token']")
        assert ttft.find_elements("tag name", "polyline") or ttft.find_elements(
            "tag name", "circle"
        )
        # The live part is fetched again by the page's script: the note says so.
        wait_until(lambda: driver.find_element("id", "note").text == "live", 15, "a live refresh")
        shot = tmp_path / "dashboard.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        artifacts = os.environ.get("TURNOUT_TEST_ARTIFACTS")
        if artifacts:
            Path(artifacts).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(artifacts) / "dashboard.png")
        print(f"dashboard screenshot: {shot}")
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        stop.set()
        driver.quit()
        for t in loaders:
            t.join(timeout=60)


def test_the_dashboard_tables_are_there_with_javascript_off(serve: str, tmp_path: Path) -> None:
    instances = set(next(iter(health(serve).values())))
    driver = browser(tmp_path / "profile", javascript=False)
    try:
        driver.get(serve + "/dashboard")
        rows = driver.find_elements("xpath", "//section[starts-with(h2,'Model ')]//tbody/tr")
        assert {r.find_element("tag name", "td").text for r in rows} == instances
        assert driver.find_element("id", "note").text != "live"  # no script ran
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        driver.quit()
