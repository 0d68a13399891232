"""vLLM's face: the OpenAI routes, and the routes around them of ``vllm serve``.

* ``GET /health``: 200 with an empty body while the engine runs, 503 once it failed
  (``vllm/entrypoints/serve/instrumentator/health.py``).
* ``POST /tokenize``: ``{"prompt"}`` or ``{"messages"}`` (templated) with
  ``add_special_tokens`` (default true for a prompt, false for messages),
  ``add_generation_prompt``, ``return_token_strs`` -> ``{"count", "max_model_len",
  "tokens", "token_strs"}``; ``POST /detokenize``: ``{"tokens"}`` -> ``{"prompt"}``
  (``vllm/entrypoints/serve/tokenize/protocol.py``).
* ``GET /version``, ``GET /ping``, ``GET /metrics`` (``metrics.VllmMetrics``).
"""

from __future__ import annotations

from typing import Any

from turnout.engines.mocker_server.app import (
    Routes,
    get_bool,
    get_int_list,
    read_json,
    send_json,
)
from turnout.engines.mocker_server.backend import MockerBackend
from turnout.engines.mocker_server.metrics import Api
from turnout.engines.mocker_server.openai_api import OpenAIRoutes
from turnout.frontend.http.errors import HttpError
from turnout.runtime.http import Exchange, Scope

#: What ``GET /version`` answers: a mocker, not a vLLM release.
VERSION = "0.0.0+turnout.mocker"


def register_vllm(routes: Routes, backend: MockerBackend) -> None:
    """Every route of the vLLM face."""
    openai = OpenAIRoutes(backend, Api.VLLM)
    openai.register(routes)
    face = _VllmRoutes(backend, openai)
    routes.add("GET", "/health", face.health)
    routes.add("GET", "/ping", face.health)
    routes.add("GET", "/version", face.version)
    routes.add("GET", "/metrics", face.metrics)
    routes.add("POST", "/tokenize", face.tokenize)
    routes.add("POST", "/detokenize", face.detokenize)


class _VllmRoutes:
    def __init__(self, backend: MockerBackend, openai: OpenAIRoutes) -> None:
        self.backend = backend
        self.openai = openai

    async def health(self, scope: Scope, exchange: Exchange) -> None:
        reason = self.backend.engine.health()
        if reason is None:
            exchange.response_bytes(200, [], b"")
        else:
            raise HttpError(
                503, f"engine unhealthy: {reason}", type="server_error", code="service_unavailable"
            )

    async def version(self, scope: Scope, exchange: Exchange) -> None:
        send_json(exchange, {"version": VERSION})

    async def metrics(self, scope: Scope, exchange: Exchange) -> None:
        exchange.response_bytes(
            200,
            [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
            self.backend.metrics.render(),
        )

    async def tokenize(self, scope: Scope, exchange: Exchange) -> None:
        body = await read_json(scope, exchange)
        self.openai.resolve_model(body)
        model = self.backend.model
        if "messages" in body:
            tokens = self.openai.chat_prompt(body)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise HttpError(400, "prompt must be a string", param="prompt")
            special = get_bool(body, "add_special_tokens", True)
            tokens = model.tokenizer.encode(prompt, add_special_tokens=special)
        strs: list[str] | None = None
        if get_bool(body, "return_token_strs"):
            strs = [model.tokenizer.id_to_token(t) or "" for t in tokens]
        response: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": model.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }
        send_json(exchange, response)

    async def detokenize(self, scope: Scope, exchange: Exchange) -> None:
        body = await read_json(scope, exchange)
        self.openai.resolve_model(body)
        tokens = get_int_list(body, "tokens")
        send_json(exchange, {"prompt": decode_checked(self.backend, tokens, "tokens")})


def decode_checked(
    backend: MockerBackend, tokens: list[int], param: str, *, skip_special_tokens: bool = True
) -> str:
    """The text of ``tokens``; 400 for an id outside the vocabulary."""
    vocab = backend.model.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise HttpError(400, f"token id {bad} is out of vocabulary (size {vocab})", param=param)
    return backend.model.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)
