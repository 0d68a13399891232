"""What the one-reply routes (``/v1/embeddings``, ``/v1/tensor``) share: a surface that
decodes a body, runs it on the model's pipeline and writes one JSON body, and the ``nvext``
fields such requests take."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from turnout.frontend.http.surface import Surface, SurfaceRequest, decode_json
from turnout.frontend.models.manager import ModelKind
from turnout.frontend.openai.chunk_writer import JSON_HEADERS
from turnout.protocols.openai import UnaryNvExt
from turnout.router.push_router import PIN_METADATA
from turnout.runtime.context import RequestContext
from turnout.runtime.http import Exchange

_json = msgspec.json.Encoder()


def apply_nvext(nvext: UnaryNvExt | None, ctx: RequestContext) -> float | None:
    """Pin the request to ``nvext.backend_instance_id`` (the router reads it from ``ctx``);
    returns its own deadline (``nvext.request_timeout``), if any."""
    if nvext is None:
        return None
    if nvext.pinned_instance is not None:
        ctx.metadata[PIN_METADATA] = nvext.pinned_instance
    return nvext.request_timeout


def unary_surface(
    endpoint: str,
    serves: ModelKind,
    decoder: msgspec.json.Decoder[Any],
    answer: Callable[[Any, Any, RequestContext], Awaitable[msgspec.Struct]],
) -> Surface:
    """A route whose ``answer(pipeline, request, ctx)`` is its whole 200 body. Requests
    decode to a struct with ``model`` and an optional ``nvext`` (``UnaryNvExt``)."""

    def decode(body: bytes) -> SurfaceRequest:
        request = decode_json(decoder, body)
        nvext = request.nvext
        priority = nvext.priority if nvext is not None else None
        return SurfaceRequest(request.model, False, request, priority)

    async def serve(
        proto: Exchange,
        pipeline: Any,
        req: SurfaceRequest,
        body: bytes,
        ctx: RequestContext,
        session_id: str | None,
    ) -> None:
        response = await answer(pipeline, req.request, ctx)
        proto.response_bytes(200, JSON_HEADERS, _json.encode(response))

    return Surface(endpoint, serves, decode, serve)
