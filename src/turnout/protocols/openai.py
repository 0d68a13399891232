"""OpenAI-compatible request and response types (the HTTP edge).

Requests accept what OpenAI clients and load generators send: the OpenAI fields, vLLM-style
sampling extras at the top level (``ignore_eos``, ``min_tokens``, ``top_k``, ...), and an
``nvext`` object. A field turnout does not know, or of the wrong type, fails validation, which
the frontend turns into a 400 naming it: a request is never answered as if a field it sent
had been honoured. Messages stay lenient (clients replay assistant messages with fields such
as ``refusal``), so do their content parts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

#: An integer as engines and the wire (msgpack) take it: a client's larger number is a 400
#: naming its field when the body is decoded, never an overflow deep in the pipeline.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
#: An instance id (a discovery lease id: a positive int64).
InstanceIdInt = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
#: An instance id as every output prints it (``%x``: ``/health``, ``turnout status``, logs,
#: headers), with or without ``0x``; at most 2**63 - 1, like ``InstanceIdInt``.
InstanceIdHex = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^(0[xX])?([0-9a-fA-F]{1,15}|[0-7][0-9a-fA-F]{15})$",
        description="an instance id in hex, as /health prints it",
    ),
]


def _instance_id(value: int | str | None) -> int | None:
    """``backend_instance_id`` as an int: hex text (already checked by ``InstanceIdHex``)
    is parsed. Both structs that carry it call this in ``__post_init__``, so a decoded
    request holds the int; ``pinned_instance`` gives it with the int's type."""
    return int(value, 16) if isinstance(value, str) else value


