"""``turnout status``: what the discovery store says is running, and how loaded it is.

Reads the instances and model cards from whichever store ``--store`` names, then listens to
the workers' load reports on the event plane for ``--load-wait`` seconds (reports come at a
steady rate, about once a second), and prints namespaces, models with their types, and
instances with their address, load and KV usage. ``--json`` prints the same for scripts.
A malformed record is reported under ``skipped``, never fatal: status is what an operator
runs when something is already wrong.
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

from turnout.protocols.kv import LOAD_TOPIC, LoadReport
from turnout.protocols.model import (
    INSTANCES_ROOT,
    MDC_ROOT,
    Instance,
    ModelDeploymentCard,
)
from turnout.runtime.event_plane import EventPlane, decode_msg
from turnout.runtime.planes import open_runtime

from .flags import add_flag, add_runtime_flags, planes_config
from .lifecycle import run_command

log = logging.getLogger("turnout.cli")


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="show namespaces, models and instances in the store")
    add_flag(p, "--json", action="store_true", help="print JSON for scripts")
    add_flag(p, "--load-wait", default=2.0, type=float,
             help="seconds to listen for load reports (0: skip load)")  # fmt: skip
    add_runtime_flags(p)
    p.set_defaults(run=run)


async def gather_status(args: argparse.Namespace) -> dict[str, Any]:
    """The status document: ``{"store", "namespaces": {ns: {"models", "instances"}},
    "skipped"}`` (see the module docstring)."""
    planes = planes_config(args)
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
        cards: list[tuple[str, ModelDeploymentCard]] = []
        for kv in await store.get_prefix(f"{MDC_ROOT}/"):
            try:
                cards.append((kv.key, msgspec.json.decode(kv.value, type=ModelDeploymentCard)))
            except msgspec.DecodeError as exc:
                skipped.append({"key": kv.key, "reason": str(exc)})
        loads: dict[int, LoadReport] = {}
        if args.load_wait > 0 and instances:
            components = {(i.endpoint.namespace, i.endpoint.component) for i in instances.values()}
            loads = await _listen_for_load(runtime.event_plane, components, args.load_wait)
    finally:
        await runtime.shutdown()
    return _document(planes.store, instances, cards, loads, skipped)


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


def _document(
    store: str,
    instances: dict[int, Instance],
    cards: list[tuple[str, ModelDeploymentCard]],
    loads: dict[int, LoadReport],
    skipped: list[dict[str, str]],
) -> dict[str, Any]:
    namespaces: dict[str, dict[str, Any]] = {}

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
        }
        report = loads.get(iid)
        if report is not None:
            row["load"] = {
                "running": report.num_running,
                "waiting": report.num_waiting,
                "kv_usage": round(report.kv_usage, 4),
                "active_prefill_tokens": report.active_prefill_tokens,
            }
        space(instance.endpoint.namespace)["instances"].append(row)
    return {"store": store, "namespaces": namespaces, "skipped": skipped}


def render(doc: dict[str, Any]) -> str:
    """The status document as text for a terminal."""
    lines = [f"store: {doc['store']}"]
    if not doc["namespaces"]:
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
            lines.append(
                f"  instance {row['id']}  {row['endpoint']}  {row['transport']}://"
                f"{row['address']}  {text}"
            )
    for item in doc["skipped"]:
        lines.append(f"skipped {item['key']}: {item['reason']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    async def main() -> None:
        doc = await gather_status(args)
        sys.stdout.write((json.dumps(doc, indent=2) if args.json else render(doc)) + "\n")

    return run_command(args, main)
