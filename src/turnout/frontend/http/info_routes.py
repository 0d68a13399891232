"""The routes that describe the frontend: ``GET /v1/models``, ``/health``, ``/live``,
``/metrics`` and ``/openapi.json``.

``/health`` is 200 while every model has an instance (and, under disaggregation, its prefill
side is ready), else 503 with the same body: the state of the whole deployment, for people and
monitors. ``/ready`` is the readiness of this frontend, for load balancers and Kubernetes: 200
while some model has a live instance, so one model losing its workers does not take every
frontend out of its Service and with it the models that still have theirs. While the frontend
drains (SIGTERM) both are 503 with ``"status": "draining"``, so a load balancer stops sending
before the listener closes. ``/live`` is 200 while the process answers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from turnout.frontend.access.principal import Principal
from turnout.frontend.http.admin import Handler
from turnout.frontend.metrics.frontend import CONTENT_TYPE, FrontendMetrics
from turnout.frontend.models.manager import KIND_ROUTES, ModelKind, ModelManager
from turnout.frontend.models.pipeline import TokensPipeline
from turnout.frontend.openai.chunk_writer import JSON_HEADERS
from turnout.protocols.openai import ModelList, ModelObject
from turnout.runtime.http import Exchange, Scope

_json = msgspec.json.Encoder()

#: Routes of other APIs that a token-input chat model serves (text-input ones are refused
#: there: the worker, not the frontend, templates their requests).
CHAT_SURFACE_ROUTES = ["/v1/responses", "/v1/messages", "/v1/messages/count_tokens"]


class InfoRoutes:
    """The describing routes' handlers; ``routes`` maps (method, path) to them."""

    def __init__(
        self,
        manager: ModelManager,
        metrics: FrontendMetrics,
        openapi_body: bytes,
        prefill_health: Callable[[str], dict[str, Any] | None] | None = None,
        draining: Callable[[], bool] | None = None,
    ) -> None:
        """``prefill_health``: a model's disaggregated-serving state for ``/health`` (None:
        none to report); ``draining``: whether the frontend is draining (None: never)."""
        self.manager = manager
        self.metrics = metrics
        self._openapi_body = openapi_body
        self._prefill_health = prefill_health
        self._draining = draining

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/live"): self._live,
            ("GET", "/ready"): self._ready,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/openapi.json"): self._openapi,
        }

    async def _models(self, scope: Scope, proto: Exchange, _: Principal) -> None:
        manager = self.manager
        models = [
            ModelObject(
                id=name, created=manager.created(name), root=name, endpoints=self._routes_of(name)
            )
            for name in manager.list_models()
        ]
        if manager.lora is not None:  # loaded LoRA adapters, vLLM's way
            models += [
                ModelObject(
                    id=name,
                    created=manager.created(base),
                    root=name,
                    parent=base,
                    endpoints=self._routes_of(base),
                )
                for name, base in manager.lora.listed()
            ]
        proto.response_bytes(200, JSON_HEADERS, _json.encode(ModelList(data=models)))

    def _routes_of(self, name: str) -> list[str]:
        """The generation routes that serve ``name``: its kinds' own, and for a chat model
        the other APIs' routes its pipeline serves (token-input models only)."""
        routes = []
        for kind in self.manager.kinds(name):
            routes.append(KIND_ROUTES[kind])
            if kind is ModelKind.CHAT and isinstance(
                self.manager.get_engine(kind, name), TokensPipeline
            ):
                routes += CHAT_SURFACE_ROUTES
        return routes

    async def _health(self, scope: Scope, proto: Exchange, _: Principal) -> None:
        models = []
        for name in self.manager.list_models():
            instances = self.manager.model_instances(name)
            entry: dict[str, Any] = {"name": name, "instances": [f"{i:x}" for i in instances]}
            disagg = self._prefill_health(name) if self._prefill_health is not None else None
            if disagg is not None:
                entry["disaggregation"] = disagg
            models.append(entry)
        healthy = bool(models) and all(
            m["instances"] and m.get("disaggregation", {}).get("ready", True) for m in models
        )
        status = "healthy" if healthy else "unhealthy"
        if self._draining is not None and self._draining():
            healthy, status = False, "draining"
        body = {"status": status, "models": models}
        proto.response_bytes(200 if healthy else 503, JSON_HEADERS, _json.encode(body))

    async def _ready(self, scope: Scope, proto: Exchange, _: Principal) -> None:
        serving = [n for n in self.manager.list_models() if self.manager.model_instances(n)]
        if self._draining is not None and self._draining():
            code, body = 503, {"status": "draining", "models_serving": len(serving)}
        elif serving:
            code, body = 200, {"status": "ready", "models_serving": len(serving)}
        else:
            code, body = 503, {"status": "not_ready", "models_serving": 0}
        proto.response_bytes(code, JSON_HEADERS, _json.encode(body))

    async def _live(self, scope: Scope, proto: Exchange, _: Principal) -> None:
        proto.response_bytes(200, JSON_HEADERS, b'{"status":"live"}')

    async def _openapi(self, scope: Scope, proto: Exchange, _: Principal) -> None:
        proto.response_bytes(200, JSON_HEADERS, self._openapi_body)

    async def _metrics(self, scope: Scope, proto: Exchange, _: Principal) -> None:
        proto.response_bytes(200, [("content-type", CONTENT_TYPE)], self.metrics.render())
