"""The routes of the response store, whose paths carry ids (``HttpService`` reaches them by
prefix, after its exact routes miss)::

    GET    /v1/responses/{id}                    the stored response (Response)
    DELETE /v1/responses/{id}                    {"id", "object": "response.deleted", "deleted"}
    GET    /v1/responses/{id}/input_items        its input items (a list page)
    POST   /v1/conversations                     create (Conversation)
    GET    /v1/conversations/{id}                read (Conversation)
    POST   /v1/conversations/{id}                replace its metadata (Conversation)
    DELETE /v1/conversations/{id}                {"id", "object": "conversation.deleted", ...}
    GET    /v1/conversations/{id}/items          its items (a list page)
    POST   /v1/conversations/{id}/items          add items (a list of those added)
    GET    /v1/conversations/{id}/items/{item}   one item
    DELETE /v1/conversations/{id}/items/{item}   remove it (Conversation)

List pages are OpenAI's: ``{"object": "list", "data", "first_id", "last_id", "has_more"}``,
with the query parameters ``after`` (an item id), ``limit`` (1-100, default 20) and
``order`` (``asc`` or ``desc``, the default). ``include`` names extra fields OpenAI can add to
items (log-probs, image URLs, encrypted reasoning); turnout stores none of them, so any value
is a 400 naming it, as is any other query parameter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any
from urllib.parse import parse_qsl

import msgspec

from turnout.errors import RequestError
from turnout.frontend.access.principal import Principal
from turnout.frontend.http.errors import HttpError
from turnout.frontend.http.surface import decode_json
from turnout.frontend.openai.chunk_writer import JSON_HEADERS
from turnout.frontend.responses.history import ResponseHistory, store_tenant
from turnout.runtime.http import Exchange, Scope

RESPONSES_PREFIX = "/v1/responses/"
CONVERSATIONS = "/v1/conversations"
CONVERSATIONS_PREFIX = CONVERSATIONS + "/"
#: (method, OpenAPI path template) of every route here but ``POST /v1/conversations``,
#: which is an exact route of the service.
STORE_ROUTES = (
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("GET", "/v1/responses/{response_id}/input_items"),
    ("GET", "/v1/conversations/{conversation_id}"),
    ("POST", "/v1/conversations/{conversation_id}"),
    ("DELETE", "/v1/conversations/{conversation_id}"),
    ("GET", "/v1/conversations/{conversation_id}/items"),
    ("POST", "/v1/conversations/{conversation_id}/items"),
    ("GET", "/v1/conversations/{conversation_id}/items/{item_id}"),
    ("DELETE", "/v1/conversations/{conversation_id}/items/{item_id}"),
)
#: OpenAI's page size bounds.
DEFAULT_LIMIT, MAX_LIMIT = 20, 100

_json = msgspec.json.Encoder()


class ConversationCreateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/conversations``. ``safety_identifier``: checked as a string and kept
    nowhere (turnout runs no abuse monitoring), as on ``/v1/responses``."""

    items: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None


class ConversationUpdateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/conversations/{id}``: the metadata that replaces the conversation's."""

    metadata: dict[str, str] | None


class ConversationItemsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/conversations/{id}/items``."""

    items: list[dict[str, Any]]


_create_decoder = msgspec.json.Decoder(ConversationCreateRequest)
_update_decoder = msgspec.json.Decoder(ConversationUpdateRequest)
_items_decoder = msgspec.json.Decoder(ConversationItemsRequest)

ReadBody = Callable[[Scope, Exchange], Awaitable[bytes]]


class StoreRoutes:
    """Serves the routes above from ``history``; ``read_body``: the service's bounded body
    reader (413 past ``--max-body-bytes``). Each request reads and writes its principal's
    tenant's records only (``history.store_tenant``)."""

    def __init__(self, history: ResponseHistory, read_body: ReadBody) -> None:
        self.history = history
        self._read_body = read_body

    async def responses(
        self, scope: Scope, proto: Exchange, path: str, principal: Principal
    ) -> None:
        """``/v1/responses/...``."""
        with _as_http_errors():
            await self._responses(scope, proto, path, store_tenant(principal))

    async def create_conversation(
        self, scope: Scope, proto: Exchange, principal: Principal
    ) -> None:
        """``POST /v1/conversations`` (an exact route)."""
        with _as_http_errors():
            _query(scope)
            body = decode_json(_create_decoder, await self._read_body(scope, proto))
            conversation = await self.history.create_conversation(
                store_tenant(principal), body.metadata, body.items
            )
            _send(proto, conversation)

    async def conversations(
        self, scope: Scope, proto: Exchange, path: str, principal: Principal
    ) -> None:
        """``/v1/conversations/...``."""
        with _as_http_errors():
            await self._conversations(scope, proto, path, store_tenant(principal))

    async def _responses(self, scope: Scope, proto: Exchange, path: str, tenant: str) -> None:
        parts = path[len(RESPONSES_PREFIX) :].split("/")
        history = self.history
        if len(parts) == 1 and parts[0]:
            response_id = parts[0]
            if scope.method == "GET":
                _query(scope, stream=_false, include_obfuscation=_bool)
                record = await history.get_response(tenant, response_id)
                return _send(proto, record.response)
            if scope.method == "DELETE":
                _query(scope)
                await history.delete_response(tenant, response_id)
                body = {"id": response_id, "object": "response.deleted", "deleted": True}
                return _send(proto, body)
            raise _not_allowed(scope, path)
        if len(parts) == 2 and parts[0] and parts[1] == "input_items":
            if scope.method != "GET":
                raise _not_allowed(scope, path)
            query = _query(scope, **_PAGE)
            items = await history.input_items(tenant, parts[0])
            return _send(proto, _page(items, query))
        raise _unknown(scope, path)

    async def _conversations(self, scope: Scope, proto: Exchange, path: str, tenant: str) -> None:
        parts = path[len(CONVERSATIONS_PREFIX) :].split("/")
        history = self.history
        method = scope.method
        if not parts[0] or len(parts) > 3 or (len(parts) > 1 and parts[1] != "items"):
            raise _unknown(scope, path)
        conversation_id = parts[0]
        if len(parts) == 1:
            if method == "GET":
                _query(scope)
                return _send(proto, await history.get_conversation(tenant, conversation_id))
            if method == "POST":
                _query(scope)
                update = decode_json(_update_decoder, await self._read_body(scope, proto))
                updated = await history.update_conversation(
                    tenant, conversation_id, update.metadata
                )
                return _send(proto, updated)
            if method == "DELETE":
                _query(scope)
                await history.delete_conversation(tenant, conversation_id)
                deleted = {"id": conversation_id, "object": "conversation.deleted",
                           "deleted": True}  # fmt: skip
                return _send(proto, deleted)
            raise _not_allowed(scope, path)
        if len(parts) == 2:
            if method == "GET":
                query = _query(scope, **_PAGE)
                items = await history.conversation_items(tenant, conversation_id)
                return _send(proto, _page(items, query))
            if method == "POST":
                _query(scope, include=_include)
                adding = decode_json(_items_decoder, await self._read_body(scope, proto))
                added = await history.add_conversation_items(tenant, conversation_id, adding.items)
                return _send(proto, _page(added, {"order": "asc", "limit": len(added)}))
            raise _not_allowed(scope, path)
        item_id = parts[2]
        if not item_id:
            raise _unknown(scope, path)
        if method == "GET":
            _query(scope, include=_include)
            return _send(proto, await history.conversation_item(tenant, conversation_id, item_id))
        if method == "DELETE":
            _query(scope)
            conversation = await history.delete_conversation_item(tenant, conversation_id, item_id)
            return _send(proto, conversation)
        raise _not_allowed(scope, path)


