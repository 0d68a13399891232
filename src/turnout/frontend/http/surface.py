"""An API surface: one generation route's request and response shapes over the shared pipelines.

OpenAI chat completions and completions, the Responses API and Anthropic messages all run the
same way (``HttpService`` reads the body, resolves the model, admits the request, accounts for
it and turns failures into errors); a surface supplies what differs: how its body decodes,
which pipeline serves it, how its response is written and how its errors look.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from turnout.frontend.http.errors import HttpError, request_decode_error
from turnout.frontend.models.manager import ModelKind
from turnout.frontend.models.pipeline import TextPipeline, TokensPipeline
from turnout.runtime.context import RequestContext
from turnout.runtime.http import Exchange


@dataclass(slots=True)
class SurfaceRequest:
    """A decoded request, as far as the service needs to know it."""

    model: str
    stream: bool
    #: The surface's own decoded request, handed back to its ``serve``.
    request: Any
    #: Admission priority the request asks for (``nvext.priority``; None: it names none, or
    #: the surface has none).
    priority: int | None = None
    #: The session key the body names (OpenAI's ``prompt_cache_key``): the routing session
    #: when no session header names one (``body_session_key``).
    session_key: str | None = None


#: The pipeline a request resolves to (a generation route's: tokens or text; other routes'
#: surfaces take their own).
Pipeline = TokensPipeline | TextPipeline | Any

#: Writes the response of an admitted request: (proto, pipeline, request, body, ctx, session).
ServeFn = Callable[
    [Exchange, Pipeline, SurfaceRequest, bytes, RequestContext, str | None], Awaitable[None]
]


_T = TypeVar("_T")


def decode_json(decoder: msgspec.json.Decoder[_T], body: bytes) -> _T:
    """``body`` as the decoder's type; a 400 naming the offending field when it is not."""
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise request_decode_error(exc) from None
    except RecursionError:
        # msgspec recurses once per level of a free-form object (a JSON schema, a tool's
        # parameters): a body nested past the interpreter's limit is the client's error.
        raise HttpError(400, "request body is nested too deeply") from None


#: Longest session id accepted, from a header or the body.
MAX_SESSION_ID_CHARS = 256


def body_session_key(value: str | None, param: str) -> str | None:
    """A body field that names the request's session (``prompt_cache_key``: OpenAI's own
    cache-routing hint), bounded as the session headers are; None when empty or absent."""
    if not value:
        return None
    if len(value) > MAX_SESSION_ID_CHARS:
        raise HttpError(
            400, f"'{param}' is longer than {MAX_SESSION_ID_CHARS} characters", param=param
        )
    return value


def openai_error_body(err: HttpError) -> bytes:
    return err.body()


@dataclass(frozen=True, slots=True)
class Surface:
    """One generation route."""

    #: The ``endpoint`` label of the request metrics.
    endpoint: str
    #: Which of the model's pipelines serves it.
    serves: ModelKind
    #: The body as this surface's request; raises ``HttpError`` (400) when it is not one.
    decode: Callable[[bytes], SurfaceRequest]
    serve: ServeFn
    #: An error's body in this surface's shape.
    error_body: Callable[[HttpError], bytes] = openai_error_body
