"""Which request a log line is about, in every process, and the two log formats.

A request's ``RequestContext`` is bound to the task that serves it (``bind_request``): the
frontend's HTTP handler, and on a worker the request plane's stream task, which carries the
frontend's request id. Every log line emitted from that task, and from the tasks it starts
(they copy the binding), then names the request, whichever logger wrote it, without each call
site passing the id. The model, the instance and the tenant come from the context's metadata,
so a fact learned mid-request (the instance the router chose) shows up in the lines after it.

``text`` (the default) is one human line, with ``request_id=…`` appended while a request is
bound; ``json`` is one object per line, for log pipelines.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

from turnout.runtime.context import RequestContext

#: ``RequestContext.metadata`` key: the served model's name, for log lines.
MODEL_METADATA = "log_model"
#: ``RequestContext.metadata`` key: the tenant the request is accounted to (absent: none).
TENANT_METADATA = "log_tenant"
#: ``RequestContext.metadata`` key of the instance serving the request (an ``int``): set by
#: the frontend's router when it picks one, and by a worker for its own.
INSTANCE_METADATA = "worker_instance_id"

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s pid=%(process)d %(message)s%(request_suffix)s"

_current: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar(
    "turnout_request", default=None
)


def bind_request(ctx: RequestContext) -> None:
    """Make ``ctx`` the request of the running task (and of the tasks it starts from now on).
    A task ends with its context, so there is nothing to unbind."""
    _current.set(ctx)


def current_request() -> RequestContext | None:
    """The request bound to the running task, if any."""
    return _current.get()


class RequestFields(logging.Filter):
    """Adds ``request_id``, ``model``, ``instance`` (hex, as instance ids are shown
    everywhere) and ``tenant`` to every record, None where unknown, and ``request_suffix``
    for the text format. A handler's filter: it sees the records of every logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _current.get()
        if ctx is None:
            record.request_id = record.model = record.instance = record.tenant = None
            record.request_suffix = ""
            return True
        meta = ctx.metadata
        instance = meta.get(INSTANCE_METADATA)
        record.request_id = ctx.request_id
        record.model = meta.get(MODEL_METADATA)
        record.instance = f"{instance:x}" if isinstance(instance, int) else None
        record.tenant = meta.get(TENANT_METADATA)
        record.request_suffix = f" request_id={ctx.request_id}"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (RFC 3339, UTC, milliseconds), level, logger, pid,
    message, the request's fields where one is bound, and the traceback as one string."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        for name in ("request_id", "model", "instance", "tenant"):
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def _rfc3339(created: float) -> str:
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is written (unless ``setStream`` gave
    it another stream), so that a live progress display, which redirects stderr through
    itself while it shows (``runtime.progress``), keeps log lines whole above it."""

    _fixed: Any = None

    @property
    def stream(self) -> Any:
        return sys.stderr if self._fixed is None else self._fixed

    @stream.setter
    def stream(self, value: Any) -> None:
        self._fixed = None if value is sys.stderr else value


def log_handler(log_format: str) -> logging.Handler:
    """A stderr handler writing ``log_format`` (``text`` or ``json``) lines with the request's
    fields."""
    handler = StderrHandler()
    handler.addFilter(RequestFields())
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    elif log_format == "text":
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    else:
        raise ValueError(f"unknown log format {log_format!r}: choose one of {LOG_FORMATS}")
    return handler
