"""A real Prometheus (Debian's) scraping a running ``turnout serve`` and a worker with a
system port: it finds both through the frontend's ``GET /metrics/targets`` as
``deploy/prometheus/prometheus.yml`` says, loads the alert rules of
``deploy/prometheus/turnout-rules.yml``, and the rule for a KV router that gets no KV events
fires when ``serve`` runs echo workers (which publish none) under ``--router-mode kv``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tests.integration.procs import health, running_serve, wait_until

from turnout.frontend.service import free_port

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="Debian's prometheus is not installed (scripts/setup.sh does it)"
)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[str]:
    with running_serve(tmp_path, "--engine", "echo", "--router-mode", "kv") as url:
        yield url


@pytest.fixture
def system_worker(serve: str, tmp_path: Path) -> Iterator[int]:
    """One more echo worker, in serve's store and planes, with a system port (serve's own
    workers run without one); its system port."""
    port = free_port()
    with open(tmp_path / "worker.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "turnout", "worker", "--engine", "echo",
             "--store", "file", "--store-path", str(tmp_path / "store.sqlite"),
             "--request-plane", "tcp", "--event-plane", "zmq", "--system-port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def prometheus_config(tmp: Path, frontend: str) -> Path:
    """deploy/prometheus's config, every 1 s, with the frontend's discovery route as its
    service discovery and the rules' ``for:`` at 0 s (the shipped durations are minutes: the
    rule's condition is what is under test, not the wait)."""
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    for job in config["scrape_configs"]:
        job.pop("authorization", None)  # this serve has no API keys
        for sd in job["http_sd_configs"]:
            sd.pop("authorization", None)
            sd["url"] = f"http://{frontend}/metrics/targets"
            sd["refresh_interval"] = "1s"
    rules = yaml.safe_load((ROOT / "deploy/prometheus/turnout-rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
    (tmp / "turnout-rules.yml").write_text(yaml.safe_dump(rules))
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_prometheus_scrapes_serve_and_the_kv_events_rule_fires(
    serve: str, system_worker: int, tmp_path: Path
) -> None:
    assert PROMETHEUS is not None
    frontend = serve.removeprefix("http://")
    config = prometheus_config(tmp_path, frontend)
    web = f"127.0.0.1:{free_port()}"
    api = f"http://{web}/api/v1"
    with open(tmp_path / "prometheus.log", "wb") as log:
        prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--web.listen-address={web}",
             f"--storage.tsdb.path={tmp_path / 'data'}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def logs() -> str:
        return (tmp_path / "prometheus.log").read_text()[-3000:]

    def get(path: str, **params: str) -> Any:
        """The API's ``data`` (an HTTP error raises, which ``wait_until`` polls past: a
        Prometheus still starting answers 503 in plain text)."""
        answer = httpx.get(f"{api}/{path}", params=params, timeout=5)
        answer.raise_for_status()
        body = answer.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(expr: str) -> Any:
        return get("query", query=expr)["result"]

    def up() -> dict[str, set[str]]:
        """Each job's targets (host:port) that Prometheus scraped successfully."""
        found: dict[str, set[str]] = {}
        for t in get("targets")["activeTargets"]:
            if t["health"] == "up":
                found.setdefault(t["labels"]["job"], set()).add(t["labels"]["instance"])
        return found

    try:
        wait_until(
            lambda: (
                up()
                == {
                    "turnout-frontends": {frontend},
                    "turnout-workers": {f"127.0.0.1:{system_worker}"},
                }
            ),
            60,
            "the frontend and the worker found through /metrics/targets, and up",
            logs,
        )
        groups = get("rules")["groups"]
        assert sum(len(g["rules"]) for g in groups) == 8  # every rule loaded
        model = next(iter(health(serve)))
        for _ in range(5):  # routed by the KV router, which hears no KV event
            answer = httpx.post(
                serve + "/v1/completions",
                json={"model": model, "prompt": "count the blocks", "max_tokens": 2},
                timeout=30,
            )
            assert answer.status_code == 200, answer.text
        wait_until(lambda: bool(query("turnout_model_instances")), 30, "scraped samples", logs)

        def firing() -> set[str]:
            alerts = get("alerts")["alerts"]
            return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}

        wait_until(lambda: "TurnoutKvEventsMissing" in firing(), 60, "the rule firing", logs)
        assert "TurnoutModelWithoutInstance" not in firing()
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=20)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
