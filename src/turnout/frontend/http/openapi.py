"""The frontend's OpenAPI 3.1 document, served at ``GET /openapi.json``.

Request bodies are the JSON schemas of the very msgspec structs the frontend decodes, so the
document cannot drift from what is accepted; responses list every status a route can answer
(what API testers such as schemathesis hold the frontend to), with OpenAI's error body.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import msgspec

from turnout import __version__
from turnout.frontend.admission.busy_threshold import BusyThresholdRequest
from turnout.frontend.anthropic.request import CountTokensRequest, MessagesRequest
from turnout.frontend.responses.request import ResponsesRequest
from turnout.frontend.responses.store_routes import (
    ConversationCreateRequest,
    ConversationItemsRequest,
    ConversationUpdateRequest,
)
from turnout.frontend.unary.tensor import TensorInferRequest, TensorInferResponse
from turnout.protocols.openai import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    EmbeddingsRequest,
    EmbeddingsResponse,
    ErrorResponse,
    ModelList,
)

_REF = "#/components/schemas/{name}"
#: Statuses every generation route may answer besides 200 (see ``http.errors``).
_GENERATION_ERRORS = {
    "400": "invalid request (the message and ``param`` say which field)",
    "404": "unknown model, or pinned instance",
    "413": "request body too large",
    "429": "admission limit (``--reject-status 429``)",
    "500": "the worker failed the request",
    "502": "a worker's answer did not decode",
    "503": "no instance can take the request now, or an admission limit",
    "504": "the request's deadline passed",
    "529": "admission limit (``--reject-status 529``)",
}


def build_openapi(
    *,
    busy_thresholds: bool = True,
    usage: bool = False,
    open_paths: Collection[str] | None = None,
) -> dict[str, Any]:
    """The document; ``busy_thresholds``: whether the ``/busy_threshold`` routes exist;
    ``usage``: whether ``/admin/usage`` does; ``open_paths``: with credentials configured,
    the paths callers reach without one (every other route may answer 401, the control
    routes 403); None: no credentials, every route open."""
    _, schemas = msgspec.json.schema_components(
        [
            ChatCompletionRequest,
            CompletionRequest,
            ChatCompletionResponse,
            CompletionResponse,
            ModelList,
            ErrorResponse,
            BusyThresholdRequest,
            ResponsesRequest,
            MessagesRequest,
            CountTokensRequest,
            EmbeddingsRequest,
            EmbeddingsResponse,
            TensorInferRequest,
            TensorInferResponse,
            ConversationCreateRequest,
            ConversationUpdateRequest,
            ConversationItemsRequest,
        ],
        ref_template=_REF,
    )
    paths: dict[str, Any] = {
        "/v1/chat/completions": {
            "post": _generation(
                "Chat completion", "ChatCompletionRequest", "ChatCompletionResponse"
            )
        },
        "/v1/completions": {
            "post": _generation("Completion", "CompletionRequest", "CompletionResponse")
        },
        "/v1/responses": {
            "post": _generation(
                "Response (OpenAI's Responses API; stored unless store is false)",
                "ResponsesRequest",
                None,
                stream="SSE semantic events (event: + data: lines), the last response.completed",
            )
        },
        "/v1/messages": {
            "post": _generation(
                "Message (Anthropic's Messages API)",
                "MessagesRequest",
                None,
                stream="Anthropic's SSE events (event: + data: lines), the last message_stop",
                anthropic=True,
            )
        },
        "/v1/messages/count_tokens": {
            "post": _generation(
                "The prompt tokens of a message request (Anthropic's count_tokens)",
                "CountTokensRequest",
                None,
                anthropic=True,
                streams=False,
            )
        },
        "/v1/embeddings": {
            "post": _generation(
                "Embeddings of one or more inputs",
                "EmbeddingsRequest",
                "EmbeddingsResponse",
                streams=False,
            )
        },
        "/v1/tensor": {
            "post": _generation(
                "Named output tensors of a tensor model (KServe v2's inference request)",
                "TensorInferRequest",
                "TensorInferResponse",
                streams=False,
            )
        },
        "/v1/models": {
            "get": {
                "summary": "The served models",
                "responses": {"200": _json_response("the models", _ref("ModelList"))},
            }
        },
        "/health": {
            "get": {
                "summary": "Each model and its live instances",
                "responses": {
                    "200": _json_response("every model has live instances", {"type": "object"}),
                    "503": _json_response("a model has none, or no model", {"type": "object"}),
                },
            }
        },
        "/ready": {
            "get": {
                "summary": "This frontend can serve: some model has a live instance",
                "responses": {
                    "200": _json_response("some model has a live instance", {"type": "object"}),
                    "503": _json_response("no model has one, or draining", {"type": "object"}),
                },
            }
        },
        "/live": {
            "get": {
                "summary": "The process is up",
                "responses": {"200": _json_response("live", {"type": "object"})},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {
                        "description": "text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/metrics/targets": {
            "get": {
                "summary": "Prometheus HTTP service discovery: every frontend's and worker's "
                "metrics endpoint",
                "responses": {
                    "200": _json_response("[{targets, labels}]", {"type": "array"}),
                    "503": _error("the discovery store did not answer"),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {"200": _json_response("OpenAPI 3.1", {"type": "object"})},
            }
        },
        "/dashboard": {
            "get": {
                "summary": "The live dashboard page (HTML; ?fragment=1: its live part alone)",
                "parameters": [
                    {
                        "name": "fragment",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": ["1", "true"]},
                    }
                ],
                "responses": {
                    "200": {
                        "description": "the page",
                        "content": {"text/html": {"schema": {"type": "string"}}},
                    },
                    "400": _error("an unknown query"),
                },
            }
        },
        "/dashboard/state.json": {
            "get": {
                "summary": "What the dashboard shows, as JSON",
                "responses": {
                    "200": _json_response("the fleet snapshot", {"type": "object"}),
                    "400": _error("a query"),
                },
            }
        },
    }
    paths.update(_store_paths())
    if busy_thresholds:
        errors = {
            "400": _error("invalid thresholds, or a model not routed by kv"),
            "404": _error("unknown model"),
            "413": _error("request body too large"),
        }
        paths["/busy_threshold"] = {
            "get": {
                "summary": "Every model's busy thresholds",
                "responses": {"200": _json_response("thresholds", {"type": "object"})},
            },
            "post": {
                "summary": "Read or change one model's busy thresholds",
                "requestBody": _json_body("BusyThresholdRequest"),
                "responses": {
                    "200": _json_response("the model's thresholds", {"type": "object"}),
                    **errors,
                },
            },
        }
    if usage:
        paths["/admin/usage"] = {
            "get": {
                "summary": "Each tenant's requests and prompt, cached and output tokens",
                "responses": {"200": _json_response("usage by tenant", {"type": "object"})},
            }
        }
    components: dict[str, Any] = {"schemas": schemas}
    if open_paths is not None:
        _secure(paths, open_paths)
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": "turnout", "version": __version__},
        "paths": paths,
        "components": components,
    }


def _secure(paths: dict[str, Any], open_paths: Collection[str]) -> None:
    """Every operation outside ``open_paths``: a credential needed (401 without one); the
    control routes: an admin's (403 for another)."""
    for path, operations in paths.items():
        if path in open_paths:
            continue
        for operation in operations.values():
            responses = operation["responses"]
            responses["401"] = _error("missing or invalid API key")
            if path == "/busy_threshold" or path.startswith("/admin/"):
                responses["403"] = _error("the key is not an admin's")
            operation["security"] = [{"bearer": []}, {"apiKey": []}]


