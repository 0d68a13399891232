"""A view of an endpoint client that leaves out the instances on other planes.

The standalone router (``router.service``) routes over it, so that, like a frontend, it never
picks an instance whose KV events and load reports it cannot hear (see
``runtime.plane_refusals``). Refusals are decided, and logged, as the client's instances
change, not at the first request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from turnout.runtime.context import RequestContext
from turnout.runtime.endpoint_client import EndpointClient
from turnout.runtime.plane_refusals import PlaneRefusals

if TYPE_CHECKING:
    from turnout.runtime.component import DistributedRuntime


def refusals_of(runtime: DistributedRuntime, role: str) -> PlaneRefusals:
    """The refusals of a process in ``role`` (``"router"``) on ``runtime``'s planes."""
    return PlaneRefusals(runtime.request_plane, runtime.event_plane.kind, role)


class SamePlanes:
    """``client``'s instances less those ``refusals`` refuses (a ``KvRouterClient``)."""

    def __init__(self, client: EndpointClient, refusals: PlaneRefusals) -> None:
        self.client = client
        self._refusals = refusals
        #: ``instance_ids()`` and the client's tuple it was filtered from.
        self._ids: tuple[int, ...] = ()
        self._source: tuple[int, ...] | None = None
        client.add_listener(self._refresh)
        self._refresh()

    def _refresh(self) -> None:
        """Filter the client's instances again (when they changed); forget refusals of
        instances that left."""
        client = self.client
        source = client.instance_ids()
        if source is self._source:
            return
        refusals = self._refusals
        self._ids = tuple(i for i in source if not refusals.refuses(client.get_instance(i)))
        self._source = source
        refusals.retain(client.announced_ids())

    def instance_ids(self) -> tuple[int, ...]:
        self._refresh()
        return self._ids

    def announced_ids(self) -> set[int]:
        return self.client.announced_ids()

    def stream(self, instance_id: int, payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        return self.client.stream(instance_id, payload, ctx)

    def call(
        self, instance_id: int, name: str, payload: bytes, ctx: RequestContext
    ) -> AsyncIterator[bytes]:
        return self.client.call(instance_id, name, payload, ctx)

    def add_listener(self, callback: Callable[[], None]) -> None:
        self.client.add_listener(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        self.client.remove_listener(callback)
