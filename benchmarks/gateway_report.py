"""Tables and the plot of ``benchmarks/gateways.py``: one row per gateway, one block per trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HEADER = (
    f"{'gateway':<26} {'face/API':<18} {'ok':>4} {'err':>4} {'cached':>7} {'/orcl':>6} "
    f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'CPU/req':>8} "
    f"{'net':>7} {'spread':>6}"
)


def _row(run: dict[str, Any], oracle: float | None) -> str:
    label = run["gateway"]
    if "skipped" in run:
        return f"{label:<26} skipped: {run['skipped'].splitlines()[0][:110]}"
    s = run["summary"]
    share = run.get("cached_share")
    ratio = share / oracle if share is not None and oracle else None
    face = f"{run.get('engine_face', '?')} {run.get('request_api', '')}"

    def num(value: float | None, fmt: str) -> str:
        if value is None:
            return format("-", fmt[0] + fmt[1:].split(".")[0])
        return format(value, fmt)

    return (
        f"{label:<26} {face:<18} {s['num_ok']:>4} {s['num_errors']:>4} "
        f"{num(share, '>7.1%')} {num(ratio, '>6.2f')} "
        f"{num(s['ttft_sim_ms'].get('p50'), '>9.1f')} {num(s['ttft_sim_ms'].get('p99'), '>9.1f')} "
        f"{num(s['itl_sim_ms'].get('p50'), '>8.2f')} {num(s['itl_sim_ms'].get('p99'), '>8.2f')} "
        f"{run['gateway_cpu_ms_per_request']:>8.2f} "
        f"{run['gateway_cpu_ms_per_request_net_of_idle']:>7.2f} {num(run.get('spread'), '>6.2f')}"
    )


def print_table(entry: dict[str, Any]) -> None:
    """One trace's (or the llama.cpp part's) runs; latencies in simulated ms."""
    oracle = entry.get("oracle_hit_rate")
    title = entry.get("title") or f"{entry['trace']['kind']} trace"
    head = f"\n== {title}"
    if oracle is not None:
        head += f": oracle cached share {oracle:.1%}"
    print(head + "; latencies in simulated ms (wall x speedup)")
    print("gateway CPU in ms per request: gross, and net of its idle polling")
    print(HEADER)
    print("-" * len(HEADER))
    for run in entry["runs"]:
        print(_row(run, oracle))


def _blocks(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    blocks = [
        (f"{t['trace']['kind']} trace, {report['mocker']['num_engines']} mocker-servers", t)
        for t in report.get("mocker", {}).get("traces", [])
    ]
    if report.get("llamacpp", {}).get("runs"):
        blocks.append((report["llamacpp"]["title"], report["llamacpp"]))
    return blocks


def plot(report: dict[str, Any], path: Path) -> None:
    """Per block (row): cached share against the oracle's, TTFT p50/p99, gateway CPU/request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = _blocks(report)
    if not blocks:
        return
    fig, axes = plt.subplots(len(blocks), 3, figsize=(15, 3.6 * len(blocks)), squeeze=False)
    for row, (title, block) in zip(axes, blocks, strict=True):
        runs = [r for r in block["runs"] if "summary" in r]
        labels = [r["gateway"].replace(" (", "\n(") for r in runs]
        xs = range(len(runs))
        share = [100 * (r.get("cached_share") or 0) for r in runs]
        row[0].bar(xs, share, color="tab:blue")
        if block.get("oracle_hit_rate") is not None:
            row[0].axhline(100 * block["oracle_hit_rate"], color="k", ls="--", lw=1, label="oracle")
            row[0].legend(loc="upper right", fontsize=8)
        row[0].set_ylabel("cached share, %")
        p50 = [r["summary"]["ttft_sim_ms"].get("p50", 0) for r in runs]
        p99 = [r["summary"]["ttft_sim_ms"].get("p99", 0) for r in runs]
        width = 0.4
        row[1].bar([x - width / 2 for x in xs], p50, width, label="p50", color="tab:green")
        row[1].bar([x + width / 2 for x in xs], p99, width, label="p99", color="tab:red")
        row[1].set_yscale("log")
        row[1].set_ylabel("TTFT, simulated ms")
        row[1].legend(fontsize=8)
        gross = [r["gateway_cpu_ms_per_request"] for r in runs]
        net = [r["gateway_cpu_ms_per_request_net_of_idle"] for r in runs]
        row[2].bar([x - width / 2 for x in xs], gross, width, label="gross", color="tab:purple")
        row[2].bar([x + width / 2 for x in xs], net, width, label="net of idle", color="tab:gray")
        row[2].set_ylabel("gateway CPU, ms / request")
        row[2].legend(fontsize=8)
        for ax in row:
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
            ax.grid(True, axis="y", alpha=0.3)
        row[0].set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
