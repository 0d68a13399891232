"""HTTP/1.1 bytes: status lines, the date header, the server's own error bodies."""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus

import msgspec

STATUS_LINES = {int(s): f"HTTP/1.1 {int(s)} {s.phrase}\r\n".encode("latin-1") for s in HTTPStatus}
STATUS_LINES[499] = b"HTTP/1.1 499 Client Closed Request\r\n"
STATUS_LINES[529] = b"HTTP/1.1 529 Site Overloaded\r\n"
LAST_CHUNK = b"0\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_json = msgspec.json.Encoder()


class DateHeader:
    """``date: ...\\r\\n``, formatted at most once a second."""

    __slots__ = ("line", "second")

    def __init__(self) -> None:
        self.second = -1
        self.line = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.line = f"date: {formatdate(now, usegmt=True)}\r\n".encode("latin-1")
        return self.line


def error_body(message: str, code: str, error_type: str = "invalid_request_error") -> bytes:
    """An OpenAI-style error body for the failures the server answers itself."""
    return _json.encode(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    )
