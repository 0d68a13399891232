"""The push router: pick an instance, send the request over the request plane, stream back.

Generic over the wire types so the same router serves token-level pipelines
(``PreprocessedRequest`` -> ``LLMEngineOutput``) and text-level, router-only models (OpenAI
request -> OpenAI chunks).

Failure handling: an instance that cannot be reached (``PeerUnavailable``: nothing was
delivered) is set aside by the endpoint client and the request goes to another instance, up to
``max_attempts``; a stream that breaks after delivery (``StreamBroken``) propagates to the
migration operator above, which knows how much was generated.

Instances the request must avoid (``AVOID_METADATA``: migration is retrying it elsewhere
after they failed or answered ``overloaded`` before its first token) are never candidates;
instances the load view holds busy (they answered ``overloaded`` lately) are left out while
another candidate is free, in every mode.

Pinned requests (``nvext.backend_instance_id``; router mode ``direct`` requires one): a pin
to an instance discovery does not know is ``InstanceNotFound`` (404: retrying cannot help);
a pin to a known instance that is set aside or unreachable is ``NoInstanceAvailable`` (503).
A worker output that does not decode is ``WorkerProtocolError`` (502), never the client's
fault.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Generic, Protocol, TypeVar

import msgspec

from turnout.errors import (
    InstanceNotFound,
    NoInstanceAvailable,
    PeerUnavailable,
    RequestError,
    WorkerProtocolError,
)
from turnout.protocols.llm import PreprocessedRequest
from turnout.router.instance_load import InstanceLoad
from turnout.router.selectors import InstanceSelector
from turnout.runtime import tracing
from turnout.runtime.context import AVOID_METADATA, RequestContext

log = logging.getLogger("turnout.router")

Req = TypeVar("Req")
Resp = TypeVar("Resp")

#: The request field that pins an instance (named in client-facing errors).
PIN_PARAM = "nvext.backend_instance_id"
#: ``RequestContext.metadata`` key carrying the pin of a request the router cannot read
#: (a Text-input model's raw OpenAI body); set by the frontend.
PIN_METADATA = "backend_instance_id"


def check_pinned(client: InstanceSource, instance_id: int, endpoint_name: str = "") -> None:
    """``InstanceNotFound`` when discovery does not know ``instance_id``, or
    ``NoInstanceAvailable`` when it is known but not live (set aside, unreachable)."""
    live = client.instance_ids()
    if instance_id in live:
        return
    known = client.announced_ids()
    where = f" of {endpoint_name}" if endpoint_name else ""
    if instance_id not in known:
        raise InstanceNotFound(
            f"no instance {instance_id:x}{where} ({PIN_PARAM}); "
            f"live instances: {[f'{i:x}' for i in live]}",
            param=PIN_PARAM,
        )
    raise NoInstanceAvailable(
        f"instance {instance_id:x}{where} named by the request ({PIN_PARAM}) is not available "
        "now (set aside after a failure, or not ready); retry later"
    )


class LiveInstances(Protocol):
    """The live instances of an endpoint (``runtime.endpoint_client.EndpointClient``)."""

    def instance_ids(self) -> Sequence[int]:
        """Instances that may take a request now (announced, not set aside)."""
        ...


class InstanceSource(LiveInstances, Protocol):
    """What the router needs of an endpoint client (``runtime.endpoint_client.EndpointClient``)."""

    def announced_ids(self) -> Collection[int]:
        """Every instance discovery announces, set aside or not."""
        ...

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
        load: InstanceLoad | None = None,
    ) -> None:
        self._client = client
        #: Requests in flight per instance: one more from the moment a stream to an instance
        #: is opened until it ends, however it ends (the load-based selectors read it; the
        #: pipeline factory shares one per model); and the instances held busy after an
        #: ``overloaded`` answer (``mark_busy``, which migration calls), left out of the
        #: candidates while another is free.
        self.load = load if load is not None else InstanceLoad()
        self._selector = selector
        self._encode = encode
        self._decode = decode
        self._endpoint_name = endpoint_name
        self._max_attempts = max_attempts

    def _pick(
        self, request: Req, excluded: Collection[int], avoid: Collection[int], ctx: RequestContext
    ) -> int:
        if isinstance(request, PreprocessedRequest):
            pinned = request.backend_instance_id
        else:
            pinned = ctx.metadata.get(PIN_METADATA)
        if pinned is not None:
            if pinned in excluded or pinned in avoid:
                raise NoInstanceAvailable(
                    f"instance {pinned:x} named by the request ({PIN_PARAM}) is unreachable"
                )
            check_pinned(self._client, pinned, self._endpoint_name)
            return pinned
        if self._selector.needs_pin:
            raise RequestError(
                f"router mode 'direct' needs the request to name its instance ({PIN_PARAM})",
                param=PIN_PARAM,
            )
        live = self._client.instance_ids()
        candidates: Sequence[int]
        if excluded or avoid:
            candidates = [i for i in live if i not in excluded and i not in avoid]
        else:
            candidates = live
        if not candidates:
            raise NoInstanceAvailable(
                f"no live instance of {self._endpoint_name or 'the model'} "
                f"({len(live)} known, {len(excluded)} unreachable, "
                f"{len(avoid)} failed or overloaded for this request)"
            )
        return self._selector.select(
            self.load.not_busy(candidates),
            request if isinstance(request, PreprocessedRequest) else None,
        )

    async def generate(self, request: Req, ctx: RequestContext) -> AsyncIterator[Resp]:
        payload = self._encode(request)
        excluded: set[int] = set()
        avoid: Collection[int] = ctx.metadata.get(AVOID_METADATA, ())
        decode = self._decode
        while True:
            span = (
                None
                if ctx.trace is None
                else tracing.start_span(
                    ctx, "route", {"turnout.router.selector": type(self._selector).__name__}
                )
            )
            try:
                instance_id = self._pick(request, excluded, avoid, ctx)
            except BaseException as exc:
                tracing.end_span(span, exc)
                raise
            if span is not None:
                span.set_attribute("turnout.instance", f"{instance_id:x}")
                tracing.end_span(span)
            ctx.metadata["worker_instance_id"] = instance_id
            stream = self._client.stream(instance_id, payload, ctx)
            ticket = self.load.on_stream_started(instance_id)
            try:
                async for raw in stream:
                    try:
                        item = decode(raw)
                    except msgspec.DecodeError as exc:  # ValidationError included
                        raise WorkerProtocolError(
                            f"instance {instance_id:x} of {self._endpoint_name or 'the model'} "
                            f"sent an output that does not decode: {exc}"
                        ) from exc
                    yield item
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
                self.load.on_stream_ended(ticket)
                await stream.aclose()  # type: ignore[attr-defined]
