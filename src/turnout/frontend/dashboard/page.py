"""The dashboard page: HTML rendered on the server from a fleet snapshot, charts as inline SVG.

The whole page is complete without JavaScript (tables, charts, a meta refresh inside
``<noscript>``); with it, a few lines of inline script fetch the live part again every few
seconds and swap it in place. Nothing is loaded from anywhere else. Every string that comes
from the store or from clients (model names, request ids) is escaped.
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from typing import Any

#: Seconds between two refreshes of the live part.
REFRESH_S = 3
CHART_W, CHART_H = 360, 120

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
header{background:#1d2330;color:#fff;padding:10px 18px;display:flex;gap:18px;align-items:baseline}
header h1{font-size:18px;margin:0}header span{opacity:.8}
main{padding:12px 18px}
section{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:10px 14px;
margin:0 0 12px}h2{font-size:15px;margin:0 0 8px}h3{font-size:14px;margin:10px 0 6px}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th,td{text-align:left;padding:3px 8px;border-bottom:1px solid #eef0f3;white-space:nowrap}
th{font-weight:600;color:#556}.charts{display:flex;flex-wrap:wrap;gap:14px}
figure{margin:0}figcaption{font-weight:600;margin-bottom:2px}
svg{background:#fbfcfd;border:1px solid #eef0f3}
.legend span{margin-right:10px}.muted{color:#889}.bad{color:#b3261e;font-weight:600}
.cands{white-space:normal;font-size:12px}
"""

SCRIPT = f"""
(function(){{
  var live=document.getElementById('live'),note=document.getElementById('note');
  function refresh(){{
    fetch('/dashboard?fragment=1',{{cache:'no-store',credentials:'same-origin'}})
      .then(function(r){{return r.ok?r.text():Promise.reject(r.status)}})
      .then(function(t){{live.innerHTML=t;note.textContent='live'}},
            function(e){{note.textContent='refresh failed ('+e+'); retrying'}});
  }}
  setInterval(refresh,{REFRESH_S * 1000});
}})();
"""

_COLORS = ("#1f77b4", "#ff7f0e", "#d62728")


def render_page(snapshot: dict[str, Any]) -> str:
    """The whole page."""
    when = time.strftime("%H:%M:%S", time.localtime(snapshot["time"]))
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width,initial-scale=1">'
        "<title>turnout dashboard</title>"
        '<link rel=icon href="data:,">'
        f'<noscript><meta http-equiv=refresh content="{REFRESH_S * 2}"></noscript>'
        f"<style>{_STYLE}</style></head><body>"
        f"<header><h1>turnout</h1><span>version {_e(snapshot['version'])}</span>"
        f"<span>router: {_e(snapshot['router_mode'] or '?')}</span>"
        f"<span>page at {when}</span><span id=note>"
        "<noscript>refreshes every few seconds</noscript></span></header>"
        f"<main id=live>{render_live(snapshot)}</main>"
        f"<script>{SCRIPT}</script></body></html>"
    )


def render_live(snapshot: dict[str, Any]) -> str:
    """The part the page refreshes: charts, admission, models, decisions."""
    return (
        _charts(snapshot["series"], snapshot["quantiles"])
        + _admission(snapshot["admission"])
        + "".join(_model(m) for m in snapshot["models"])
        + ("" if snapshot["models"] else _NO_MODEL)
    )


_NO_MODEL = "<section><h2>Models</h2><p>No model is served.</p></section>"
_NOT_KV = (
    "<p class=muted>Routing decisions are explained under the KV router (--router-mode kv).</p>"
)

# ---------------------------------------------------------------------------- charts


