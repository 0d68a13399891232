"""The control routes: ``GET``/``POST /busy_threshold`` (``admission.busy_threshold``) and
``GET /admin/usage`` (each tenant's prompt, cached and output tokens, from
``access.usage``).

Once credentials are configured they need an admin key (the service checks it before a
handler runs; a refused caller is audited too). Every ``POST`` is one audit line
(``access.audit``): who, what, from where, the state before and after.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec

from turnout.frontend.access.accounting import UsageRecorder
from turnout.frontend.access.audit import AuditLog
from turnout.frontend.access.principal import Principal
from turnout.frontend.admission.busy_threshold import BusyThresholds
from turnout.frontend.openai.chunk_writer import JSON_HEADERS
from turnout.runtime.http import Exchange, Scope

_json = msgspec.json.Encoder()

BUSY_THRESHOLD = "/busy_threshold"
USAGE = "/admin/usage"

#: A route's handler: the request, and who it speaks for.
Handler = Callable[[Scope, Exchange, Principal], Awaitable[None]]
#: Reads a request's body under the service's size limit.
ReadBody = Callable[[Scope, Exchange], Awaitable[bytes]]


class AdminRoutes:
    """The control routes' handlers; ``routes`` maps (method, path) to them."""

    def __init__(
        self,
        read_body: ReadBody,
        audit: AuditLog,
        *,
        busy_thresholds: BusyThresholds | None = None,
        usage: UsageRecorder | None = None,
    ) -> None:
        """``busy_thresholds`` None: no routers to tune (no ``/busy_threshold``);
        ``usage`` None: no usage accounting (no ``/admin/usage``)."""
        self._read_body = read_body
        self.audit = audit
        self._busy = busy_thresholds
        self._usage = usage

    def routes(self) -> dict[tuple[str, str], Handler]:
        routes: dict[tuple[str, str], Handler] = {}
        if self._busy is not None:
            routes[("GET", BUSY_THRESHOLD)] = self._busy_threshold_get
            routes[("POST", BUSY_THRESHOLD)] = self._busy_threshold_post
        if self._usage is not None:
            routes[("GET", USAGE)] = self._usage_get
        return routes

    async def _busy_threshold_get(self, scope: Scope, proto: Exchange, who: Principal) -> None:
        assert self._busy is not None
        proto.response_bytes(200, JSON_HEADERS, _json.encode(self._busy.get_all()))

    async def _busy_threshold_post(self, scope: Scope, proto: Exchange, who: Principal) -> None:
        busy = self._busy
        assert busy is not None
        body = await self._read_body(scope, proto)
        before = busy.get_all()
        answer = busy.post(body)
        self.audit.record(
            who,
            method="POST",
            route=BUSY_THRESHOLD,
            client=scope.client,
            before=before,
            after=busy.get_all(),
        )
        proto.response_bytes(200, JSON_HEADERS, _json.encode(answer))

    async def _usage_get(self, scope: Scope, proto: Exchange, who: Principal) -> None:
        assert self._usage is not None
        body = {"tenants": self._usage.snapshot()}
        proto.response_bytes(200, JSON_HEADERS, _json.encode(body))