#: Statuses every route of the response store may answer besides 200.
_STORE_ERRORS = {
    "400": "an invalid query parameter or body (``param`` names it)",
    "404": "no such response, conversation or item (or --response-store off)",
    "503": "the response store failed or did not answer in time",
}


def _store_paths() -> dict[str, Any]:
    """The response store's routes (``responses.store_routes``)."""
    response = {"name": "response_id", "in": "path", "required": True,
                "schema": {"type": "string"}}  # fmt: skip
    conversation = {**response, "name": "conversation_id"}
    item = {**response, "name": "item_id"}
    include = {"name": "include", "in": "query", "required": False,
               "description": "not supported: any value is a 400",
               "schema": {"type": "array", "items": {"type": "string"}}}  # fmt: skip
    page = [
        {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
        {"name": "limit", "in": "query", "required": False,
         "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
        {"name": "order", "in": "query", "required": False,
         "schema": {"type": "string", "enum": ["asc", "desc"]}},
        include,
    ]  # fmt: skip
    stream = {"name": "stream", "in": "query", "required": False,
              "description": "only false: stored responses are finished",
              "schema": {"type": "boolean"}}  # fmt: skip

    def op(summary: str, params: list[dict[str, Any]], body: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "summary": summary,
            "parameters": params,
            "responses": {
                "200": _json_response(summary, {"type": "object"}),
                **{status: _error(why) for status, why in _STORE_ERRORS.items()},
            },
        }
        if body is not None:
            out["requestBody"] = _json_body(body)
            out["responses"]["413"] = _error("request body too large")
        return out

    return {
        "/v1/responses/{response_id}": {
            "get": op("A stored response", [response, stream]),
            "delete": op("Delete a stored response", [response]),
        },
        "/v1/responses/{response_id}/input_items": {
            "get": op("The items a stored response was made from", [response, *page]),
        },
        "/v1/conversations": {
            "post": op("Create a conversation", [], "ConversationCreateRequest"),
        },
        "/v1/conversations/{conversation_id}": {
            "get": op("A conversation", [conversation]),
            "post": op(
                "Replace a conversation's metadata", [conversation], "ConversationUpdateRequest"
            ),
            "delete": op("Delete a conversation and its items", [conversation]),
        },
        "/v1/conversations/{conversation_id}/items": {
            "get": op("A conversation's items (a list page)", [conversation, *page]),
            "post": op(
                "Add items to a conversation", [conversation, include], "ConversationItemsRequest"
            ),
        },
        "/v1/conversations/{conversation_id}/items/{item_id}": {
            "get": op("One item of a conversation", [conversation, item, include]),
            "delete": op("Remove an item (answers the conversation)", [conversation, item]),
        },
    }


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _json_response(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json_response(description, _ref("ErrorResponse"))


def _anthropic_error(description: str) -> dict[str, Any]:
    schema = {
        "type": "object",
        "description": 'Anthropic\'s error body: {"type": "error", "error": {"type", "message"}}',
    }
    return _json_response(description, schema)


def _json_body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(name)}}}


def _generation(
    summary: str,
    request: str,
    response: str | None,
    *,
    stream: str = "SSE chunks, then data: [DONE]",
    anthropic: bool = False,
    streams: bool = True,
) -> dict[str, Any]:
    """A generation route; ``response``: the whole body's schema (None: an object);
    ``anthropic``: errors have Anthropic's body."""
    schema = _ref(response) if response else {"type": "object"}
    ok = _json_response(f"{summary} (not streamed)" if streams else summary, schema)
    if streams:
        ok["content"]["text/event-stream"] = {"schema": {"type": "string", "description": stream}}
    error = _anthropic_error if anthropic else _error
    return {
        "summary": f"{summary}, streamed (SSE) or not" if streams else summary,
        "requestBody": _json_body(request),
        "responses": {
            "200": ok,
            **{status: error(why) for status, why in _GENERATION_ERRORS.items()},
        },
    }
