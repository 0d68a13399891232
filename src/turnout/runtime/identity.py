"""This process's ``ProcessIdentity``: what its records say about who wrote them."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

import msgspec

import turnout
from turnout.protocols.model import ProcessIdentity
from turnout.runtime.addresses import is_wildcard

if TYPE_CHECKING:
    from turnout.runtime.component import DistributedRuntime


def process_identity(runtime: DistributedRuntime) -> ProcessIdentity:
    """Host (the advertised one, else the bound one, else this machine's hostname for a
    wildcard bind), pid, version and the planes of ``runtime``: the same on every plane set,
    NATS included, whose addresses are subjects and name no host."""
    host = runtime.advertise_host or runtime.host
    return ProcessIdentity(
        host=socket.gethostname() if is_wildcard(host) else host,
        pid=os.getpid(),
        version=turnout.__version__,
        request_plane=runtime.request_plane,
        event_plane=runtime.event_plane.kind,
    )


def identity_fields(runtime: DistributedRuntime) -> dict[str, Any]:
    """``process_identity`` as keyword arguments, for records that extend ``ProcessIdentity``."""
    return msgspec.structs.asdict(process_identity(runtime))
