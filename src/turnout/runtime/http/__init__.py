"""turnout's HTTP/1.1 server: the contract routes are written against (``exchange``) and the
server that enforces every connection bound (``server``)."""

from .exchange import (
    Application,
    ClientDisconnected,
    Exchange,
    HeaderList,
    Headers,
    ResponseStream,
    Scope,
    discard_body,
)
from .limits import CLOSE_REASONS, HttpLimits, MalformedRequest, RequestTimeout
from .server import HttpServer

__all__ = [
    "CLOSE_REASONS",
    "Application",
    "ClientDisconnected",
    "Exchange",
    "HeaderList",
    "Headers",
    "HttpLimits",
    "HttpServer",
    "MalformedRequest",
    "RequestTimeout",
    "ResponseStream",
    "Scope",
    "discard_body",
]
