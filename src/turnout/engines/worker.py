"""A worker: one engine behind a ``generate`` endpoint, registered in discovery.

The worker publishes, under the instance's lease, its ``Instance`` record (written by the
runtime) and its model deployment card at ``v1/mdc/{endpoint}/{instance_id:x}``, so the
frontend's model watcher sees the model appear and, when the lease ends, disappear.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import msgspec

from turnout.engines.base import Engine
from turnout.engines.events import EventPlaneSink
from turnout.protocols.kv import KV_SNAPSHOT_HANDLER, KvSnapshot, KvSnapshotRequest
from turnout.protocols.llm import LLMEngineOutput, PreprocessedRequest
from turnout.protocols.model import EndpointId, ModelDeploymentCard, mdc_key
from turnout.runtime.component import DistributedRuntime, ServingInstance
from turnout.runtime.context import RequestContext
from turnout.runtime.event_plane import EventPublisher
from turnout.runtime.request_plane.base import Handler

log = logging.getLogger("turnout.worker")

_request_decoder = msgspec.msgpack.Decoder(PreprocessedRequest)
_encode = msgspec.msgpack.Encoder().encode
_json = msgspec.json.Encoder()
_snapshot_request_decoder = msgspec.msgpack.Decoder(KvSnapshotRequest)


class Worker:
    def __init__(
        self,
        runtime: DistributedRuntime,
        engine: Engine,
        endpoint: EndpointId,
        *,
        model_name: str | None = None,
        migration_limit: int | None = None,
    ) -> None:
        self.runtime = runtime
        self.engine = engine
        self.endpoint = endpoint
        self.model_name = model_name
        self.migration_limit = migration_limit
        self.card: ModelDeploymentCard | None = None
        self.serving: ServingInstance | None = None
        self._publisher: EventPublisher | None = None

    async def start(self) -> ServingInstance:
        set_sink = getattr(self.engine, "set_event_sink", None)
        if set_sink is not None:
            # Engines that publish KV events and load reports get the event plane, on the
            # namespace/component the routers of this endpoint subscribe to.
            publisher = await self.runtime.event_plane.publisher(
                self.endpoint.namespace, self.endpoint.component
            )
            self._publisher = publisher
            set_sink(EventPlaneSink(publisher))
        await self.engine.start()
        template = self.engine.model_card_template()
        overrides: dict[str, object] = {"endpoint": self.endpoint}
        if self.model_name:
            overrides["display_name"] = self.model_name
        if self.migration_limit is not None:
            overrides["migration_limit"] = self.migration_limit
        base = msgspec.structs.replace(template, **overrides)

        def records(instance_id: int) -> list[tuple[str, bytes]]:
            self.engine.bind_instance(instance_id)
            self.card = msgspec.structs.replace(base, instance_id=instance_id)
            return [(mdc_key(self.endpoint, instance_id), _json.encode(self.card))]

        self.serving = await self.runtime.endpoint(self.endpoint).serve(
            self._handle, records=records
        )
        snapshot = getattr(self.engine, "kv_snapshot", None)
        if snapshot is not None:
            self.serving.add_handler(KV_SNAPSHOT_HANDLER, self._snapshot_handler(snapshot))
        log.info(
            "worker %x serving model %r at %s",
            self.serving.instance_id,
            base.display_name,
            self.endpoint.path(),
        )
        return self.serving

    async def _handle(self, payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        request = _request_decoder.decode(payload)
        stream: AsyncIterator[LLMEngineOutput] = self.engine.generate(request, ctx)
        try:
            async for output in stream:
                yield _encode(output)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    @staticmethod
    def _snapshot_handler(snapshot: Callable[[int], KvSnapshot]) -> Handler:
        async def handle(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
            request = _snapshot_request_decoder.decode(payload)
            yield _encode(snapshot(request.dp_rank))

        return handle

    async def stop(self, drain_timeout: float = 5.0) -> None:
        if self.serving is not None:
            await self.serving.stop(drain_timeout)
            self.serving = None
        await self.engine.stop()
        if self._publisher is not None:
            await self._publisher.close()
            self._publisher = None
