"""``POST /v1/responses``: OpenAI's Responses API over the chat pipelines.

The request becomes a chat request (``responses.request``) and runs as one (``ChatRun``:
the same template, routing, migration and output parsing); its pieces become the Responses
API's output items, in order: a ``reasoning`` item for reasoning text, a ``message`` item for
answer text, a ``function_call`` item per tool call. Streamed, the semantic events the
``openai`` client consumes (``event:`` + ``data:`` lines, numbered by ``sequence_number``)::

    response.created, response.in_progress,
    per item: response.output_item.added,
              [response.content_part.added], deltas (response.reasoning_text.delta,
              response.output_text.delta, response.function_call_arguments.delta),
              their .done events, [response.content_part.done], response.output_item.done,
    response.completed (or response.incomplete: the token limit; response.failed: an error,
    after an ``error`` event), each carrying the whole response.

Stored responses (``store``, ``previous_response_id``, ``conversation``: ``history``):
the chain's or conversation's items are read before the request runs, and its turn carries the
chain's session; the finished response is stored before its last event (or its body) is sent,
so a client that continues the chain at once finds it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from turnout.errors import RequestError
from turnout.frontend.access.limits import PRINCIPAL_METADATA
from turnout.frontend.http.errors import HttpError
from turnout.frontend.http.surface import (
    Pipeline,
    Surface,
    SurfaceRequest,
    body_session_key,
    decode_json,
)
from turnout.frontend.metrics.frontend import FrontendMetrics
from turnout.frontend.models.manager import ModelKind
from turnout.frontend.models.pipeline import TextPipeline
from turnout.frontend.openai.chat_run import ChatRun, Choice, respond
from turnout.frontend.openai.choice_output import ChoicePiece
from turnout.frontend.openai.chunk_writer import new_request_id
from turnout.frontend.responses.history import ResponseHistory, store_tenant
from turnout.frontend.responses.request import ResponsesRequest, to_chat
from turnout.llm.limits import RequestLimits
from turnout.llm.parsers import ToolCallDelta
from turnout.protocols.openai import Usage
from turnout.runtime.context import RequestContext
from turnout.runtime.http import Exchange

_json = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ResponsesRequest)


class ResponseWriter:
    """One response's output items and, when streamed, its events (``events`` collects the
    encoded events not sent yet; ``None``: a whole response, no events). It is the
    ``RunWriter`` of a run (``respond``)."""

    def __init__(
        self,
        request: ResponsesRequest,
        *,
        stream: bool,
        response_id: str | None = None,
        store: bool = False,
        conversation_id: str | None = None,
        keep: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        """``store``: what the body says until the response is settled (whether it will be
        stored); ``conversation_id``: the conversation it belongs to; ``keep``: what the
        settled response goes through before its last event (or its body) goes out (the
        response store's write: a client that continues the chain at once finds it)."""
        self.request = request
        self.stream = stream
        self._keep = keep
        self.id = response_id or "resp_" + new_request_id()
        self.store = store
        self.conversation_id = conversation_id
        self.created_at = int(time.time())
        self.events: list[bytes] | None = [] if stream else None
        self._seq = 0
        #: Finished output items, in order.
        self.items: list[dict[str, Any]] = []
        #: The item being written (reasoning, message or function call), its text so far.
        self._open: dict[str, Any] | None = None
        self._text: list[str] = []
        self._call_index: int | None = None

    # ---------------------------------------------------------------- a run's writer

    def head(self, run: ChatRun) -> bytes:
        self.start()
        return self.drain()

    def plain_text(self, index: int) -> Callable[[str], bytes]:
        return self._plain_text

    def _plain_text(self, text: str) -> bytes:
        self._write("message", text)
        return self.drain()

    def piece(self, index: int, piece: ChoicePiece) -> bytes:
        self.add(piece)
        return self.drain()

    def end(self, choice: Choice) -> bytes:
        return b""

    async def tail(self, run: ChatRun) -> bytes:
        response = self.settle(run.finish_reason, run.usage)
        if self._keep is not None:
            response = await self._keep(response)
        self.complete(response)
        return self.drain() if self.stream else _json.encode(response)

    def error(self, err: HttpError) -> bytes:
        self.fail(err)
        return self.drain()

    def drain(self) -> bytes:
        """The events not sent yet, taken."""
        events = self.events
        if not events:
            return b""
        out = b"".join(events)
        events.clear()
        return out

    # ---------------------------------------------------------------- events

    def start(self) -> None:
        self._emit("response.created", response=self.response("in_progress"))
        self._emit("response.in_progress", response=self.response("in_progress"))

    def add(self, piece: ChoicePiece) -> None:
        if piece.reasoning:
            self._write("reasoning", piece.reasoning)
        if piece.content:
            self._write("message", piece.content)
        for call in piece.tool_calls:
            self._call(call)

    def finish(self, finish_reason: str, usage: Usage) -> dict[str, Any]:
        """Close the open item; the final response (also emitted, when streamed)."""
        response = self.settle(finish_reason, usage)
        self.complete(response)
        return response

    def settle(self, finish_reason: str, usage: Usage) -> dict[str, Any]:
        """Close the open item; the final response, not emitted yet (``complete`` does)."""
        incomplete = finish_reason == "length"
        self._close("incomplete" if incomplete else "completed")
        return self.response("incomplete" if incomplete else "completed", usage=usage)

    def complete(self, response: dict[str, Any]) -> None:
        """Emit the final event, carrying ``response`` (when streamed)."""
        self._emit(f"response.{response['status']}", response=response)

    def fail(self, err: HttpError) -> None:
        """A failure after streaming started: an ``error`` event, then ``response.failed``."""
        self._emit("error", message=err.message, code=err.code, param=err.param)
        self._close("incomplete")
        response = self.response("failed")
        response["error"] = {"code": "server_error", "message": err.message}
        self._emit("response.failed", response=response)

    # ---------------------------------------------------------------- items

    def _write(self, kind: str, text: str) -> None:
        item = self._open
        if item is None or item["type"] != kind:
            self._close("completed")
            item = self._begin(kind)
        self._text.append(text)
        event = "response.reasoning_text.delta" if kind == "reasoning" else (
            "response.output_text.delta"
        )  # fmt: skip
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        self._emit(event, **self._where(), content_index=0, delta=text, **extra)

    def _begin(self, kind: str) -> dict[str, Any]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": "rs_" + new_request_id(), "summary": [],
                    "content": [], "status": "in_progress"}  # fmt: skip
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": "msg_" + new_request_id(), "role": "assistant",
                    "status": "in_progress", "content": []}  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open = item
        self._text = []
        self._emit("response.output_item.added", output_index=len(self.items), item=item)
        self._emit("response.content_part.added", **self._where(), content_index=0, part=part)
        return item

    def _call(self, call: ToolCallDelta) -> None:
        if call.id is not None or call.index != self._call_index:
            self._close("completed")
            item = {"type": "function_call", "id": "fc_" + new_request_id(),
                    "call_id": call.id or "", "name": call.name or "", "arguments": "",
                    "status": "in_progress"}  # fmt: skip
            self._open = item
            self._text = []
            self._call_index = call.index
            self._emit("response.output_item.added", output_index=len(self.items), item=item)
        if call.arguments:
            self._text.append(call.arguments)
            self._emit("response.function_call_arguments.delta", **self._where(),
                       delta=call.arguments)  # fmt: skip

    def _close(self, status: str) -> None:
        item = self._open
        if item is None:
            return
        text = "".join(self._text)
        where = self._where()
        if item["type"] == "function_call":
            item = {**item, "arguments": text, "status": status}
            self._emit("response.function_call_arguments.done", **where, arguments=text,
                       name=item["name"])  # fmt: skip
        else:
            if item["type"] == "reasoning":
                part: dict[str, Any] = {"type": "reasoning_text", "text": text}
                self._emit("response.reasoning_text.done", **where, content_index=0, text=text)
            else:
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                self._emit("response.output_text.done", **where, content_index=0, text=text,
                           logprobs=[])  # fmt: skip
            self._emit("response.content_part.done", **where, content_index=0, part=part)
            item = {**item, "content": [part], "status": status}
        self._emit("response.output_item.done", output_index=len(self.items), item=item)
        self.items.append(item)
        self._open = None
        self._call_index = None
        self._text = []

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items)}

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.events is None:
            return
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        self.events.append(b"event: " + kind.encode() + b"\ndata: " + _json.encode(data) + b"\n\n")

    # ---------------------------------------------------------------- the response

    def response(self, status: str, usage: Usage | None = None) -> dict[str, Any]:
        req = self.request
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": req.model,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": req.instructions,
            "metadata": req.metadata or {},
            "output": list(self.items),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "tool_choice": _echo_tool_choice(req.tool_choice),
            "tools": [_echo_tool(t) for t in req.tools or ()],
            "text": req.text or {"format": {"type": "text"}},
            "store": self.store,
        }
        if req.previous_response_id is not None:
            body["previous_response_id"] = req.previous_response_id
        if self.conversation_id is not None:
            body["conversation"] = {"id": self.conversation_id}
        if req.service_tier is not None:
            body["service_tier"] = "default"
        if usage is not None:
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            body["usage"] = {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached or 0, "cache_write_tokens": 0},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            }
        return body


