"""HTTP errors with OpenAI's body, and the translation of turnout's errors into them.

Status codes: 400 bad request, 404 unknown model or pinned instance, 405 wrong method,
413 body too large, 499 client gone, 502 a worker broke the protocol, 503 no instance (with
``Retry-After``), 429/503/529 (``--reject-status``, with ``Retry-After``) the frontend's
admission limits, 500 only for a bug.

Overload body: ``type`` ``overloaded_error`` and ``code`` ``server_overloaded``.
``overloaded_error`` is the type Anthropic's API sends with its 529 "Overloaded" (the status
Dynamo also answers); OpenAI's own overload answers (503 "The server is overloaded") carry the
generic ``server_error`` type, which clients cannot tell apart from a crash, so the specific
name wins, and ``code`` says it once more for clients that only read ``code``.
"""

from __future__ import annotations

import logging
import re

import msgspec

from turnout.errors import (
    FrontendOverloaded,
    InstanceNotFound,
    ModelNotFound,
    NoInstanceAvailable,
    NotYetSupported,
    RemoteError,
    RequestError,
    RequestPlaneError,
    WorkerProtocolError,
)
from turnout.protocols.openai import ErrorDetail, ErrorResponse

log = logging.getLogger("turnout.frontend")

_encoder = msgspec.json.Encoder()

#: Statuses ``--reject-status`` may choose for admission rejections.
REJECT_STATUSES = (429, 503, 529)
#: Seconds a rejected client is asked to wait (``Retry-After``).
RETRY_AFTER_S = 1
_RETRY_AFTER = [("retry-after", str(RETRY_AFTER_S))]

#: msgspec's error suffix naming the offending field: ``... - at `$.nvext.priority```.
_AT_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


class HttpError(Exception):
    """An error that becomes one HTTP response with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: int | str | None = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code if code is not None else status
        self.headers = headers or []

    def body(self) -> bytes:
        return _encoder.encode(
            ErrorResponse(
                error=ErrorDetail(
                    message=self.message, type=self.type, param=self.param, code=self.code
                )
            )
        )


def request_decode_error(exc: msgspec.DecodeError) -> HttpError:
    """The 400 for a request body that is not valid JSON or not a valid request; ``param``
    names the offending field (``nvext.priority``) when msgspec says which."""
    if isinstance(exc, msgspec.ValidationError):
        match = _AT_PATH.search(str(exc))
        return HttpError(400, f"invalid request: {exc}", param=match.group(1) if match else None)
    return HttpError(400, f"request body is not valid JSON: {exc}")


def overloaded_error(exc: FrontendOverloaded, status: int = 503) -> HttpError:
    """An admission rejection, with the status ``--reject-status`` chose."""
    return HttpError(
        status,
        str(exc),
        type="overloaded_error",
        code="server_overloaded",
        headers=_RETRY_AFTER,
    )


def to_http_error(exc: BaseException, *, reject_status: int = 503) -> HttpError:
    """The most specific HTTP error for ``exc``; unknown exceptions are 500s and are logged.

    msgspec errors reaching here did not come from the client's body (the HTTP layer turns
    those into 400s with ``request_decode_error`` where it decodes): they are a worker's
    output that did not decode, so a 502, like ``WorkerProtocolError``."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, RequestError):
        return HttpError(400, str(exc), param=exc.param)
    if isinstance(exc, ModelNotFound):
        return HttpError(404, str(exc), type="model_not_found", param="model")
    if isinstance(exc, InstanceNotFound):
        return HttpError(404, str(exc), type="instance_not_found", param=exc.param)
    if isinstance(exc, FrontendOverloaded):
        return overloaded_error(exc, reject_status)
    if isinstance(exc, NotYetSupported):
        return HttpError(400, str(exc), type="not_supported")
    if isinstance(exc, NoInstanceAvailable):
        return HttpError(503, str(exc), type="service_unavailable", headers=_RETRY_AFTER)
    if isinstance(exc, WorkerProtocolError | msgspec.DecodeError):
        log.warning("worker protocol error: %s", exc)
        return HttpError(
            502,
            f"a worker sent a malformed response: {exc}",
            type="bad_gateway",
            code="worker_protocol_error",
        )
    if isinstance(exc, RemoteError):
        return HttpError(500, f"worker error: {exc}", type="internal_error")
    if isinstance(exc, RequestPlaneError):
        return HttpError(
            503,
            f"worker unavailable: {exc}",
            type="service_unavailable",
            headers=_RETRY_AFTER,
        )
    log.exception("unexpected error", exc_info=exc)
    return HttpError(500, f"internal error: {type(exc).__name__}: {exc}", type="internal_error")