def _charts(series: list[dict[str, Any]], quantiles: Sequence[float]) -> str:
    names = [f"p{round(q * 100)}" for q in quantiles]
    times = [p["time"] for p in series]
    rate = _chart("Requests per second", times, [("req/s", [p["requests_per_s"] for p in series])])
    ttft = _chart(
        "Time to first token",
        times,
        [(n, [p["ttft_s"][i] for p in series]) for i, n in enumerate(names)],
        "s",
    )
    itl = _chart(
        "Inter-token latency",
        times,
        [(n, [p["itl_s"][i] for p in series]) for i, n in enumerate(names)],
        "s",
    )
    span = f"last {len(series)} points" if series else "no point yet: one comes every few seconds"
    return (
        f"<section><h2>Traffic and latency <span class=muted>({span})</span></h2>"
        f"<div class=charts>{rate}{ttft}{itl}</div></section>"
    )


def _chart(
    title: str, times: list[float], lines: list[tuple[str, list[float | None]]], unit: str = ""
) -> str:
    """A small line chart, one polyline per named series (gaps where a value is None)."""
    values = [v for _, vs in lines for v in vs if v is not None]
    top = max(values) if values else 0.0
    scale = top * 1.1 or 1.0
    n = len(times)
    pad_l, pad_b = 44, 16
    w, h = CHART_W - pad_l - 6, CHART_H - pad_b - 6
    parts = [
        f'<svg width={CHART_W} height={CHART_H} role=img aria-label="{_e(title)}">',
        f'<line x1={pad_l} y1={6 + h} x2={pad_l + w} y2={6 + h} stroke="#ccd"/>',
        f'<text x=2 y=14 font-size=11 fill="#556">{_fmt(scale, unit)}</text>',
        f'<text x=2 y={6 + h} font-size=11 fill="#556">0</text>',
    ]
    if n:
        start = time.strftime("%H:%M:%S", time.localtime(times[0]))
        end = time.strftime("%H:%M:%S", time.localtime(times[-1]))
        parts.append(f'<text x={pad_l} y={CHART_H - 2} font-size=11 fill="#556">{start}</text>')
        parts.append(
            f'<text x={pad_l + w} y={CHART_H - 2} font-size=11 fill="#556" '
            f"text-anchor=end>{end}</text>"
        )
    for (_, vs), color in zip(lines, _COLORS, strict=False):
        runs: list[list[str]] = [[]]
        for i, v in enumerate(vs):
            if v is None:
                runs.append([])
                continue
            x = pad_l + (w * i / (n - 1) if n > 1 else w)
            y = 6 + h - h * v / scale
            runs[-1].append(f"{x:.1f},{y:.1f}")
        for run in runs:
            if len(run) == 1:
                cx, cy = run[0].split(",")
                parts.append(f'<circle cx={cx} cy={cy} r=2 fill="{color}"/>')
            elif run:
                parts.append(
                    f'<polyline fill=none stroke="{color}" stroke-width=1.5 '
                    f'points="{" ".join(run)}"/>'
                )
    parts.append("</svg>")
    legend = "".join(
        f'<span style="color:{c}">&#9632; {_e(name)}</span>'
        for (name, _), c in zip(lines, _COLORS, strict=False)
    )
    return (
        f"<figure><figcaption>{_e(title)}</figcaption>{''.join(parts)}"
        f"<div class=legend>{legend}</div></figure>"
    )


# ---------------------------------------------------------------------------- tables


def _admission(admission: dict[str, Any]) -> str:
    rows = []
    if "in_flight" in admission:
        limit = admission.get("max_inflight")
        rows.append(("in flight", f"{admission['in_flight']}" + (f" / {limit}" if limit else "")))
        rows.append(("queued", f"{admission['queued']} / {admission.get('queue_size', '?')}"))
    rejected = admission.get("rejected") or {}
    if rejected:
        for reason, count in sorted(rejected.items()):
            rows.append((f"rejected: {reason}", f"{count:g}"))
    else:
        rows.append(("rejected", "none"))
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    return f"<section><h2>Admission</h2><table>{body}</table></section>"