def _echo_tool_choice(choice: Any) -> Any:
    return "auto" if choice is None else choice


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }


def responses_surface(
    metrics: FrontendMetrics,
    limits: RequestLimits | None = None,
    history: ResponseHistory | None = None,
) -> Surface:
    """The ``/v1/responses`` route's surface; ``limits`` bound the request before it is
    translated (``input`` items, tools); ``history``: the response store (None: none, as
    ``--response-store off``)."""
    history = history if history is not None else ResponseHistory(None)

    def decode(body: bytes) -> SurfaceRequest:
        request = decode_json(_decoder, body)
        return SurfaceRequest(
            request.model, request.stream, (request, to_chat(request, limits)),
            session_key=body_session_key(request.prompt_cache_key, "prompt_cache_key"),
        )  # fmt: skip

    async def serve(
        proto: Exchange,
        pipeline: Pipeline,
        req: SurfaceRequest,
        body: bytes,
        ctx: RequestContext,
        session_id: str | None,
    ) -> None:
        request, chat = req.request
        if isinstance(pipeline, TextPipeline):
            raise HttpError(
                400,
                f"model '{request.model}' is served by text-input workers, which speak chat "
                "completions only; /v1/responses needs a model the frontend tokenizes",
                param="model",
            )
        # The principal the HTTP service put in ``ctx`` (none without credentials configured).
        turn = await history.begin(request, store_tenant(ctx.metadata.get(PRINCIPAL_METADATA)))
        if turn.context:  # the chain's or conversation's items, then the request's own
            items = [*turn.context, *turn.input_items]
            chat = to_chat(msgspec.structs.replace(request, input=items), limits)
        writer = ResponseWriter(
            request, stream=request.stream, response_id=turn.response_id, store=turn.store,
            conversation_id=turn.conversation_id,
            keep=lambda response: history.keep(turn, response),
        )  # fmt: skip
        try:
            run = await ChatRun.start(pipeline, chat, ctx, metrics, session_id or turn.session_id)
        except RequestError as exc:
            if exc.param == "reasoning_effort":  # chat's name for this API's reasoning.effort
                exc.param = "reasoning"
            raise
        await respond(proto, run, writer)

    return Surface("responses", ModelKind.CHAT, decode, serve)
