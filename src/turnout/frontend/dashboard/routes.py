"""``GET /dashboard`` (the page; ``?fragment=1``: its live part alone, which the page's script
fetches) and ``GET /dashboard/state.json`` (the same snapshot as JSON, for scripts), and the
sampler that feeds the latency history while the frontend runs."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import re

import msgspec

from turnout.frontend.access.principal import Principal
from turnout.frontend.dashboard.fleet import FleetView
from turnout.frontend.dashboard.page import SCRIPT, render_live, render_page
from turnout.frontend.http.admin import Handler
from turnout.frontend.http.errors import HttpError
from turnout.frontend.openai.chunk_writer import JSON_HEADERS
from turnout.runtime.http import Exchange, Scope

log = logging.getLogger("turnout.frontend")

DASHBOARD = "/dashboard"
DASHBOARD_STATE = "/dashboard/state.json"

_json = msgspec.json.Encoder()
#: The page runs its one inline script and nothing else; it fetches only from its origin.
_CSP = (
    "default-src 'none'; "
    f"script-src 'sha256-{base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()}'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
_HTML_HEADERS = [
    ("content-type", "text/html; charset=utf-8"),
    ("cache-control", "no-store"),
    ("content-security-policy", _CSP),
    ("x-content-type-options", "nosniff"),
]
_FRAGMENT = re.compile(r"fragment=(1|true)")


class DashboardRoutes:
    """The dashboard's routes over a ``FleetView``."""

    def __init__(self, view: FleetView) -> None:
        self.view = view

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {("GET", DASHBOARD): self._page, ("GET", DASHBOARD_STATE): self._state}

    async def run(self) -> None:
        """Take a latency point every ``history.interval_s`` seconds until cancelled."""
        history = self.view.history
        while True:
            await asyncio.sleep(history.interval_s)
            try:
                history.sample()
            except Exception:  # a bug here must not stop the points for good
                log.exception("dashboard: taking a latency point failed")

    async def _page(self, scope: Scope, proto: Exchange, _: Principal) -> None:
        query = scope.query_string
        if query and not _FRAGMENT.fullmatch(query):
            raise HttpError(
                400, f"{DASHBOARD} takes only the query 'fragment=1', got {query!r}", param="query"
            )
        snapshot = self.view.snapshot()
        body = render_live(snapshot) if query else render_page(snapshot)
        proto.response_bytes(200, _HTML_HEADERS, body.encode())

    async def _state(self, scope: Scope, proto: Exchange, _: Principal) -> None:
        if scope.query_string:
            raise HttpError(400, f"{DASHBOARD_STATE} takes no query", param="query")
        proto.response_bytes(200, JSON_HEADERS, _json.encode(self.view.snapshot()))
