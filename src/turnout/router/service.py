"""``turnout router``: the KV router as a standalone service.

It keeps the same state a frontend's KV router keeps (KV events, load reports, in-flight
requests shared with other replicas) and answers, over the request plane, the question
"which worker should serve these tokens?" without dispatching anything. Tools and custom
frontends call it; several instances (and frontends in kv mode) share in-flight state
over the event plane.

Operations (one msgpack ``RouterCall`` in, one ``RouterReply`` out):

* ``best_worker``: route ``token_ids``; with ``book`` the request is counted on the chosen
  worker until ``free`` (or the safety TTL), otherwise nothing changes;
* ``prefill_done`` and ``free``: the booked request produced its first token / ended.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator

import msgspec

from turnout.errors import ConfigError
from turnout.protocols.card_bounds import CardBounds, card_problem
from turnout.protocols.model import MDC_ROOT, EndpointId, ModelDeploymentCard
from turnout.router.kv.config import KvRouterConfig
from turnout.router.kv.router import KvRouter
from turnout.router.kv.selector import Selection
from turnout.router.same_planes import SamePlanes, refusals_of
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.endpoint_client import EndpointClient
from turnout.runtime.serving import ServingInstance

log = logging.getLogger("turnout.router.service")


class RouterOp(enum.StrEnum):
    BEST_WORKER = "best_worker"
    PREFILL_DONE = "prefill_done"
    FREE = "free"


class RouterCall(msgspec.Struct, kw_only=True):
    op: RouterOp = RouterOp.BEST_WORKER
    request_id: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    lora_name: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    book: bool = False


class RouterReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    selection: Selection | None = None
    ok: bool = True
    error: str | None = None


_call_decoder = msgspec.msgpack.Decoder(RouterCall)
_reply_decoder = msgspec.msgpack.Decoder(RouterReply)
_encode = msgspec.msgpack.Encoder().encode
_card_decoder = msgspec.json.Decoder(ModelDeploymentCard)


async def discover_block_size(
    runtime: DistributedRuntime, workers: EndpointId, timeout: float = 60.0
) -> int:
    """The KV block size from the workers' model cards (waits for the first card)."""
    prefix = f"{MDC_ROOT}/{workers.path()}/"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    refused: set[str] = set()  # each logged once
    while True:
        for kv in await runtime.store.get_prefix(prefix):
            try:
                card = _card_decoder.decode(kv.value)
            except msgspec.DecodeError as exc:
                problem: object = exc
            else:
                # Numbers from the store are not trusted (a block of 0 tokens, of 2^40).
                problem = card_problem(card, CardBounds(max_artifact_bytes=None))
                if problem is None:
                    return card.kv_cache_block_size
            if kv.key not in refused:
                refused.add(kv.key)
                log.error("skipping invalid model card at %s: %s", kv.key, problem)
        if loop.time() > deadline:
            raise ConfigError(
                f"no model card under {prefix} after {timeout:.0f} s: are workers of "
                f"{workers.path()} running? (or pass --block-size)"
            )
        await asyncio.sleep(0.2)


class RouterService:
    """Serves one ``KvRouter`` at ``endpoint`` (an instance in discovery, like a worker)."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        workers: EndpointId,
        endpoint: EndpointId,
        config: KvRouterConfig,
        *,
        block_size: int | None = None,
        share_active: bool = True,
    ) -> None:
        self.runtime = runtime
        self.workers = workers
        self.endpoint = endpoint
        self.config = config
        self.block_size = block_size
        self.share_active = share_active
        self.router: KvRouter | None = None
        self.serving: ServingInstance | None = None
        self._client: EndpointClient | None = None

    async def start(self) -> ServingInstance:
        block_size = self.block_size or await discover_block_size(self.runtime, self.workers)
        config = msgspec.structs.replace(self.config, block_size=block_size)
        self._client = await self.runtime.endpoint(self.workers).client()
        self.router = KvRouter(
            config,
            SamePlanes(self._client, refusals_of(self.runtime, "router")),
            self.runtime.event_plane,
            self.workers,
            share_active=self.share_active,
        )
        await self.router.start()
        self.serving = await self.runtime.endpoint(self.endpoint).serve(self._handle)
        log.info(
            "router %s serving %s for workers of %s (block size %d)",
            self.router.router_id, self.endpoint.path(), self.workers.path(), block_size,
        )  # fmt: skip
        return self.serving

    async def _handle(self, payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        router = self.router
        assert router is not None
        try:
            call = _call_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            yield _encode(RouterReply(ok=False, error=f"invalid router call: {exc}"))
            return
        request_id = call.request_id or ctx.request_id
        if call.op is RouterOp.BEST_WORKER:
            selection = router.route(
                request_id,
                call.token_ids,
                lora_name=call.lora_name,
                cache_salt=call.cache_salt,
                session_id=call.session_id,
                book=call.book,
            )
            yield _encode(RouterReply(selection=selection, ok=selection.ok))
        elif call.op is RouterOp.PREFILL_DONE:
            router.on_first_token(request_id)
            yield _encode(RouterReply())
        else:
            router.on_finished(request_id)
            yield _encode(RouterReply())

    async def stop(self) -> None:
        if self.serving is not None:
            await self.serving.stop(drain_timeout=1.0)
            self.serving = None
        if self.router is not None:
            await self.router.close()
            self.router = None
        if self._client is not None:
            await self._client.close()
            self._client = None


class RouterClient:
    """Asks a ``turnout router`` service (any of its instances) for the best worker."""

    def __init__(self, client: EndpointClient) -> None:
        self._client = client

    @classmethod
    async def connect(cls, runtime: DistributedRuntime, endpoint: EndpointId) -> RouterClient:
        client = await runtime.endpoint(endpoint).client()
        return cls(client)

    async def call(self, call: RouterCall) -> RouterReply:
        ids = self._client.instance_ids()
        if not ids:
            raise ConfigError(f"no router instance at {self._client.endpoint.path()}")
        stream = self._client.stream(ids[0], _encode(call), RequestContext())
        try:
            async for raw in stream:
                return _reply_decoder.decode(raw)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        raise ConfigError("the router sent no reply")

    async def best_worker(
        self, token_ids: list[int], *, lora_name: str | None = None, book: bool = False,
        request_id: str = "",
    ) -> Selection | None:  # fmt: skip
        reply = await self.call(
            RouterCall(token_ids=token_ids, lora_name=lora_name, book=book, request_id=request_id)
        )
        return reply.selection

    async def close(self) -> None:
        await self._client.close()
