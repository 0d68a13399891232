"""What a worker checks once at start: that the frontends run its planes, and that its
advertised addresses reach it.

* **Planes.** A worker on another request or event plane than the frontends would be refused
  by each of them (``frontend.models.watcher``) and serve nobody. When frontends are
  registered (``protocols.frontend``) and none runs this worker's planes, the worker stops
  with one error (``ConfigError``: exit status 2), so the mistake shows at the first start and
  in the supervisor's restart count rather than as a worker that is up and idle. When some
  frontends run its planes and others do not (a migration between plane sets), it serves
  those and warns once, naming the others. With no frontend registered yet there is nothing
  to check against: a frontend that comes later refuses it loudly.
* **Advertised addresses.** The worker dials its own tcp request-plane address and its zmq
  event publishers' addresses, as found in the store (its records carry its host and pid),
  with a short deadline, and warns once, naming ``--advertise-host`` and ``--bind-host``,
  when one does not answer: a wrong advertise host otherwise starts cleanly and serves nobody.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import TYPE_CHECKING

import msgspec

from turnout.errors import ConfigError
from turnout.protocols.frontend import FRONTENDS_ROOT, FrontendRecord
from turnout.protocols.model import INSTANCES_ROOT, Instance
from turnout.runtime.addresses import dial_error, url_host_port
from turnout.runtime.event_plane.zmq_discovery import PUBLISHERS_ROOT, EventPublisherRecord
from turnout.runtime.identity import process_identity

if TYPE_CHECKING:
    from turnout.runtime.component import DistributedRuntime

logger = logging.getLogger("turnout.runtime")

#: Seconds a dial of an advertised address may take (the process dials itself: an answer
#: takes a round trip on the route others use, or none when the address is not this host).
DIAL_TIMEOUT = 2.0
#: What the advertised-address warning calls each address.
REQUEST_PLANE = "tcp request plane"
EVENT_PUBLISHER = "zmq event publisher"
#: Frontends named in a plane message (the rest are counted).
MAX_NAMED = 5


async def check_worker_start(
    runtime: DistributedRuntime, dial_timeout: float = DIAL_TIMEOUT
) -> None:
    """Both checks of the module docstring; ``ConfigError`` when no frontend runs this
    worker's planes."""
    await check_frontend_planes(runtime)
    await check_advertised_addresses(runtime, dial_timeout)


async def check_frontend_planes(runtime: DistributedRuntime) -> None:
    """The planes check (see the module docstring)."""
    me = process_identity(runtime)
    frontends: list[FrontendRecord] = []
    for kv in await runtime.store.get_prefix(f"{FRONTENDS_ROOT}/"):
        try:
            frontends.append(msgspec.json.decode(kv.value, type=FrontendRecord))
        except msgspec.DecodeError as exc:
            logger.debug("skipping malformed frontend record %s: %s", kv.key, exc)
    # Only the frontends that watch this worker's namespaces would refuse it.
    namespaces = {i.endpoint.namespace for i in await _own_instances(runtime)}
    if namespaces:
        frontends = [f for f in frontends if any(map(f.serves_namespace, namespaces))]
    other = [f for f in frontends if f.runs_other_planes(me.request_plane, me.event_plane)]
    if not other:
        return
    named = ", ".join(
        f"{f.frontend_id:x} at {f.where()} runs {f.planes()}" for f in other[:MAX_NAMED]
    )
    if len(other) > MAX_NAMED:
        named += f" and {len(other) - MAX_NAMED} more"
    if len(other) == len(frontends):
        raise ConfigError(
            f"this worker runs request plane {me.request_plane}, event plane {me.event_plane}, "
            f"and no frontend does (frontend {named}): each would refuse it; every process must "
            "use the same planes (--request-plane, --event-plane)"
        )
    logger.warning(
        "this worker runs request plane %s, event plane %s; frontend %s: those refuse it; "
        "every process must use the same planes",
        me.request_plane,
        me.event_plane,
        named,
    )


async def check_advertised_addresses(
    runtime: DistributedRuntime, dial_timeout: float = DIAL_TIMEOUT
) -> list[str]:
    """The advertised-address check (see the module docstring); returns the addresses that
    did not answer (also said in one warning line)."""
    addresses = await _own_addresses(runtime)
    # The request plane with plane TLS is dialled as a peer would: a bare connection would be
    # logged by the server as a refused handshake, and the certificate must name the host.
    tls = runtime.plane_tls.client_context() if runtime.plane_tls is not None else None
    errors = await asyncio.gather(
        *(
            dial_error(host, port, dial_timeout, tls if what == REQUEST_PLANE else None)
            for what, host, port in addresses
        )
    )
    failed = [
        f"{what} {host}:{port} ({error})"
        for (what, host, port), error in zip(addresses, errors, strict=True)
        if error is not None
    ]
    if failed:
        logger.warning(
            "this process cannot reach itself at its advertised address: %s; others will not "
            "either: check --advertise-host (the address others dial) and --bind-host (the "
            "interface it listens on)",
            "; ".join(failed),
        )
    return failed


async def _own_instances(runtime: DistributedRuntime) -> list[Instance]:
    """This process's instance records in the store (its records carry its host and pid)."""
    me = process_identity(runtime)
    own: list[Instance] = []
    for kv in await runtime.store.get_prefix(f"{INSTANCES_ROOT}/"):
        try:
            instance = msgspec.json.decode(kv.value, type=Instance)
        except msgspec.DecodeError:
            continue
        if (instance.pid, instance.host) == (me.pid, me.host):
            own.append(instance)
    return own


async def _own_addresses(runtime: DistributedRuntime) -> list[tuple[str, str, int]]:
    """``(what, host, port)`` of this process's advertised tcp addresses, from its records in
    the store: tcp instances and zmq event publishers."""
    found: set[tuple[str, str, int]] = set()
    store = runtime.store
    for instance in await _own_instances(runtime):
        if instance.transport.kind != "tcp":
            continue
        host, port = url_host_port(instance.transport.address, 0)
        found.add((REQUEST_PLANE, host, port))
    hostname = socket.gethostname()
    for kv in await store.get_prefix(f"{PUBLISHERS_ROOT}/"):
        try:
            record = msgspec.json.decode(kv.value, type=EventPublisherRecord)
        except msgspec.DecodeError:
            continue
        if (record.pid, record.hostname) != (os.getpid(), hostname):
            continue
        host, port = url_host_port(record.address, 0)
        found.add((EVENT_PUBLISHER, host, port))
    return sorted(found)
