"""The Grafana dashboards and the Prometheus rules and scrape configs under deploy/, checked
against what turnout really exports: every metric name in every PromQL expression must be on
the ``/metrics`` of a running frontend (KV router) or worker (``--system-port``). Debian's
promtool checks the rules and the hosts' scrape config; the dashboards are the output of
their generator."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tests.integration.procs import ProcessSet, health, wait_until

from turnout.frontend.service import free_port

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
PROMETHEUS = ROOT / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")

#: PromQL words that are not metric names.
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset", "inf", "nan",
}  # fmt: skip
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w$])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: what remains once strings, label matchers,
    ranges, grouping clauses, functions, keywords and numbers are set aside."""
    expr = _STRINGS.sub('""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = _GROUPING.sub("", expr)
    expr = re.sub(r"\$\w+", "", expr)
    return {n for n in _NAME.findall(expr) if n.lower() not in _KEYWORDS}


def dashboard_exprs() -> dict[str, list[str]]:
    out = {}
    for path in sorted(GRAFANA.glob("*.json")):
        board = json.loads(path.read_text())
        exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
        exprs += [v["query"] for v in board["templating"]["list"] if v.get("type") == "query"]
        out[path.name] = exprs
    return out


def rule_exprs() -> list[str]:
    rules = yaml.safe_load((PROMETHEUS / "turnout-rules.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def _query_metric(query: str) -> str:
    """``label_values(metric, label)``: the metric."""
    match = re.fullmatch(r"label_values\((\w+),\s*\w+\)", query)
    return match.group(1) if match else query


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """Every sample name a KV-routed frontend and a mocker worker expose, with the family
    names (a histogram's ``_bucket``/``_sum``/``_count``, a counter's ``_total``)."""
    procs = ProcessSet(tmp_path_factory.mktemp("exported"))
    system = free_port()
    try:
        procs.worker("--engine", "mocker", "--model-name", "m", "--system-port", str(system))
        procs.frontend("--router-mode", "kv")
        wait_until(lambda: bool(health(procs.url).get("m")), 60, "the worker", procs.logs)
        answer = httpx.post(
            procs.url + "/v1/completions",
            json={"model": "m", "prompt": "hello there", "max_tokens": 2},
            timeout=30,
        )
        assert answer.status_code == 200
        texts = [
            httpx.get(procs.url + "/metrics", timeout=10).text,
            httpx.get(f"http://127.0.0.1:{system}/metrics", timeout=10).text,
        ]
    finally:
        procs.close()
    names: set[str] = {"up"}  # Prometheus' own, per target
    for text in texts:
        for family in text_string_to_metric_families(text):
            names.add(family.name)
            kind = family.type
            if kind == "counter":
                names.add(family.name + "_total")
            elif kind == "histogram":
                names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
            names.update(sample.name for sample in family.samples)
    yield names


def unknown(exprs: list[str], exported: set[str]) -> dict[str, set[str]]:
    out = {}
    for expr in exprs:
        missing = metric_names(_query_metric(expr)) - exported
        if missing:
            out[expr] = missing
    return out


def test_the_name_extraction_finds_names_and_only_names() -> None:
    expr = (
        'sum by (model, le) (rate(turnout_x_bucket{model=~"$model", le!="a b"}[5m])) '
        "/ on (model) group_left turnout_y > 0.5 and up{job='w'} == 0 or vector(1)"
    )
    assert metric_names(expr) == {"turnout_x_bucket", "turnout_y", "up"}


def test_every_dashboard_and_rule_names_only_exported_metrics(exported: set[str]) -> None:
    exprs = [e for es in dashboard_exprs().values() for e in es] + rule_exprs()
    assert len(exprs) > 40
    assert unknown(exprs, exported) == {}
    # A misspelt name is caught: the check can fail.
    assert unknown(["rate(turnout_request_total[5m])"], exported) == {
        "rate(turnout_request_total[5m])": {"turnout_request_total"}
    }


def test_the_dashboards_are_the_generators_output_and_importable() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import generate, json; print(json.dumps({n: generate.render(b) "
         "for n, b in generate.DASHBOARDS.items()}))"],
        cwd=GRAFANA, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    rendered = json.loads(out.stdout)
    assert {f"turnout-{n}.json" for n in rendered} == {p.name for p in GRAFANA.glob("*.json")}
    for name, text in rendered.items():
        path = GRAFANA / f"turnout-{name}.json"
        assert path.read_text() == text, f"{path.name}: run python deploy/grafana/generate.py"
        board = json.loads(text)
        assert board["uid"] and board["schemaVersion"] >= 36 and board["panels"]
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        assert all(t["datasource"]["uid"] == "${datasource}" for p in board["panels"]
                   for t in p["targets"])  # fmt: skip


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian's prometheus) is not installed")
def test_promtool_accepts_the_rules_and_the_hosts_scrape_config(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    rules = subprocess.run([PROMTOOL, "check", "rules", str(PROMETHEUS / "turnout-rules.yml")],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS: 8 rules found" in rules.stdout
    # The config names a credentials file on the Prometheus host: give it one here.
    key = tmp_path / "key"
    key.write_text("sk-turnout-test-prometheus\n")
    config = (PROMETHEUS / "prometheus.yml").read_text()
    (tmp_path / "prometheus.yml").write_text(
        config.replace("/etc/prometheus/secrets/turnout-api-key", str(key))
    )
    shutil.copy(PROMETHEUS / "turnout-rules.yml", tmp_path)
    checked = subprocess.run([PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_kubernetes_scrape_config_keeps_turnout_pods_by_their_port_names() -> None:
    """Debian's promtool has no Kubernetes discovery: the structure is checked here, and the
    port names against the manifests."""
    config = yaml.safe_load((PROMETHEUS / "prometheus-kubernetes.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"turnout-frontends", "turnout-workers", "turnout-planners"}
    ports = {}
    for name, job in jobs.items():
        assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
        keeps = {r["source_labels"][0]: r["regex"] for r in job["relabel_configs"]
                 if r.get("action") == "keep"}  # fmt: skip
        assert keeps["__meta_kubernetes_pod_label_app_kubernetes_io_part_of"] == "turnout"
        ports[name] = keeps["__meta_kubernetes_pod_container_port_name"]
    manifests = (ROOT / "deploy" / "kubernetes" / "frontend.yaml").read_text()
    assert "{name: http, containerPort: 8000}" in manifests and ports["turnout-frontends"] == "http"
    for worker in ("worker.yaml", "attach.yaml"):
        text = (ROOT / "deploy" / "kubernetes" / worker).read_text()
        assert "{name: system, containerPort: 8081}" in text
    assert ports["turnout-workers"] == "system"
    for planner in ("planner.yaml", "autoscaling/planner.yaml"):
        text = (ROOT / "deploy" / "kubernetes" / planner).read_text()
        assert "{name: planner, containerPort: 9400}" in text
    assert ports["turnout-planners"] == "planner"
