"""Per-request context: an id, and a cancellation that travels from the client to the worker."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

#: ``RequestContext.metadata`` key: the request's deadline on the event loop's clock (set by
#: migration while one applies), so that stages which wait (the prefill router) can give up
#: before it with a clearer error than a timeout.
DEADLINE_METADATA = "deadline"
#: ``RequestContext.metadata`` key: the instances the routers must not pick for this request
#: (a ``set[int]``, set by migration): they failed or answered ``overloaded`` before its first
#: token, and it is being tried on another.
AVOID_METADATA = "avoid_instances"
#: Most instances one request's ``AVOID_METADATA`` lists (it is sent away from at most this
#: many before it fails).
MAX_AVOIDED = 64
#: ``RequestContext.metadata`` key: set (``True``) by migration's watchdog just before it
#: cancels an attempt that stalled, so that a stage below that catches the cancellation can
#: tell a stalled worker (set it aside) from a client that went away or a deadline.
STALLED_METADATA = "stalled"
#: ``RequestContext.metadata`` key: ``True`` when the client asked for the routing decision
#: (``nvext.extra_fields: ["routing"]``, set by the frontend). Routers build their
#: explanation (``metadata["routing"]``) only then: it costs more than the decision.
EXPLAIN_ROUTING_METADATA = "explain_routing"
#: ``RequestContext.metadata`` key: the KV routers' hashes of the request's prompt, kept so
#: that the stages which route one prompt (the prefill pool, the decode workers, a re-route)
#: hash it once (``router.kv.push``).
SEQ_HASHES_METADATA = "kv_seq_hashes"


class RequestContext:
    """Identity and cancellation of one request.

    ``cancel()`` is idempotent; whoever holds the context (the HTTP handler when the client
    disconnects, the request plane when the peer asks) may call it. Work loops check
    ``is_cancelled`` or await ``wait_cancelled()``.
    """

    __slots__ = ("_cancelled", "metadata", "request_id", "trace", "traceparent")

    def __init__(self, request_id: str | None = None, traceparent: str = "") -> None:
        self.request_id = request_id or uuid.uuid4().hex
        self._cancelled: asyncio.Event | None = None
        #: The span the request's next spans are children of (``runtime.tracing``); None when
        #: the request is not traced in this process.
        self.trace: Any = None
        #: The W3C ``traceparent`` the request plane carries to the next process ("": none).
        self.traceparent = traceparent
        #: Facts gathered along the pipeline for the response and logs (e.g. the chosen
        #: ``worker_instance_id``, routing explanations, ``migrations``). Written by the
        #: operator that learns the fact; read by the frontend.
        self.metadata: dict[str, Any] = {}

    def _event(self) -> asyncio.Event:
        if self._cancelled is None:
            self._cancelled = asyncio.Event()
        return self._cancelled

    def cancel(self) -> None:
        self._event().set()

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled is not None and self._cancelled.is_set()

    async def wait_cancelled(self) -> None:
        await self._event().wait()

    def child(self) -> RequestContext:
        """A context with the same id and trace (for a re-issued request, e.g. on migration)."""
        child = RequestContext(self.request_id, self.traceparent)
        child.trace = self.trace
        return child
