"""What a model's pipelines need of an endpoint client, and the per-card view they route
through.

Several cards of one model may be announced on one endpoint at once (a rolling upgrade: the
old workers and the new ones, whose tokenizer, template or limits differ). Each card gets its
own ``AcceptedInstances`` over the endpoint's one client, listing only the instances that
publish that card, so a request tokenized with one card's tokenizer is never sent to an
instance of another, neither at first nor when it migrates.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Protocol

from turnout.errors import NoInstanceAvailable
from turnout.protocols.model import EndpointId, Instance
from turnout.runtime.context import RequestContext

__all__ = ["AcceptedInstances", "ModelClient"]


class ModelClient(Protocol):
    """What the pipelines, the routers, the artifact fetcher and the model manager use of a
    model's endpoint client (``runtime.endpoint_client.EndpointClient`` is one)."""

    @property
    def endpoint(self) -> EndpointId: ...

    def instance_ids(self) -> tuple[int, ...]:
        """Instances that may take a request now (announced, not set aside), sorted: the
        same tuple object until the set changes."""
        ...

    def announced_ids(self) -> set[int]:
        """Every instance discovery announces, set-aside ones included (membership)."""
        ...

    def instances(self) -> list[Instance]: ...

    def get_instance(self, instance_id: int) -> Instance | None: ...

    def stream(
        self, instance_id: int, payload: bytes, ctx: RequestContext
    ) -> AsyncIterator[bytes]: ...

    def call(
        self, instance_id: int, name: str, payload: bytes, ctx: RequestContext
    ) -> AsyncIterator[bytes]: ...

    def report_instance_down(self, instance_id: int) -> None: ...

    def add_listener(self, callback: Callable[[], None]) -> None: ...

    def remove_listener(self, callback: Callable[[], None]) -> None: ...

    async def close(self) -> None: ...


class AcceptedInstances:
    """One card's view of its endpoint's client: ``instance_ids()``, ``instances()`` and
    ``get_instance()`` keep only the instances in ``accepted`` (those that publish the card,
    set by the model watcher); side-handler calls (content-addressed artifacts, KV handle
    releases), set-asides and listeners go to the client. ``stream`` sends a request only to
    an instance of the card (a request pinned to another card's instance fails with
    ``NoInstanceAvailable``, 503). ``announced_ids`` is the client's: state kept per instance
    (KV indexes, load counts) follows membership of the endpoint, whatever the card.

    ``close`` closes the client: the view is handed to the model manager, which closes what it
    holds at shutdown. The model watcher, which shares one client among the views of one
    endpoint, closes the client itself when its last view goes.
    """

    __slots__ = ("_accepted", "_ids", "_ids_source", "client")

    def __init__(self, client: ModelClient) -> None:
        self.client = client
        self._accepted: frozenset[int] = frozenset()
        #: ``instance_ids()`` and the client's tuple it was filtered from: recomputed only
        #: when either the client's live set or ``accepted`` changes.
        self._ids: tuple[int, ...] = ()
        self._ids_source: tuple[int, ...] | None = None

    @property
    def accepted(self) -> frozenset[int]:
        """Instance ids publishing this view's card; set by the model watcher."""
        return self._accepted

    @accepted.setter
    def accepted(self, ids: set[int] | frozenset[int]) -> None:
        self._accepted = frozenset(ids)
        self._ids_source = None

    @property
    def endpoint(self) -> EndpointId:
        return self.client.endpoint

    def instance_ids(self) -> tuple[int, ...]:
        source = self.client.instance_ids()
        if source is not self._ids_source:
            accepted = self._accepted
            self._ids = tuple(i for i in source if i in accepted)
            self._ids_source = source
        return self._ids

    def announced_ids(self) -> set[int]:
        return self.client.announced_ids()

    def instances(self) -> list[Instance]:
        accepted = self.accepted
        return [inst for inst in self.client.instances() if inst.instance_id in accepted]

    def get_instance(self, instance_id: int) -> Instance | None:
        if instance_id not in self.accepted:
            return None
        return self.client.get_instance(instance_id)

    def stream(self, instance_id: int, payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        if instance_id not in self.accepted:
            return _not_of_this_card(instance_id, self.client.endpoint)
        return self.client.stream(instance_id, payload, ctx)

    def call(
        self, instance_id: int, name: str, payload: bytes, ctx: RequestContext
    ) -> AsyncIterator[bytes]:
        return self.client.call(instance_id, name, payload, ctx)

    def report_instance_down(self, instance_id: int) -> None:
        self.client.report_instance_down(instance_id)

    def add_listener(self, callback: Callable[[], None]) -> None:
        self.client.add_listener(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        self.client.remove_listener(callback)

    async def close(self) -> None:
        await self.client.close()


async def _not_of_this_card(instance_id: int, endpoint: EndpointId) -> AsyncGenerator[bytes, None]:
    raise NoInstanceAvailable(
        f"instance {instance_id:x} of {endpoint.path()} serves another card of this model "
        "(its tokenizer, template or limits differ); it takes none of this card's requests"
    )
    yield b""  # an async generator, like the client's streams
