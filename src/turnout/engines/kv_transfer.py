"""How a worker's engine reaches other workers to move KV blocks (disaggregated serving).

An engine that takes part in disaggregated serving is given a ``KvTransport`` by its worker:
the decode side pulls a handle's blocks from the prefill instance, the prefill side pushes
them to the decode instance. Both are calls of the other instance's ``KV_TRANSFER_HANDLER``
(``protocols.disagg``) over the request plane, found through discovery like any instance.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Protocol

import msgspec

from turnout.errors import PeerUnavailable
from turnout.protocols.disagg import (
    KV_TRANSFER_HANDLER,
    KvHandle,
    KvTransferOp,
    KvTransferReply,
    KvTransferRequest,
)
from turnout.protocols.model import EndpointId
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.endpoint_client import EndpointClient

log = logging.getLogger(__name__)

#: Seconds a transport waits for discovery to show an instance it was told about (a decode
#: worker may hear of a prefill instance before its own watch does).
DISCOVERY_WAIT_S = 5.0
#: Endpoints whose instance watches a transport keeps open at once (least recently used go).
MAX_ENDPOINT_CLIENTS = 16

_encode = msgspec.msgpack.Encoder().encode
_reply_decoder = msgspec.msgpack.Decoder(KvTransferReply)


class KvTransport(Protocol):
    """Moves KV between instances. Both calls return when the bytes are across (or not):
    failures come back as ``ok=False`` replies or exceptions; callers bound them in time."""

    async def pull(self, handle: KvHandle) -> KvTransferReply: ...

    async def push(
        self, endpoint: EndpointId, instance_id: int, handle: KvHandle
    ) -> KvTransferReply: ...


class RequestPlaneKvTransport:
    """``KvTransport`` over the request plane: one discovery watch per peer endpoint."""

    def __init__(
        self, runtime: DistributedRuntime, *, discovery_wait_s: float = DISCOVERY_WAIT_S
    ) -> None:
        self._runtime = runtime
        self._discovery_wait_s = discovery_wait_s
        self._clients: OrderedDict[EndpointId, EndpointClient] = OrderedDict()
        self._lock = asyncio.Lock()

    async def pull(self, handle: KvHandle) -> KvTransferReply:
        request = KvTransferRequest(op=KvTransferOp.PULL, handle_id=handle.handle_id)
        return await self._call(handle.endpoint, handle.instance_id, request)

    async def push(
        self, endpoint: EndpointId, instance_id: int, handle: KvHandle
    ) -> KvTransferReply:
        request = KvTransferRequest(op=KvTransferOp.PUSH, handle_id=handle.handle_id, handle=handle)
        return await self._call(endpoint, instance_id, request)

    async def _call(
        self, endpoint: EndpointId, instance_id: int, request: KvTransferRequest
    ) -> KvTransferReply:
        client = await self._client(endpoint)
        if client.get_instance(instance_id) is None:
            await self._wait_for(client, instance_id)
        ctx = RequestContext()
        try:
            async for item in client.call(instance_id, KV_TRANSFER_HANDLER, _encode(request), ctx):
                return _reply_decoder.decode(item)
        finally:
            ctx.cancel()
        return KvTransferReply(ok=False, error=f"instance {instance_id:x} sent no reply")

    async def _wait_for(self, client: EndpointClient, instance_id: int) -> None:
        changed = asyncio.Event()
        client.add_listener(changed.set)
        try:
            async with asyncio.timeout(self._discovery_wait_s):
                while True:
                    changed.clear()
                    if client.get_instance(instance_id) is not None:
                        return
                    await changed.wait()
        except TimeoutError:
            raise PeerUnavailable(
                f"no instance {instance_id:x} of {client.endpoint.path()} in discovery "
                f"after {self._discovery_wait_s:g}s"
            ) from None
        finally:
            client.remove_listener(changed.set)

    async def _client(self, endpoint: EndpointId) -> EndpointClient:
        async with self._lock:
            client = self._clients.get(endpoint)
            if client is not None:
                self._clients.move_to_end(endpoint)
                return client
            client = await self._runtime.endpoint(endpoint).client()
            self._clients[endpoint] = client
            if len(self._clients) > MAX_ENDPOINT_CLIENTS:
                _, oldest = self._clients.popitem(last=False)
                await oldest.close()
            return client

    async def close(self) -> None:
        clients = list(self._clients.values())
        self._clients.clear()
        for client in clients:
            await client.close()
