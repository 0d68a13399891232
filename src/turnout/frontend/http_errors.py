"""HTTP errors with OpenAI's body, and the translation of turnout's errors into them.

Status codes: 400 bad request, 404 unknown model, 405 wrong method, 413 body too large,
499 client gone, 503 overloaded or no instance (with ``Retry-After``), 500 only for a bug.
"""

from __future__ import annotations

import logging

import msgspec

from turnout.errors import (
    ModelNotFound,
    NoInstanceAvailable,
    NotYetSupported,
    RemoteError,
    RequestError,
    RequestPlaneError,
)
from turnout.protocols.openai import ErrorDetail, ErrorResponse

log = logging.getLogger("turnout.frontend")

_encoder = msgspec.json.Encoder()


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


def to_http_error(exc: BaseException) -> HttpError:
    """The most specific HTTP error for ``exc``; unknown exceptions are 500s and are logged."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, RequestError):
        return HttpError(400, str(exc), param=exc.param)
    if isinstance(exc, msgspec.ValidationError):
        return HttpError(400, f"invalid request: {exc}")
    if isinstance(exc, msgspec.DecodeError):
        return HttpError(400, f"request body is not valid JSON: {exc}")
    if isinstance(exc, ModelNotFound):
        return HttpError(404, str(exc), type="model_not_found", param="model")
    if isinstance(exc, NotYetSupported):
        return HttpError(400, str(exc), type="not_supported")
    if isinstance(exc, NoInstanceAvailable):
        return HttpError(503, str(exc), type="service_unavailable", headers=[("retry-after", "1")])
    if isinstance(exc, RemoteError):
        return HttpError(500, f"worker error: {exc}", type="internal_error")
    if isinstance(exc, RequestPlaneError):
        return HttpError(
            503,
            f"worker unavailable: {exc}",
            type="service_unavailable",
            headers=[("retry-after", "1")],
        )
    log.exception("unexpected error", exc_info=exc)
    return HttpError(500, f"internal error: {type(exc).__name__}: {exc}", type="internal_error")
