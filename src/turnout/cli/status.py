"""``turnout status``: who is running where, what the frontends hold back, and how loaded
the workers are.

Reads the frontends, instances, model cards and planners from whichever store ``--store``
names, then listens to the workers' load reports on the event plane for ``--load-wait``
seconds (reports come at a steady rate, about once a second), and prints the frontends
(host, pid, version, planes, HTTP address, router mode, and the instances each holds back,
with the reason), the planners standing in each namespace's election and which leads,
namespaces, models with their types, and instances with their address, host, pid, version,
planes, load and KV usage; an instance a frontend refuses for its planes says so.
``--json`` prints the same for scripts. A malformed record is reported under ``skipped``,
never fatal: status is what an operator runs when something is already wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
from typing import Any

import msgspec

from turnout.protocols.frontend import FRONTENDS_ROOT, FrontendRecord, HoldReason
from turnout.protocols.kv import LOAD_TOPIC, LoadReport
from turnout.protocols.model import (
    INSTANCES_ROOT,
    MDC_ROOT,
    Instance,
    ModelDeploymentCard,
)
from turnout.protocols.planner import PLANNER_ROOT, Candidate
from turnout.runtime.event_plane import EventPlane, decode_msg
from turnout.runtime.planes import PlanesConfig, open_runtime

from .flags import add_flag, add_runtime_flags, planes_config
from .lifecycle import run_command

log = logging.getLogger("turnout.cli")


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="show namespaces, models and instances in the store")
    add_flag(p, "--json", action="store_true", help="print JSON for scripts")
    add_flag(p, "--load-wait", default=2.0, type=float,
             help="seconds to listen for load reports (0: skip load)")  # fmt: skip
    add_runtime_flags(p, tracing=False)
    p.set_defaults(run=run)


async def gather_status(planes: PlanesConfig, load_wait: float) -> dict[str, Any]:
    """The status document: ``{"store", "frontends", "namespaces": {ns: {"models",
    "instances"}}, "skipped"}`` (see the module docstring)."""
    runtime = await open_runtime(planes)
    try:
        store = runtime.store
        skipped: list[dict[str, str]] = []
        instances: dict[int, Instance] = {}
        for kv in await store.get_prefix(f"{INSTANCES_ROOT}/"):
            try:
                instance = msgspec.json.decode(kv.value, type=Instance)
            except msgspec.DecodeError as exc:
                skipped.append({"key": kv.key, "reason": str(exc)})
                continue
            instances[instance.instance_id] = instance
        frontends: list[FrontendRecord] = []
        for kv in await store.get_prefix(f"{FRONTENDS_ROOT}/"):
            try:
                frontends.append(msgspec.json.decode(kv.value, type=FrontendRecord))
            except msgspec.DecodeError as exc:
                skipped.append({"key": kv.key, "reason": str(exc)})
        planners = await _planners(store, skipped)
        cards: list[tuple[str, ModelDeploymentCard]] = []
        for kv in await store.get_prefix(f"{MDC_ROOT}/"):
            try:
                cards.append((kv.key, msgspec.json.decode(kv.value, type=ModelDeploymentCard)))
            except msgspec.DecodeError as exc:
                skipped.append({"key": kv.key, "reason": str(exc)})
        loads: dict[int, LoadReport] = {}
        if load_wait > 0 and instances:
            components = {(i.endpoint.namespace, i.endpoint.component) for i in instances.values()}
            loads = await _listen_for_load(runtime.event_plane, components, load_wait)
    finally:
        await runtime.shutdown()
    doc = _document(planes.store, frontends, instances, cards, loads, skipped)
    doc["planners"] = planners
    return doc


async def _planners(store: Any, skipped: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The planners standing in each namespace's election; the first written leads."""
    by_namespace: dict[str, list[Any]] = {}
    for kv in await store.get_prefix(f"{PLANNER_ROOT}/"):
        namespace = kv.key[len(PLANNER_ROOT) + 1 :].split("/", 1)[0]
        by_namespace.setdefault(namespace, []).append(kv)
    rows: list[dict[str, Any]] = []
    for namespace, kvs in sorted(by_namespace.items()):
        for rank, kv in enumerate(sorted(kvs, key=lambda kv: (kv.revision, kv.key))):
            try:
                candidate = msgspec.json.decode(kv.value, type=Candidate)
            except msgspec.DecodeError as exc:
                skipped.append({"key": kv.key, "reason": str(exc)})
                continue
            rows.append({"namespace": namespace, "host": candidate.host, "pid": candidate.pid,
                         "url": candidate.url, "leader": rank == 0})  # fmt: skip
    return rows


async def _listen_for_load(
    plane: EventPlane, components: set[tuple[str, str]], seconds: float
) -> dict[int, LoadReport]:
    """The newest load report of each worker heard within ``seconds`` (rank 0 of each)."""
    loads: dict[int, LoadReport] = {}
    subs = [await plane.subscribe(ns, comp, LOAD_TOPIC) for ns, comp in components]

    async def consume(sub: Any) -> None:
        async for event in sub:
            with contextlib.suppress(msgspec.DecodeError):
                report = decode_msg(event.payload, LoadReport)
                if report.dp_rank == 0:
                    loads[report.worker_id] = report

    tasks = [asyncio.create_task(consume(sub)) for sub in subs]
    await asyncio.wait(tasks, timeout=seconds)
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)
    for sub in subs:
        await sub.close()
    return loads


