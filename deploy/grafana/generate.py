"""Writes turnout's Grafana dashboards (the JSON files beside this script) from one place.

Each dashboard is a list of rows of panels, each panel one or more PromQL queries over the
metrics turnout exports; ``tests/deploy/test_observability_assets.py`` checks that the files
are this script's output and that every metric they name exists. Import a file in Grafana
(Dashboards > New > Import) and pick the Prometheus data source that scrapes turnout
(``deploy/prometheus``).

    python deploy/grafana/generate.py          # rewrite the files
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
#: Percentiles of a histogram, over its buckets summed by model.
QUANTILE = 'histogram_quantile({q}, sum by (model, le) (rate({name}_bucket{{model=~"$model"}}[$__rate_interval])))'


def _quantiles(name: str) -> list[tuple[str, str]]:
    return [
        (f"p{int(q * 100)} {{{{model}}}}", QUANTILE.format(q=q, name=name))
        for q in (0.5, 0.9, 0.99)
    ]


def panel(
    title: str,
    queries: list[tuple[str, str]],
    unit: str = "short",
    *,
    kind: str = "timeseries",
    description: str = "",
) -> dict[str, Any]:
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "expr": expr,
                "legendFormat": legend,
                "datasource": DATASOURCE,
            }
            for i, (legend, expr) in enumerate(queries)
        ],
    }


def dashboard(
    uid: str, title: str, description: str, rows: list[list[dict[str, Any]]]
) -> dict[str, Any]:
    panels = []
    y = 0
    for row in rows:
        width = 24 // len(row)
        for i, p in enumerate(row):
            panels.append(
                {
                    **p,
                    "id": len(panels) + 1,
                    "gridPos": {"h": 8, "w": width, "x": i * width, "y": y},
                }
            )
        y += 8
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["turnout"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Data source",
                },
                {
                    "name": "model",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "query": "label_values(turnout_model_instances, model)",
                    "includeAll": True,
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "panels": panels,
    }


M = '{model=~"$model"}'

FLEET = dashboard(
    "turnout-fleet",
    "turnout: fleet",
    "Models, instances, traffic and latency as the frontends see them; workers' own load.",
    [
        [
            panel(
                "Live instances per model",
                [("{{model}}", f"max by (model) (turnout_model_instances{M})")],
            ),
            panel(
                "Requests per second",
                [
                    (
                        "{{model}} {{status}}",
                        f"sum by (model, status) (rate(turnout_requests_total{M}[$__rate_interval]))",
                    )
                ],
                "reqps",
            ),
            panel("In flight", [("{{model}}", f"sum by (model) (turnout_inflight_requests{M})")]),
        ],
        [
            panel("Time to first token", _quantiles("turnout_time_to_first_token_seconds"), "s"),
            panel("Inter-token latency", _quantiles("turnout_inter_token_latency_seconds"), "s"),
            panel("Request duration", _quantiles("turnout_request_duration_seconds"), "s"),
        ],
        [
            panel(
                "Worker KV usage",
                [("{{instance}} {{worker}}", "turnout_worker_kv_usage")],
                "percentunit",
            ),
            panel(
                "Worker requests running / waiting",
                [
                    ("running {{worker}}", "turnout_worker_requests_running"),
                    ("waiting {{worker}}", "turnout_worker_requests_waiting"),
                ],
            ),
            panel(
                "Migrations per second",
                [
                    (
                        "{{model}}",
                        f"sum by (model) (rate(turnout_migrations_total{M}[$__rate_interval]))",
                    )
                ],
                "ops",
            ),
        ],
        [
            panel(
                "Discovery store: seconds since last answer",
                [("{{job}} {{instance}}", "turnout_store_last_contact_seconds")],
                "s",
            ),
            panel(
                "Processes by version",
                [
                    (
                        "{{component}} {{version}}",
                        "count by (component, version) (turnout_build_info)",
                    )
                ],
            ),
            panel(
                "Frontend CPU",
                [
                    (
                        "{{instance}}",
                        'rate(process_cpu_seconds_total{job="turnout-frontends"}[$__rate_interval])',
                    )
                ],
                "percentunit",
            ),
        ],
    ],
)

ROUTING = dashboard(
    "turnout-routing",
    "turnout: routing quality",
    "What the KV router predicted against what happened: cache hits, time to first token, and the health of its event feed.",
    [
        [
            panel(
                "KV hit rate: predicted and reported",
                [
                    ("predicted {{model}}", f"turnout_kv_predicted_hit_rate{M}"),
                    ("reported {{model}}", f"turnout_kv_reported_hit_rate{M}"),
                ],
                "percentunit",
            ),
            panel(
                "Hit-rate gap (predicted - reported)",
                [("{{model}}", f"turnout_kv_hit_rate_gap{M}")],
                "percentunit",
            ),
        ],
        [
            panel(
                "Mean TTFT per worker: realised - predicted",
                [
                    (
                        "{{model}} {{worker}}",
                        f"(rate(turnout_kv_ttft_realised_seconds_total{M}[$__rate_interval]) - rate(turnout_kv_ttft_predicted_seconds_total{M}[$__rate_interval])) / rate(turnout_kv_ttft_predictions_total{M}[$__rate_interval])",
                    )
                ],
                "s",
            ),
            panel(
                "Mean absolute TTFT prediction error",
                [("{{model}} {{worker}}", f"turnout_kv_ttft_abs_error_seconds{M}")],
                "s",
            ),
        ],
        [
            panel(
                "KV events applied per second",
                [
                    (
                        "{{model}}",
                        f"sum by (model) (rate(turnout_kv_events_applied_total{M}[$__rate_interval]))",
                    )
                ],
                "ops",
            ),
            panel(
                "Event gaps, resyncs, silent workers",
                [
                    (
                        "gaps {{model}}",
                        f"sum by (model) (increase(turnout_kv_event_gaps_total{M}[$__rate_interval]))",
                    ),
                    (
                        "resyncs {{model}} {{result}}",
                        f"sum by (model, result) (increase(turnout_kv_resyncs_total{M}[$__rate_interval]))",
                    ),
                    (
                        "silent {{model}}",
                        f"sum by (model) (increase(turnout_kv_silent_workers_total{M}[$__rate_interval]))",
                    ),
                ],
            ),
            panel(
                "Routing decision time (p99)",
                [
                    (
                        "{{model}}",
                        f"histogram_quantile(0.99, sum by (model, le) (rate(turnout_kv_router_decision_seconds_bucket{M}[$__rate_interval])))",
                    )
                ],
                "s",
            ),
        ],
    ],
)

ADMISSION = dashboard(
    "turnout-admission",
    "turnout: admission",
    "Requests admitted, queued and refused by the frontends.",
    [
        [
            panel("In flight", [("{{instance}} {{model}}", f"turnout_inflight_requests{M}")]),
            panel("Queued for a slot", [("{{instance}}", "turnout_queued_requests")]),
            panel("Queue wait (p50/p90/p99)", _quantiles("turnout_queue_wait_seconds"), "s"),
        ],
        [
            panel(
                "Rejections per second by reason",
                [
                    (
                        "{{model}} {{reason}}",
                        f"sum by (model, reason) (rate(turnout_rejections_total{M}[$__rate_interval]))",
                    )
                ],
                "reqps",
            ),
            panel(
                "Rejected share of requests",
                [
                    (
                        "{{model}}",
                        f"sum by (model) (rate(turnout_rejections_total{M}[$__rate_interval])) / sum by (model) (rate(turnout_requests_total{M}[$__rate_interval]))",
                    )
                ],
                "percentunit",
            ),
            panel("Open client connections", [("{{instance}}", "turnout_http_connections")]),
        ],
    ],
)

DISAGG = dashboard(
    "turnout-disaggregation",
    "turnout: disaggregated serving",
    "Prefill and decode stages: requests per stage, their time, KV moved, requests kept local and prefills re-run.",
    [
        [
            panel(
                "Requests per stage",
                [
                    (
                        "{{model}} {{stage}}",
                        f"sum by (model, stage) (rate(turnout_disagg_requests_total{M}[$__rate_interval]))",
                    )
                ],
                "reqps",
            ),
            panel(
                "Stage time (p90)",
                [
                    (
                        "{{model}} {{stage}}",
                        f"histogram_quantile(0.9, sum by (model, stage, le) (rate(turnout_disagg_stage_seconds_bucket{M}[$__rate_interval])))",
                    )
                ],
                "s",
            ),
        ],
        [
            panel(
                "KV bytes moved per second",
                [
                    (
                        "{{model}}",
                        f"sum by (model) (rate(turnout_disagg_transfer_bytes_total{M}[$__rate_interval]))",
                    )
                ],
                "Bps",
            ),
            panel(
                "Served without a prefill stage, by reason",
                [
                    (
                        "{{model}} {{reason}}",
                        f"sum by (model, reason) (rate(turnout_disagg_local_total{M}[$__rate_interval]))",
                    )
                ],
                "reqps",
            ),
            panel(
                "Prefills re-run, by reason",
                [
                    (
                        "{{model}} {{reason}}",
                        f"sum by (model, reason) (rate(turnout_disagg_retries_total{M}[$__rate_interval]))",
                    )
                ],
                "ops",
            ),
        ],
    ],
)

DASHBOARDS = {"fleet": FLEET, "routing": ROUTING, "admission": ADMISSION, "disaggregation": DISAGG}


def render(board: dict[str, Any]) -> str:
    return json.dumps(board, indent=2) + "\n"


def main() -> int:
    for name, board in DASHBOARDS.items():
        (HERE / f"turnout-{name}.json").write_text(render(board))
    return 0


if __name__ == "__main__":
    sys.exit(main())
