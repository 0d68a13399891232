"""HTTP errors with OpenAI's body, and the translation of turnout's errors into them.

Status codes: 400 bad request, 401 no valid credential, 403 not an admin's on a control
route, 404 unknown model or pinned instance, 405 wrong method, 413 body too large, 429 a
tenant past one of its limits (``Retry-After``, ``code`` ``tenant_<limit>_limit``), 499 client
gone, 502 a worker broke the protocol, 503 no instance (with
``Retry-After``), 429/503/529 (``--reject-status``, with ``Retry-After``) the frontend's
admission limits, 500 only for a bug.

Bodies follow OpenAI's: ``type`` says whose side failed (``invalid_request_error`` for the
client's, ``server_error`` for ours or a worker's), ``code`` is a string naming the case
(``model_not_found``, ``context_length_exceeded``, ``service_unavailable``, ...) or null, never
the HTTP status (that is the status line's job).

Overload body: ``type`` ``overloaded_error`` and ``code`` ``server_overloaded``.
``overloaded_error`` is the type Anthropic's API sends with its 529 "Overloaded" (the status
Dynamo also answers); OpenAI's own overload answers (503 "The server is overloaded") carry the
generic ``server_error`` type, which clients cannot tell apart from a crash, so the specific
name wins, and ``code`` says it once more for clients that only read ``code``.
"""

from __future__ import annotations

import logging
import math
import re

import msgspec

from turnout.errors import (
    ContextLengthExceeded,
    FrontendOverloaded,
    InstanceNotFound,
    ModelNotFound,
    NoInstanceAvailable,
    NotYetSupported,
    RemoteError,
    RequestError,
    RequestPlaneError,
    RequestTimedOut,
    TemplateLimitExceeded,
    WorkerProtocolError,
)
from turnout.frontend.access.limits import TenantLimitExceeded
from turnout.protocols.openai import ErrorDetail, ErrorResponse

log = logging.getLogger("turnout.frontend")

_encoder = msgspec.json.Encoder()

#: Statuses ``--reject-status`` may choose for admission rejections.
REJECT_STATUSES = (429, 503, 529)
#: Seconds a rejected client is asked to wait (``Retry-After``).
RETRY_AFTER_S = 1
_RETRY_AFTER = [("retry-after", str(RETRY_AFTER_S))]

#: OpenAI's error types (``type``).
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
OVERLOADED = "overloaded_error"
RATE_LIMITED = "rate_limit_error"

#: msgspec's error suffix naming the offending field: ``... - at `$.nvext.priority```.
_AT_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
#: msgspec's message for a field a ``forbid_unknown_fields`` struct does not have.
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]*)`")


class HttpError(Exception):
    """An error that becomes one HTTP response with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
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
        text = str(exc)
        match = _AT_PATH.search(text)
        where = match.group(1) if match else ""
        unknown = _UNKNOWN_FIELD.match(text)
        if unknown is not None:
            param = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
            return HttpError(
                400,
                f"unrecognized request argument supplied: {param} (turnout does not support "
                "it, and does not ignore what it cannot honour)",
                param=param,
                code="unknown_parameter",
            )
        return HttpError(400, f"invalid request: {exc}", param=where or None)
    return HttpError(400, f"request body is not valid JSON: {exc}")


def overloaded_error(exc: FrontendOverloaded, status: int = 503) -> HttpError:
    """An admission rejection, with the status ``--reject-status`` chose."""
    return HttpError(
        status,
        str(exc),
        type=OVERLOADED,
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
    if isinstance(exc, RequestTimedOut):
        return timed_out(str(exc))
    if isinstance(exc, ContextLengthExceeded):
        return HttpError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, RequestError):
        return HttpError(400, str(exc), param=exc.param)
    if isinstance(exc, ModelNotFound):
        return HttpError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, InstanceNotFound):
        return HttpError(404, str(exc), param=exc.param, code="instance_not_found")
    if isinstance(exc, FrontendOverloaded):
        return overloaded_error(exc, reject_status)
    if isinstance(exc, TenantLimitExceeded):
        return tenant_limited(exc)
    if isinstance(exc, NotYetSupported):
        return HttpError(400, str(exc), code="unsupported_parameter")
    if isinstance(exc, NoInstanceAvailable):
        return unavailable(str(exc))
    if isinstance(exc, WorkerProtocolError | msgspec.DecodeError):
        log.warning("worker protocol error: %s", exc)
        return HttpError(
            502,
            f"a worker sent a malformed response: {exc}",
            type=SERVER_ERROR,
            code="worker_protocol_error",
        )
    if isinstance(exc, TemplateLimitExceeded):
        # The model's template, not the request and not a bug here: said so, no traceback.
        log.warning("chat template limit: %s", exc)
        return HttpError(
            500,
            f"the model's chat template failed: {exc}",
            type=SERVER_ERROR,
            code="chat_template_limit",
        )
    if isinstance(exc, RemoteError):
        return worker_error(str(exc))
    if isinstance(exc, RequestPlaneError):
        return unavailable(f"worker unavailable: {exc}")
    log.exception("unexpected error", exc_info=exc)
    return HttpError(
        500,
        f"internal error: {type(exc).__name__}: {exc}",
        type=SERVER_ERROR,
        code="internal_error",
    )


def tenant_limited(exc: TenantLimitExceeded) -> HttpError:
    """A 429 for a tenant past ``exc.limit``, with ``Retry-After`` in whole seconds (at
    least 1, rounded up: a client retrying then finds room)."""
    retry_after = max(1, math.ceil(exc.retry_after))
    return HttpError(
        429,
        str(exc),
        type=RATE_LIMITED,
        code=f"tenant_{exc.limit}_limit",
        headers=[("retry-after", str(retry_after))],
    )


def unavailable(message: str) -> HttpError:
    """A 503 for a request no worker can take now (with ``Retry-After``)."""
    return HttpError(
        503, message, type=SERVER_ERROR, code="service_unavailable", headers=_RETRY_AFTER
    )


def worker_error(message: str) -> HttpError:
    """A 500 for a request its worker failed (the worker said why)."""
    return HttpError(500, f"worker error: {message}", type=SERVER_ERROR, code="worker_error")


def timed_out(message: str) -> HttpError:
    """A 504 for a request past its deadline."""
    return HttpError(504, message, type=SERVER_ERROR, code="request_timeout")