def _identity(record: Instance | FrontendRecord) -> dict[str, Any]:
    """The ``ProcessIdentity`` fields of a row (None for what an older process did not say)."""
    return {
        "host": record.host or None,
        "pid": record.pid or None,
        "version": record.version or None,
        "request_plane": record.request_plane or None,
        "event_plane": record.event_plane or None,
    }


def _frontend_row(record: FrontendRecord) -> dict[str, Any]:
    return {
        "id": f"{record.frontend_id:x}",
        **_identity(record),
        "http_address": record.http_address,
        "router_mode": record.router_mode,
        "namespace": record.namespace,
        "held_back": [msgspec.to_builtins(h) for h in record.held_back],
        "held_back_total": record.held_back_total,
    }


def _document(
    store: str,
    frontends: list[FrontendRecord],
    instances: dict[int, Instance],
    cards: list[tuple[str, ModelDeploymentCard]],
    loads: dict[int, LoadReport],
    skipped: list[dict[str, str]],
) -> dict[str, Any]:
    namespaces: dict[str, dict[str, Any]] = {}
    # Instance id (hex) -> what the frontends say of it: held back, refused.
    held: dict[str, list[dict[str, str]]] = {}
    for frontend in frontends:
        for entry in frontend.held_back:
            held.setdefault(entry.instance_id, []).append(
                {"frontend": f"{frontend.frontend_id:x}", "reason": entry.reason.value,
                 "detail": entry.detail}
            )  # fmt: skip

    def space(name: str) -> dict[str, Any]:
        return namespaces.setdefault(name, {"models": {}, "instances": []})

    for _, card in cards:
        model = space(card.endpoint.namespace)["models"].setdefault(
            card.display_name,
            {
                "types": card.model_type.names(),
                "input": card.model_input.value,
                "context_length": card.context_length,
                "instances": [],
            },
        )
        model["instances"].append(f"{card.instance_id:x}")
    for iid, instance in sorted(instances.items()):
        row: dict[str, Any] = {
            "id": f"{iid:x}",
            "endpoint": instance.endpoint.path(),
            "transport": instance.transport.kind,
            "address": instance.transport.address,
            **_identity(instance),
        }
        holds = held.get(f"{iid:x}", [])
        if holds:
            row["held_back"] = holds
        row["refused"] = any(h["reason"] == HoldReason.PLANES_DIFFER.value for h in holds)
        report = loads.get(iid)
        if report is not None:
            row["load"] = {
                "running": report.num_running,
                "waiting": report.num_waiting,
                "kv_usage": round(report.kv_usage, 4),
                "active_prefill_tokens": report.active_prefill_tokens,
            }
        space(instance.endpoint.namespace)["instances"].append(row)
    return {
        "store": store,
        "frontends": [_frontend_row(f) for f in sorted(frontends, key=lambda f: f.frontend_id)],
        "namespaces": namespaces,
        "skipped": skipped,
    }


def _who(row: dict[str, Any]) -> str:
    """``host 10.0.0.5 pid 4242 v0.1.0 planes tcp/zmq``, with ``?`` for what is unknown."""
    return (
        f"host {row['host'] or '?'} pid {row['pid'] or '?'} v{row['version'] or '?'} "
        f"planes {row['request_plane'] or '?'}/{row['event_plane'] or '?'}"
    )


def render(doc: dict[str, Any]) -> str:
    """The status document as text for a terminal."""
    lines = [f"store: {doc['store']}"]
    for fe in doc["frontends"]:
        lines.append(
            f"frontend {fe['id']}  {fe['http_address']}  {_who(fe)}  router {fe['router_mode']}"
        )
        for h in fe["held_back"]:
            lines.append(
                f"  holds back instance {h['instance_id']} of model {h['model']} "
                f"(card {h['checksum']}): {h['reason']}: {h['detail']}"
            )
        if fe["held_back_total"] > len(fe["held_back"]):
            lines.append(f"  ... and {fe['held_back_total'] - len(fe['held_back'])} more")
    for pl in doc.get("planners", []):
        role = "leading" if pl["leader"] else "standing by"
        lines.append(
            f"planner {pl['namespace']}  {pl['url'] or '-'}  host {pl['host']} pid {pl['pid']}  "
            f"{role}"
        )
    if not doc["namespaces"] and not doc["frontends"]:
        lines.append("nothing registered")
    for ns, space in sorted(doc["namespaces"].items()):
        lines.append(f"namespace {ns}")
        for name, model in sorted(space["models"].items()):
            lines.append(
                f"  model {name}  [{model['types']}, {model['input']} input, "
                f"context {model['context_length']}]  instances: {', '.join(model['instances'])}"
            )
        for row in space["instances"]:
            load = row.get("load")
            text = (
                f"running {load['running']} waiting {load['waiting']} kv {load['kv_usage']:.1%}"
                if load
                else "no load report"
            )
            refused = "  REFUSED (planes differ)" if row["refused"] else ""
            lines.append(
                f"  instance {row['id']}  {row['endpoint']}  {row['transport']}://"
                f"{row['address']}  {_who(row)}  {text}{refused}"
            )
    for item in doc["skipped"]:
        lines.append(f"skipped {item['key']}: {item['reason']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    async def main() -> None:
        doc = await gather_status(planes_config(args), args.load_wait)
        sys.stdout.write((json.dumps(doc, indent=2) if args.json else render(doc)) + "\n")

    return run_command(args, main)
