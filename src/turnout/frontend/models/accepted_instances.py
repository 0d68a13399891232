"""A model's endpoint client as its pipelines see it: only instances of an accepted card."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from turnout.protocols.model import Instance
    from turnout.runtime.component import EndpointClient

__all__ = ["AcceptedInstances"]


class AcceptedInstances:
    """A model's endpoint client, as its pipelines see it: ``instance_ids()`` and
    ``instances()`` keep only the instances whose card the watcher ``accepted``.

    Everything else (streaming to an instance, side-handler calls, membership through
    ``announced_ids``, listeners, ``close``) is the client's own. It compares and hashes as
    the client it wraps.
    """

    __slots__ = ("accepted", "client", "listener")

    def __init__(self, client: EndpointClient) -> None:
        self.client = client
        #: Instance ids with an accepted card of the model; set by the watcher.
        self.accepted: set[int] = set()
        #: The watcher's callback on the client's instance changes (removed at close).
        self.listener: Callable[[], None] = _nothing

    def instance_ids(self) -> list[int]:
        accepted = self.accepted
        return [i for i in self.client.instance_ids() if i in accepted]

    def instances(self) -> list[Instance]:
        accepted = self.accepted
        return [inst for inst in self.client.instances() if inst.instance_id in accepted]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, AcceptedInstances):
            other = other.client
        return self.client is other

    def __hash__(self) -> int:
        return hash(self.client)


def _nothing() -> None:
    pass