_INSTANCE_COLUMNS = (
    ("instance", "id", None),
    ("role", "role", None),
    ("in flight", "in_flight", None),
    ("running", "running", None),
    ("waiting", "waiting", None),
    ("KV usage", "kv_usage", "pct"),
    ("TTFT predicted / realised", ("ttft_predicted_s", "ttft_realised_s"), "s"),
    ("cache hits predicted / reported", ("predicted_hit_rate", "reported_hit_rate"), "pct"),
    ("hit-rate gap", "hit_rate_gap", "pct"),
)


def _cells(row: dict[str, Any], key: str | tuple[str, str], kind: str | None) -> str:
    if isinstance(key, tuple):
        first, second = (row.get(k) for k in key)
        if first is None and second is None:
            return _cell(None, kind)
        return f"{_cell(first, kind)} / {_cell(second, kind)}"
    return _cell(row.get(key), kind)


def _model(model: dict[str, Any]) -> str:
    head = "".join(f"<th>{label}</th>" for label, _, _ in _INSTANCE_COLUMNS)
    rows = []
    for inst in model["instances"]:
        cells = "".join(f"<td>{_cells(inst, key, kind)}</td>" for _, key, kind in _INSTANCE_COLUMNS)
        busy = " class=bad" if inst.get("busy") else ""
        rows.append(f"<tr{busy}>{cells}</tr>")
    if not rows:
        rows.append(f"<tr><td colspan={len(_INSTANCE_COLUMNS)}>no live instance</td></tr>")
    summary = ""
    if model.get("kv_router"):
        summary = (
            "<p>KV router: predicted hit rate "
            f"{_cell(model.get('predicted_hit_rate'), 'pct')}, reported "
            f"{_cell(model.get('reported_hit_rate'), 'pct')}, gap "
            f"{_cell(model.get('hit_rate_gap'), 'pct')}</p>"
        )
    return (
        f"<section><h2>Model {_e(model['name'])}</h2>{summary}"
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
        f"{_decisions(model)}</section>"
    )


def _decisions(model: dict[str, Any]) -> str:
    if not model.get("kv_router"):
        return _NOT_KV
    decisions = model.get("decisions") or []
    if not decisions:
        return "<h3>Recent routing decisions</h3><p class=muted>none yet</p>"
    rows = []
    for d in decisions:
        when = time.strftime("%H:%M:%S", time.localtime(d["time"])) if d.get("time") else ""
        why = _e(d.get("status") or "")
        if d.get("predicted_ttft_s") is not None:
            why += f", predicted TTFT {_fmt(d['predicted_ttft_s'], 's')}"
        candidates = "; ".join(
            f"{_e(c.get('worker_id'))}: overlap {_e(c.get('overlap_blocks'))}, "
            f"active {_e(c.get('active_blocks'))}"
            + (
                f", TTFT {_fmt(c['predicted_ttft_s'], 's')}"
                if c.get("predicted_ttft_s") is not None
                else ""
            )
            + (f", cost {c['cost']:.3g}" if isinstance(c.get("cost"), int | float) else "")
            for c in d.get("candidates", [])
        )
        rows.append(
            f"<tr><td>{when}</td><td>{_e(d.get('request_id') or '')}</td>"
            f"<td>{_e(d.get('prompt_tokens'))}</td><td>{_e(d.get('worker_id') or '-')}</td>"
            f"<td>{_e(d.get('overlap_blocks'))}</td><td>{why}</td>"
            f"<td class=cands>{candidates}</td></tr>"
        )
    return (
        "<h3>Recent routing decisions <span class=muted>(a sample)</span></h3><table><thead><tr>"
        "<th>time</th><th>request</th><th>prompt tokens</th><th>chosen</th>"
        "<th>overlap blocks</th><th>why</th><th>candidates</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _cell(value: Any, kind: str | None) -> str:
    if value is None:
        return "<span class=muted>-</span>"
    if kind == "pct" and isinstance(value, int | float):
        pct = 100 * value
        return f"{0.0 if abs(pct) < 0.05 else pct:.1f}%"  # never "-0.0%"
    if kind == "s" and isinstance(value, int | float):
        return _fmt(value, "s")
    return _e(value)


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"
    return f"{value:.3g}"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)
