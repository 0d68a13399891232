"""Stored responses and conversations: what ``/v1/responses`` keeps, how a chain continues, and
the reads and writes behind the store's routes (``store_routes``).

The mental model: a stored response is one turn, its record holding that turn's input items
(with ids), its final body (whose ``output`` holds the output items) and the ids of the turns
before it (``ancestors``, root first). Continuing a chain (``previous_response_id``) reads the
previous turn and then its ancestors, two reads whatever the chain's length, and replays every
turn's input and output items before the new input, which then runs as chat, as a request
that carried all those items would. A conversation is a mutable list of items instead: a
response created in it replays the list, and appends its input and output to it when done.

What lives how long: every record expires ``ttl`` seconds after its last write. Continuing a
chain moves its ancestors' expiry to the new turn's, so a chain in use never loses its start;
adding to a conversation (or updating it) moves the conversation's. A record larger than
``max_record_bytes`` is not stored (the response says ``store: false``), so one response
cannot fill the store. Every store call has a deadline (``STORE_DEADLINE_S``); a store that
fails or does not answer makes the store's routes answer 503, and a finished response that
cannot be stored is still delivered, with ``store: false``.

Tenants: every record belongs to the tenant of the request that wrote it, and is looked up
under that tenant only (the tenant is part of every backend's key), so another tenant's record
is never read: it is missing, with the same 404. The ``default`` tenant (every caller of a
frontend without credentials, and ``--api-key`` keys) keeps its records under ``NO_TENANT``,
the records' tenant when no principal wrote them.

Routing: a chain's turns carry its root's id as their session id, and a conversation's turns
the conversation's id, so the KV router (and session affinity) sends each turn to the worker
that holds the conversation's prefix, as a client sending ``x-session-id`` would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from turnout.errors import RequestError
from turnout.frontend.access.principal import DEFAULT_TENANT, Principal
from turnout.frontend.http.errors import SERVER_ERROR, HttpError
from turnout.frontend.openai.chunk_writer import new_request_id
from turnout.frontend.responses.request import ResponsesRequest
from turnout.frontend.responses.store import NO_TENANT, ResponseStore, ResponseStoreError
from turnout.llm.openai_fields import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
)

log = logging.getLogger("turnout.frontend")

#: Seconds one store call may take before the request gets a 503.
STORE_DEADLINE_S = 5.0
#: Default retention: OpenAI keeps stored responses 30 days.
DEFAULT_TTL_S = 30 * 24 * 3600.0
#: Default bound of one stored record (a response's input items and body, encoded).
DEFAULT_MAX_RECORD_BYTES = 32 << 20
#: Default bound of a chain's turns and a conversation's items (``--max-messages``'s default:
#: each turn adds at least one message to what the model reads).
DEFAULT_MAX_ITEMS = 10_000
#: Items one conversation create or items create call may add (OpenAI's bound).
MAX_ITEMS_PER_CALL = 20
#: Longest id looked up (longer ones cannot exist: they are not looked up at all).
MAX_ID_CHARS = 128
#: Message roles of items, and the part type of their text.
_ROLES = {"user": "input_text", "system": "input_text", "developer": "input_text",
          "assistant": "output_text"}  # fmt: skip
_TEXT_PARTS = ("input_text", "output_text", "text")

_T = TypeVar("_T")
_encode = msgspec.json.Encoder().encode


class StoredResponse(msgspec.Struct, kw_only=True):
    """One stored turn (encoded as JSON: readable with the database's own tools)."""

    #: The final body, as it was returned (``output``: the output items).
    response: dict[str, Any]
    #: This turn's input, as items with ids.
    input_items: list[dict[str, Any]]
    #: The turns it continues, root first (empty for a chain's first turn).
    ancestors: list[str] = []
    #: The conversation it was created in (its items live there, not in ``ancestors``).
    conversation_id: str | None = None


class StoredConversation(msgspec.Struct, kw_only=True):
    created_at: int
    metadata: dict[str, str] = {}


_decode_response = msgspec.json.Decoder(StoredResponse).decode
_decode_conversation = msgspec.json.Decoder(StoredConversation).decode
_decode_item = msgspec.json.Decoder(dict[str, Any]).decode


def store_tenant(principal: Principal | None) -> str:
    """The tenant whose records a request reads and writes: its principal's, with the
    ``default`` tenant's (and a request without a principal: no credentials configured) under
    ``NO_TENANT``, where a frontend without credentials keeps them."""
    if principal is None or principal.tenant == DEFAULT_TENANT:
        return NO_TENANT
    return principal.tenant


@dataclass(slots=True)
class Turn:
    """One ``/v1/responses`` request's place in the store, settled before it runs."""

    response_id: str
    tenant: str
    #: Whether the response will be stored when it completes.
    store: bool
    #: The request's input, as items with ids (what the record keeps).
    input_items: list[dict[str, Any]]
    #: Stored items that come before the input (the chain's or the conversation's).
    context: list[dict[str, Any]] = field(default_factory=list)
    ancestors: list[str] = field(default_factory=list)
    conversation_id: str | None = None
    #: The routing session: the chain's root, or the conversation (None: none).
    session_id: str | None = None


class ResponseHistory:
    """The store's one caller: ``begin``/``keep`` around a ``/v1/responses`` run, and the
    reads and writes of the store's routes. ``store`` None: ``--response-store off``."""

    def __init__(
        self,
        store: ResponseStore | None,
        *,
        ttl: float = DEFAULT_TTL_S,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        max_items: int = DEFAULT_MAX_ITEMS,
        clock: Callable[[], float] = time.time,
        deadline: float = STORE_DEADLINE_S,
    ) -> None:
        """``clock``: the wall clock expiries are computed from (tests inject one);
        ``deadline``: seconds one store call may take."""
        self.store = store
        self.deadline = deadline
        self.ttl = ttl
        self.max_record_bytes = max_record_bytes
        self.max_items = max_items
        self._clock = clock

    # ------------------------------------------------------------------ /v1/responses

    async def begin(self, request: ResponsesRequest, tenant: str) -> Turn:
        """Where ``request`` stands: its id, whether it is stored, the stored items before
        its input, its session. A 400 or 404 naming the field for what cannot be honoured."""
        conversation_id = conversation_of(request.conversation)
        previous_id = request.previous_response_id
        if conversation_id is not None and previous_id is not None:
            raise RequestError(
                "'conversation' and 'previous_response_id' cannot be used together",
                param="conversation",
            )
        if self.store is None:
            for name, asked in (
                ("store", request.store is True),
                ("previous_response_id", previous_id is not None),
                ("conversation", conversation_id is not None),
            ):
                if asked:
                    raise RequestError(
                        f"'{name}' needs the response store, and this frontend runs with "
                        "--response-store off",
                        param=name,
                    )
        turn = Turn(
            response_id="resp_" + new_request_id(),
            tenant=tenant,
            store=self.store is not None and request.store is not False,
            input_items=to_items(request.input, "input"),
        )
        if previous_id is not None:
            chain = await self._chain(tenant, previous_id)
            turn.ancestors = [*chain[-1].ancestors, previous_id]
            turn.context = [item for r in chain for item in (*r.input_items, *_output(r))]
            turn.session_id = turn.ancestors[0]
        elif conversation_id is not None:
            await self._conversation(tenant, conversation_id)
            stored = await self._call(self._store().list_items(tenant, conversation_id))
            self._check_room(len(stored) + len(turn.input_items), "input")
            turn.context = [_decode_item(data) for _, data in stored]
            turn.conversation_id = conversation_id
            turn.session_id = conversation_id
        elif turn.store:
            turn.session_id = turn.response_id
        return turn

    async def keep(self, turn: Turn, response: dict[str, Any]) -> dict[str, Any]:
        """Store a finished response (and add its items to its conversation); ``response``
        with ``store`` saying whether it was. Never raises: the client gets its answer."""
        if turn.store:
            record = StoredResponse(
                response={**response, "store": True},
                input_items=turn.input_items,
                ancestors=turn.ancestors,
                conversation_id=turn.conversation_id,
            )
            data = _encode(record)
            stored = False
            if len(data) > self.max_record_bytes:
                log.warning(
                    "response not stored: %d bytes, more than --response-store-max-bytes",
                    len(data), extra={"response_id": turn.response_id},
                )  # fmt: skip
            else:
                try:
                    await self._call(
                        self._store().put_response(
                            turn.tenant, turn.response_id, data, self._expiry(), turn.ancestors
                        )
                    )
                    stored = True
                except HttpError as exc:
                    log.warning("response not stored: %s", exc.message,
                                extra={"response_id": turn.response_id})  # fmt: skip
            response["store"] = stored
        if turn.conversation_id is not None:
            items = [*turn.input_items, *response.get("output", ())]
            try:
                added = await self._call(
                    self._store().add_items(
                        turn.tenant, turn.conversation_id, _encoded(items), self._expiry()
                    )
                )
                if not added:
                    log.warning("conversation gone before its response's items were added",
                                extra={"conversation_id": turn.conversation_id})  # fmt: skip
            except HttpError as exc:
                log.warning("conversation items not added: %s", exc.message,
                            extra={"conversation_id": turn.conversation_id})  # fmt: skip
        return response

    async def _chain(self, tenant: str, previous_id: str) -> list[StoredResponse]:
        """The turns of ``previous_id``'s chain, root first, ``previous_id``'s last."""
        store = self._store()
        found = await self._call(store.get_responses(tenant, [previous_id]))
        raw = found.get(previous_id) if len(previous_id) <= MAX_ID_CHARS else None
        if raw is None:
            raise _previous_not_found(previous_id)
        previous = _decode_response(raw)
        if previous.conversation_id is not None:
            raise RequestError(
                f"response '{previous_id}' belongs to conversation "
                f"'{previous.conversation_id}': continue it with 'conversation'",
                param="previous_response_id",
            )
        if len(previous.ancestors) + 1 >= self.max_items:
            raise RequestError(
                f"the chain of '{previous_id}' has {len(previous.ancestors) + 1} turns; at most "
                f"{self.max_items} (--max-messages) may be continued",
                param="previous_response_id",
            )
        others = await self._call(store.get_responses(tenant, previous.ancestors))
        for ancestor in previous.ancestors:
            if ancestor not in others:
                raise _previous_not_found(
                    previous_id, f" (its chain's earlier response '{ancestor}' is gone)"
                )
        return [*(_decode_response(others[a]) for a in previous.ancestors), previous]

    # ------------------------------------------------------------------ stored responses

    async def get_response(self, tenant: str, response_id: str) -> StoredResponse:
        """A stored response; 404 in OpenAI's words when there is none."""
        found = {}
        if len(response_id) <= MAX_ID_CHARS:
            found = await self._call(self._store().get_responses(tenant, [response_id]))
        if response_id not in found:
            raise HttpError(404, f"Response with id '{response_id}' not found.")
        return _decode_response(found[response_id])

    async def delete_response(self, tenant: str, response_id: str) -> None:
        deleted = len(response_id) <= MAX_ID_CHARS and await self._call(
            self._store().delete_response(tenant, response_id)
        )
        if not deleted:
            raise HttpError(404, f"Response with id '{response_id}' not found.")

    async def input_items(self, tenant: str, response_id: str) -> list[dict[str, Any]]:
        """The items a stored response was made from, oldest first: its chain's turns (those
        still stored) and its own input. A response made in a conversation lists its own
        input only; the conversation lists the rest."""
        record = await self.get_response(tenant, response_id)
        earlier = {}
        if record.ancestors:
            earlier = await self._call(self._store().get_responses(tenant, record.ancestors))
        items: list[dict[str, Any]] = []
        for ancestor in record.ancestors:
            if ancestor in earlier:
                turn = _decode_response(earlier[ancestor])
                items += [*turn.input_items, *_output(turn)]
        return items + record.input_items

    # ------------------------------------------------------------------ conversations

    async def create_conversation(
        self, tenant: str, metadata: dict[str, str] | None, raw_items: list[dict[str, Any]] | None
    ) -> dict[str, Any]:
        check_metadata(metadata)
        items = to_items(raw_items or [], "items")
        if len(items) > MAX_ITEMS_PER_CALL:
            raise RequestError(
                f"'items' has {len(items)} items; at most {MAX_ITEMS_PER_CALL} a call",
                param="items",
            )
        conversation_id = "conv_" + new_request_id()
        record = StoredConversation(created_at=int(self._clock()), metadata=metadata or {})
        store = self._store()
        await self._call(
            store.put_conversation(tenant, conversation_id, _encode(record), self._expiry())
        )
        if items:
            await self._call(
                store.add_items(tenant, conversation_id, _encoded(items), self._expiry())
            )
        return conversation_body(conversation_id, record)

    async def get_conversation(self, tenant: str, conversation_id: str) -> dict[str, Any]:
        return conversation_body(conversation_id, await self._conversation(tenant, conversation_id))

    async def update_conversation(
        self, tenant: str, conversation_id: str, metadata: dict[str, str] | None
    ) -> dict[str, Any]:
        check_metadata(metadata)
        record = await self._conversation(tenant, conversation_id)
        record.metadata = metadata or {}
        await self._call(
            self._store().put_conversation(tenant, conversation_id, _encode(record), self._expiry())
        )
        return conversation_body(conversation_id, record)

    async def delete_conversation(self, tenant: str, conversation_id: str) -> None:
        deleted = len(conversation_id) <= MAX_ID_CHARS and await self._call(
            self._store().delete_conversation(tenant, conversation_id)
        )
        if not deleted:
            raise _conversation_not_found(conversation_id)

    async def add_conversation_items(
        self, tenant: str, conversation_id: str, raw_items: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        if not raw_items or len(raw_items) > MAX_ITEMS_PER_CALL:
            raise RequestError(f"'items' must hold 1 to {MAX_ITEMS_PER_CALL} items", param="items")
        items = to_items(raw_items, "items")
        existing = await self.conversation_items(tenant, conversation_id)
        self._check_room(len(existing) + len(items), "items")
        added = await self._call(
            self._store().add_items(tenant, conversation_id, _encoded(items), self._expiry())
        )
        if not added:
            raise _conversation_not_found(conversation_id)
        return items

    async def conversation_items(self, tenant: str, conversation_id: str) -> list[dict[str, Any]]:
        """A conversation's items, oldest first; 404 when it does not exist."""
        await self._conversation(tenant, conversation_id)
        stored = await self._call(self._store().list_items(tenant, conversation_id))
        return [_decode_item(data) for _, data in stored]

    async def conversation_item(
        self, tenant: str, conversation_id: str, item_id: str
    ) -> dict[str, Any]:
        for item in await self.conversation_items(tenant, conversation_id):
            if item.get("id") == item_id:
                return item
        raise _item_not_found(item_id, conversation_id)

    async def delete_conversation_item(
        self, tenant: str, conversation_id: str, item_id: str
    ) -> dict[str, Any]:
        """Remove an item; the conversation's body (what OpenAI answers)."""
        record = await self._conversation(tenant, conversation_id)
        deleted = await self._call(self._store().delete_item(tenant, conversation_id, item_id))
        if not deleted:
            raise _item_not_found(item_id, conversation_id)
        return conversation_body(conversation_id, record)

    async def _conversation(self, tenant: str, conversation_id: str) -> StoredConversation:
        raw = None
        if len(conversation_id) <= MAX_ID_CHARS:
            raw = await self._call(self._store().get_conversation(tenant, conversation_id))
        if raw is None:
            raise _conversation_not_found(conversation_id)
        return _decode_conversation(raw)

    def _check_room(self, count: int, param: str) -> None:
        if count > self.max_items:
            raise RequestError(
                f"the conversation would hold {count} items; at most {self.max_items} "
                "(--max-messages)",
                param=param,
            )

    # ------------------------------------------------------------------ retention

    async def sweep_forever(self, interval: float) -> None:
        """Remove expired records every ``interval`` seconds (a failed sweep is logged and
        tried again next time)."""
        while True:
            await asyncio.sleep(interval)
            try:
                gone = await self._call(self._store().sweep())
            except HttpError as exc:
                log.warning("response store sweep failed: %s", exc.message)
                continue
            if gone:
                log.debug("response store sweep removed %d records", gone)

    # ------------------------------------------------------------------ plumbing

    def _store(self) -> ResponseStore:
        if self.store is None:
            raise HttpError(
                404,
                "this frontend keeps no responses or conversations (--response-store off)",
                code="store_disabled",
            )
        return self.store

    def _expiry(self) -> float:
        return self._clock() + self.ttl

    async def _call(self, call: Awaitable[_T]) -> _T:
        """``call`` under the store's deadline; its failures as a 503."""
        try:
            return await asyncio.wait_for(call, self.deadline)
        except TimeoutError:
            raise HttpError(
                503,
                f"the response store did not answer within {self.deadline:g}s",
                type=SERVER_ERROR,
                code="response_store_unavailable",
            ) from None
        except ResponseStoreError as exc:
            raise HttpError(
                503,
                f"the response store failed: {exc}",
                type=SERVER_ERROR,
                code="response_store_unavailable",
            ) from exc


def conversation_of(value: str | dict[str, Any] | None) -> str | None:
    """The conversation id of a request's ``conversation`` (an id, or ``{"id": ...}``)."""
    if value is None or isinstance(value, str):
        return value
    if set(value) != {"id"} or not isinstance(value["id"], str):
        raise RequestError(
            "'conversation' must be a conversation id or {\"id\": ...}", param="conversation"
        )
    return str(value["id"])


def conversation_body(conversation_id: str, record: StoredConversation) -> dict[str, Any]:
    return {
        "id": conversation_id,
        "object": "conversation",
        "created_at": record.created_at,
        "metadata": record.metadata,
    }


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS or any(
        len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS
        for k, v in metadata.items()
    ):
        raise RequestError(
            f"'metadata' holds at most {MAX_METADATA_PAIRS} pairs, keys of at most "
            f"{MAX_METADATA_KEY_CHARS} characters and values of at most "
            f"{MAX_METADATA_VALUE_CHARS}",
            param="metadata",
        )


def to_items(value: str | Sequence[Any], param: str) -> list[dict[str, Any]]:
    """Input (a string, or items as clients send them) as the stored items the ``openai``
    client reads back: each with a fresh id and a status, message text as content parts.
    Kinds: messages (text), function calls, their outputs, reasoning; anything else is a
    400 naming ``param`` (as the Responses API's translation refuses it)."""
    if isinstance(value, str):
        return [_message("user", [{"type": "input_text", "text": value}])]
    items = []
    for raw in value:
        if not isinstance(raw, dict):
            raise RequestError(f"'{param}' items must be objects", param=param)
        kind = raw.get("type", "message")
        if kind == "message":
            role = raw.get("role")
            part_type = _ROLES.get(role) if isinstance(role, str) else None
            if part_type is None:
                raise RequestError(
                    f"message role {role!r} is not one of {sorted(_ROLES)}", param=param
                )
            items.append(_message(str(role), _parts(raw.get("content"), part_type, param)))
        elif kind == "function_call":
            items.append({
                "id": "fc_" + new_request_id(), "type": "function_call",
                "call_id": _string(raw, "call_id", param), "name": _string(raw, "name", param),
                "arguments": _string(raw, "arguments", param), "status": "completed",
            })  # fmt: skip
        elif kind == "function_call_output":
            output = raw.get("output")
            if not isinstance(output, str):
                output = "".join(p["text"] for p in _parts(output, "input_text", param))
            items.append({
                "id": "fco_" + new_request_id(), "type": "function_call_output",
                "call_id": _string(raw, "call_id", param), "output": output,
                "status": "completed",
            })  # fmt: skip
        elif kind == "reasoning":
            item = {"id": "rs_" + new_request_id(), "type": "reasoning", "summary": []}
            for key in ("summary", "content"):
                if isinstance(raw.get(key), list):
                    item[key] = raw[key]
            items.append(item)
        else:
            raise RequestError(f"items of type {kind!r} are not supported", param=param)
    return items


def _message(role: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": "msg_" + new_request_id(), "type": "message", "role": role,
            "content": parts, "status": "completed"}  # fmt: skip


def _parts(content: Any, part_type: str, param: str) -> list[dict[str, Any]]:
    """Message content as text parts of ``part_type`` (``output_text`` ones with their
    ``annotations``)."""
    if isinstance(content, str):
        texts = [content]
    elif isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise RequestError(
                    f"content parts of type {kind!r} are not supported (text only)", param=param
                )
            texts.append(part["text"])
    else:
        raise RequestError("message content must be a string or a list of parts", param=param)
    if part_type == "output_text":
        return [{"type": "output_text", "text": t, "annotations": []} for t in texts]
    return [{"type": part_type, "text": t} for t in texts]


def _string(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise RequestError(f"{item.get('type')} items need a string '{name}'", param=param)
    return value


def _output(record: StoredResponse) -> list[dict[str, Any]]:
    output = record.response.get("output")
    return output if isinstance(output, list) else []


def _encoded(items: Sequence[dict[str, Any]]) -> list[tuple[str, bytes]]:
    return [(str(item["id"]), _encode(item)) for item in items]


def _previous_not_found(previous_id: str, why: str = "") -> HttpError:
    return HttpError(
        404,
        f"Previous response with id '{previous_id}' not found.{why}",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def _conversation_not_found(conversation_id: str) -> HttpError:
    return HttpError(404, f"Conversation with id '{conversation_id}' not found.")


def _item_not_found(item_id: str, conversation_id: str) -> HttpError:
    return HttpError(
        404, f"Item with id '{item_id}' not found in conversation '{conversation_id}'."
    )
