"""This process's ``ProcessIdentity``: what its records say about who wrote them."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

import msgspec

import turnout
from turnout.protocols.model import ProcessIdentity
from turnout.runtime.addresses import is_loopback, is_wildcard

if TYPE_CHECKING:
    from turnout.runtime.component import DistributedRuntime

#: This process's metrics endpoint (see ``advertise_metrics``); one per process, as the
#: system endpoint is.
_metrics_url = ""


def advertise_metrics(url: str) -> None:
    """Name ``url`` as this process's metrics endpoint in the records it writes from here on
    (``ProcessIdentity.metrics_url``), so Prometheus finds it through discovery."""
    global _metrics_url
    _metrics_url = url


def process_identity(runtime: DistributedRuntime) -> ProcessIdentity:
    """Host, pid, version and the planes of ``runtime``: the same on every plane set, NATS
    included, whose addresses are subjects and name no host.

    The host is the advertised one, else the bound one; this machine's hostname instead of a
    wildcard bind, and instead of a loopback one where the request plane is not tcp (on NATS
    nothing dials that address, and ``127.0.0.1`` would not tell an operator which machine)."""
    host = runtime.advertise_host or runtime.host
    anonymous = is_wildcard(host) or (runtime.request_plane != "tcp" and is_loopback(host))
    return ProcessIdentity(
        host=socket.gethostname() if anonymous else host,
        pid=os.getpid(),
        version=turnout.__version__,
        request_plane=runtime.request_plane,
        event_plane=runtime.event_plane.kind,
        metrics_url=_metrics_url,
    )


def identity_fields(runtime: DistributedRuntime) -> dict[str, Any]:
    """``process_identity`` as keyword arguments, for records that extend ``ProcessIdentity``."""
    return msgspec.structs.asdict(process_identity(runtime))
