"""The push router: pick an instance, send the request over the request plane, stream back.

Generic over the wire types so the same router serves token-level pipelines
(``PreprocessedRequest`` -> ``LLMEngineOutput``) and text-level, router-only models (OpenAI
request -> OpenAI chunks).

Failure handling: an instance that cannot be reached (``PeerUnavailable``: nothing was
delivered) is set aside by the endpoint client and the request goes to another instance, up to
``max_attempts``; a stream that breaks after delivery (``StreamBroken``) propagates to the
migration operator above, which knows how much was generated.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Generic, Protocol, TypeVar

from turnout.errors import NoInstanceAvailable, PeerUnavailable
from turnout.protocols.llm import PreprocessedRequest
from turnout.router.selectors import InstanceSelector
from turnout.runtime.context import RequestContext

log = logging.getLogger("turnout.router")

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class InstanceSource(Protocol):
    """What the router needs of an endpoint client (``runtime.component.EndpointClient``)."""

    def instance_ids(self) -> list[int]: ...

    def stream(
        self, instance_id: int, payload: bytes, ctx: RequestContext
    ) -> AsyncIterator[bytes]: ...


class PushRouter(Generic[Req, Resp]):
    def __init__(
        self,
        client: InstanceSource,
        selector: InstanceSelector,
        *,
        encode: Callable[[Req], bytes],
        decode: Callable[[bytes], Resp],
        endpoint_name: str = "",
        max_attempts: int = 3,
    ) -> None:
        self._client = client
        self._selector = selector
        self._encode = encode
        self._decode = decode
        self._endpoint_name = endpoint_name
        self._max_attempts = max_attempts

    def _pick(self, request: Req, excluded: set[int]) -> int:
        live = self._client.instance_ids()
        pinned = request.backend_instance_id if isinstance(request, PreprocessedRequest) else None
        if pinned is not None:
            if pinned in live and pinned not in excluded:
                return pinned
            raise NoInstanceAvailable(
                f"instance {pinned:x} named by the request is not available "
                f"(live instances of {self._endpoint_name}: {[f'{i:x}' for i in live]})"
            )
        candidates = [i for i in live if i not in excluded] if excluded else live
        if not candidates:
            raise NoInstanceAvailable(
                f"no live instance of {self._endpoint_name or 'the model'} "
                f"({len(live)} known, {len(excluded)} unreachable)"
            )
        return self._selector.select(
            candidates, request if isinstance(request, PreprocessedRequest) else None
        )

    async def generate(self, request: Req, ctx: RequestContext) -> AsyncIterator[Resp]:
        payload = self._encode(request)
        excluded: set[int] = set()
        decode = self._decode
        while True:
            instance_id = self._pick(request, excluded)
            ctx.metadata["worker_instance_id"] = instance_id
            stream = self._client.stream(instance_id, payload, ctx)
            try:
                async for raw in stream:
                    yield decode(raw)
                return
            except PeerUnavailable as exc:
                excluded.add(instance_id)
                log.warning(
                    "request %s: instance %x unreachable (%s); trying another",
                    ctx.request_id,
                    instance_id,
                    exc,
                )
                if len(excluded) >= self._max_attempts:
                    raise NoInstanceAvailable(
                        f"{len(excluded)} instances of {self._endpoint_name or 'the model'} "
                        f"were unreachable; last error: {exc}"
                    ) from exc
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