class NvExt(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """turnout/Dynamo extensions carried beside the OpenAI fields."""

    ignore_eos: bool | None = None
    backend_instance_id: InstanceIdInt | InstanceIdHex | None = None
    #: Names of extra response fields the client asks for (e.g. ``"worker_id"``, ``"routing"``).
    extra_fields: list[str] | None = None
    greed_sampling: bool | None = None
    #: Admission priority while the frontend's request slots are full: higher waits less
    #: (first-come-first-served within a priority); default 0, negative allowed.
    priority: Int64 | None = None
    #: Seconds this request may take in all (> 0); shortens ``--request-timeout``, never
    #: lifts it.
    request_timeout: Annotated[float, msgspec.Meta(gt=0)] | None = None
    #: The tenant's KV cache partition (same as the top-level ``cache_salt``).
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        self.backend_instance_id = _instance_id(self.backend_instance_id)

    @property
    def pinned_instance(self) -> int | None:
        """The instance the request pins (``backend_instance_id``, hex or int), if any."""
        return _instance_id(self.backend_instance_id)


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    #: OpenAI pads streamed events with random characters against side channels when this is
    #: true (its default); turnout sends no padding either way (its streams are not
    #: encrypted by it, so there is no length to hide), so both values are honoured as "none".
    include_obfuscation: bool | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    #: A string, or a list of content parts (``{"type": "text", "text": ...}``), or null.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    #: A replayed assistant turn's refusal (its content when it has no text).
    refusal: str | None = None
    #: A replayed assistant turn's reasoning, as turnout returns it: templates that keep the
    #: reasoning of the turns since the last user message (Qwen3's, in tool loops) read it.
    reasoning_content: str | None = None


class _SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields common to chat and completion requests."""

    model: str
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM-style extras
    ignore_eos: bool | None = None
    min_tokens: Int64 | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool | None = None
    #: vLLM's cache partition: requests reuse each other's cached prefixes only when their
    #: salts are equal (tenants that must not observe each other's cache timing).
    cache_salt: str | None = None
    #: vLLM's structured-output extras (at most one, and not with ``response_format``): a
    #: JSON schema (an object, or its JSON text), a regular expression, a list of choices,
    #: a grammar (llguidance lark, or GBNF). The regex is in Rust ``regex`` syntax (what
    #: llguidance, and vLLM's backends, take): no look-around, back-references or ``\A``/``\Z``
    #: (a 400); ``\s`` and ``\w`` are Unicode's, which differ from Python's at the edges.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    nvext: NvExt | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    #: ``false``: at most one tool call a response (the first the model writes; a forced
    #: ``required`` choice's grammar allows one). Null or ``true``: as many as it writes.
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    #: What the chat template's reasoning switch is set to (``reasoning_switch``); a model
    #: whose template has none refuses it.
    reasoning_effort: str | None = None
    #: OpenAI's fields that ask nothing of generation, each checked as OpenAI checks it
    #: (``openai_fields.check_openai_fields`` says what each does here).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    #: The routing session key, as the ``x-session-id`` header (which wins when both are sent).
    prompt_cache_key: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    #: A string, or a list of strings / token ids / token-id lists. msgspec allows one
    #: array-like type in a union, so the list is typed loosely here; the preprocessor
    #: accepts ``[str]``, ``[int, ...]`` and ``[[int, ...]]`` and rejects the rest.
    prompt: str | list[str | int | list[int]]
    echo: bool | None = None
    suffix: str | None = None
    logprobs: Int64 | None = None
    best_of: Int64 | None = None
    #: As chat's (vLLM takes it on completions too): ``json_object`` or ``json_schema``.
    response_format: dict[str, Any] | None = None


# ---------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class FunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tool call's function: named in a call's first chunk, arguments as JSON text (whole,
    or a fragment per chunk when streamed)."""

    name: str | None = None
    arguments: str | None = None


class ToolCall(msgspec.Struct, kw_only=True):
    """A whole tool call of a response message."""

    id: str
    function: FunctionCall
    type: str = "function"


class ToolCallChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of a tool call in a streamed delta: the first piece of a call has its id,
    type and name; the rest add argument text."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCall | None = None


class ChatResponseMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | None
    #: The model's reasoning, apart from its answer (vLLM's and DeepSeek's field).
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


# The ``object`` of a response is its struct's tag: always encoded (``omit_defaults`` would
# drop a field that equals its default), first in the body.


class ChatCompletionResponse(
    msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="object", tag="chat.completion"
):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    #: ``default`` when the request named a tier (turnout serves one).
    service_tier: str | None = None
    nvext: dict[str, Any] | None = None


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(
    msgspec.Struct,
    kw_only=True,
    omit_defaults=True,
    tag_field="object",
    tag="chat.completion.chunk",
):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    service_tier: str | None = None
    nvext: dict[str, Any] | None = None


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class CompletionResponse(
    msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="object", tag="text_completion"
):
    """Both the whole completion and one streamed chunk (OpenAI uses one shape for both)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    nvext: dict[str, Any] | None = None


class ModelObject(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "turnout"
    #: vLLM's fields: ``root`` is what the entry serves (the model, or the LoRA adapter),
    #: ``parent`` the base model of an adapter (None for a base model).
    root: str | None = None
    parent: str | None = None
    #: turnout's: the routes that serve the model (``/v1/chat/completions``,
    #: ``/v1/embeddings``, ...), from the types its workers' cards announce.
    endpoints: list[str] | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    #: A string naming the case (``model_not_found``), or None; never the HTTP status.
    code: str | None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


# ---------------------------------------------------------------- embeddings


class UnaryNvExt(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``nvext`` fields that mean something to a one-reply request (embeddings,
    tensors): no sampling, no streaming, no cache."""

    backend_instance_id: InstanceIdInt | InstanceIdHex | None = None
    priority: Int64 | None = None
    request_timeout: Annotated[float, msgspec.Meta(gt=0)] | None = None

    def __post_init__(self) -> None:
        self.backend_instance_id = _instance_id(self.backend_instance_id)

    @property
    def pinned_instance(self) -> int | None:
        """The instance the request pins (``backend_instance_id``, hex or int), if any."""
        return _instance_id(self.backend_instance_id)


class EmbeddingsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/embeddings``."""

    model: str
    #: A string, a list of strings, a list of token ids, or a list of token-id lists (typed
    #: loosely, as ``CompletionRequest.prompt``; the pipeline checks the forms).
    input: str | list[str | int | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] | None = None
    user: str | None = None
    nvext: UnaryNvExt | None = None


class Embedding(msgspec.Struct, kw_only=True):
    index: int
    #: Floats, or (``encoding_format: base64``) the base64 of their little-endian float32s.
    embedding: list[float] | str
    object: Literal["embedding"] = "embedding"


class EmbeddingsUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(msgspec.Struct, kw_only=True):
    data: list[Embedding]
    model: str
    usage: EmbeddingsUsage
    object: Literal["list"] = "list"
