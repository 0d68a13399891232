"""A process's system endpoint: ``/live``, ``/health`` and ``/metrics`` on a port of its own,
for Kubernetes probes and Prometheus (``turnout worker`` and ``turnout attach``
``--system-port``). Workers serve requests on the request plane, not over HTTP, so without
this nothing outside the process could ask whether it is alive or ready.

* ``GET /live``: 200 ``{"status": "live"}`` while the event loop runs (it answers from it).
* ``GET /health``: 200 ``{"status": "ready", "checks": {...}}`` when every check passes, else
  503 ``{"status": "not_ready", "checks": {part: why}}``. From ``drain()`` on (a graceful
  stop) it is 503 ``{"status": "draining"}`` whatever the checks say, so a probe sees the
  process leave before its listener closes.
* ``GET /metrics``: the Prometheus text of the collectors given, with the process metrics and
  the build line (``process_metrics``).
* Any other path is 404; another method on these paths is 405 (with ``Allow``); both answer
  a JSON error body.

It runs on ``runtime.http``'s server, with tighter bounds than a public API needs (small
headers, short deadlines, few connections): only probes and scrapers talk to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from turnout.errors import ConfigError
from turnout.runtime.http import Exchange, HttpLimits, HttpServer, Scope
from turnout.runtime.http.wire import error_body

from .process_metrics import register_process_metrics

log = logging.getLogger("turnout.system")

#: A readiness check: each part of the process (``discovery``, ``engine``) and why it is not
#: ready, or None where it is.
Checks = Callable[[], dict[str, str | None]]

#: Bounds of the system endpoint's connections: probes and scrapers send small requests.
SYSTEM_LIMITS = HttpLimits(
    header_timeout=5.0,
    body_timeout=5.0,
    keepalive_timeout=30.0,
    write_timeout=10.0,
    max_connections=64,
    max_header_bytes=8 * 1024,
    max_buffered_body=16 * 1024,
    max_pipelined=4,
    backlog=64,
)

_JSON = [("content-type", "application/json")]
_ROUTES = ("/live", "/health", "/metrics")
_json = msgspec.json.Encoder()


class SystemServer:
    """The system endpoint of one process; see the module's docstring."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        component: str,
        checks: Checks,
        collectors: Iterable[Collector] = (),
        details: Callable[[], dict[str, Any]] | None = None,
        routes: dict[str, Callable[[], Any]] | None = None,
    ) -> None:
        """``details``: more of ``/health``'s body (e.g. the instance ids), ready or not.
        ``routes``: more GET routes, each answering the JSON of what its function returns."""
        self._checks = checks
        self._routes = dict(routes or {})
        self._details = details
        self.registry = CollectorRegistry()
        register_process_metrics(self.registry, component)
        for collector in collectors:
            self.registry.register(collector)
        self._server = HttpServer(self._serve, host, port, limits=SYSTEM_LIMITS)
        #: Set by ``drain``: ``/health`` answers 503 from then on.
        self.draining = False

    @property
    def address(self) -> str:
        """``http://host:port``, the port as bound (``port`` 0 asks for a free one)."""
        host = self._server.host
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self._server.port}"

    async def start(self) -> None:
        """Listen; one line logs the address (with the port bound, when 0 was asked)."""
        try:
            await self._server.start()
        except OSError as exc:
            raise ConfigError(
                f"--system-port: cannot listen on {self._server.host}:{self._server.port}: "
                f"{exc.strerror or exc}"
            ) from None
        log.info("system endpoint at %s (/live, /health, /metrics)", self.address)

    def drain(self) -> None:
        """The process is stopping: ``/health`` answers 503 ``draining`` from now on."""
        self.draining = True

    def stop(self) -> None:
        """Close the listener and the connections (those answering, after their answer)."""
        self._server.stop()

    def health(self) -> tuple[int, dict[str, Any]]:
        """``/health``'s status and body."""
        try:
            found = self._checks()
        except Exception as exc:  # a broken check is a part that is not ready, not a 500
            log.exception("readiness check failed")
            found = {"checks": f"the readiness check raised {exc!r}"}
        checks = {part: why or "ok" for part, why in found.items()}
        if self.draining:
            status = "draining"
        else:
            status = "ready" if all(why is None for why in found.values()) else "not_ready"
        body: dict[str, Any] = {"status": status, "checks": checks}
        if self._details is not None:
            body.update(self._details())
        return (200 if status == "ready" else 503), body

    async def _serve(self, scope: Scope, exchange: Exchange) -> None:
        path = scope.path
        if path not in _ROUTES and path not in self._routes:
            exchange.response_bytes(404, _JSON, error_body(f"no route {path}", "not_found"))
            return
        if scope.method != "GET":
            exchange.response_bytes(
                405,
                [*_JSON, ("allow", "GET")],
                error_body(f"{path} answers GET only", "method_not_allowed"),
            )
            return
        if path == "/live":
            exchange.response_bytes(200, _JSON, b'{"status":"live"}')
        elif path in self._routes:
            exchange.response_bytes(200, _JSON, _json.encode(self._routes[path]()))
        elif path == "/health":
            status, body = self.health()
            exchange.response_bytes(status, _JSON, _json.encode(body))
        else:
            exchange.response_bytes(
                200, [("content-type", CONTENT_TYPE_LATEST)], generate_latest(self.registry)
            )