@contextlib.contextmanager
def _as_http_errors() -> Iterator[None]:
    """A request the store cannot honour (``RequestError``) as its 400, naming the field."""
    try:
        yield
    except RequestError as exc:
        raise HttpError(400, str(exc), param=exc.param) from None


# ---------------------------------------------------------------------- query parameters

#: A query parameter's check: its values (a repeated parameter has several) -> its value.
_Check = Callable[[str, list[str]], Any]


def _one(name: str, values: list[str]) -> str:
    if len(values) != 1:
        raise RequestError(f"query parameter '{name}' is given {len(values)} times", param=name)
    return values[0]


def _limit(name: str, values: list[str]) -> int:
    text = _one(name, values)
    if not text.isdigit() or not 1 <= int(text) <= MAX_LIMIT:
        raise RequestError(f"'{name}' must be an integer from 1 to {MAX_LIMIT}", param=name)
    return int(text)


def _order(name: str, values: list[str]) -> str:
    text = _one(name, values)
    if text not in ("asc", "desc"):
        raise RequestError(f"'{name}' must be 'asc' or 'desc'", param=name)
    return text


def _include(name: str, values: list[str]) -> list[str]:
    wanted = [v for v in values if v]
    if wanted:
        raise RequestError(
            f"'include' {wanted} is not supported: turnout stores no log-probs, image URLs, "
            "tool results or encrypted reasoning to add to items",
            param="include",
        )
    return []


def _bool(name: str, values: list[str]) -> bool:
    text = _one(name, values)
    if text not in ("true", "false"):
        raise RequestError(f"'{name}' must be true or false", param=name)
    return text == "true"


def _false(name: str, values: list[str]) -> bool:
    """``stream`` on a stored response: only ``false`` (a stored response is finished;
    turnout runs no background responses to stream again)."""
    if _bool(name, values):
        raise RequestError(
            "stored responses are finished: 'stream' must be false (turnout runs no "
            "background responses)",
            param=name,
        )
    return False


_PAGE: dict[str, _Check] = {"after": _one, "limit": _limit, "order": _order, "include": _include}


def _query(scope: Scope, **checks: _Check) -> dict[str, Any]:
    """The request's query parameters, each checked; a 400 naming any other. A list
    parameter may be spelled ``name[]`` (as the ``openai`` client writes it)."""
    values: dict[str, list[str]] = {}
    for name, value in parse_qsl(scope.query_string, keep_blank_values=True):
        values.setdefault(name.removesuffix("[]"), []).append(value)
    out = {}
    for name, given in values.items():
        check = checks.get(name)
        if check is None:
            raise RequestError(
                f"unrecognized query parameter: {name} (turnout does not support it, and "
                "does not ignore what it cannot honour)",
                param=name,
            )
        out[name] = check(name, given)
    return out


def _page(items: list[dict[str, Any]], query: dict[str, Any]) -> dict[str, Any]:
    """One page of ``items`` (oldest first) in OpenAI's list shape."""
    ordered = items if query.get("order", "desc") == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise RequestError(f"'after': no item '{after}' in this list", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    limit = query.get("limit", DEFAULT_LIMIT)
    data = ordered[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else "",
        "last_id": data[-1]["id"] if data else "",
        "has_more": len(ordered) > limit,
    }


# ---------------------------------------------------------------------- replies


def _send(proto: Exchange, body: dict[str, Any]) -> None:
    proto.response_bytes(200, JSON_HEADERS, _json.encode(body))


def _unknown(scope: Scope, path: str) -> HttpError:
    return HttpError(404, f"no route for {scope.method} {path}", code="unknown_url")


def _not_allowed(scope: Scope, path: str) -> HttpError:
    return HttpError(405, f"method {scope.method} not allowed on {path}", code="method_not_allowed")
