"""The token-level protocol between the frontend's pipeline and the workers (msgpack inside).

``PreprocessedRequest`` goes to a worker; a stream of ``LLMEngineOutput`` comes back. Every
output carries the *new* token ids since the previous one (a delta, never cumulative).

The request and the structs defined for it forbid unknown fields: a worker refuses a field
it does not know (naming it) instead of dropping it and serving a request that asked for
something it will not do. Two structs the request nests accept unknown fields, because they
are also carried where extra fields must be tolerated: ``KvHandle`` (``disagg.handle``) is
what a prefill worker answers with on its output, and ``EndpointId`` (inside ``KvHandle``
and ``PrefillParams``) is part of every discovery record and model card. Outputs tolerate
unknown fields, so a worker's extra output fields do not break a frontend that does not
know them.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from turnout.protocols.disagg import DisaggParams, KvHandle


class FinishReason(enum.StrEnum):
    """Why a stream ended. ``EOS`` and ``STOP`` both become OpenAI's ``"stop"``."""

    EOS = "eos"
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"
    CONTENT_FILTER = "content_filter"

    def to_openai(self) -> str:
        """The ``finish_reason`` string an OpenAI client expects."""
        if self in (FinishReason.EOS, FinishReason.STOP):
            return "stop"
        if self is FinishReason.CANCELLED:
            return "cancelled"
        return self.value


class ErrorKind(enum.StrEnum):
    """What kind of failure an ``ERROR`` output reports; it decides what the frontend does.

    * ``ENGINE_FAILED``: the engine broke (its loop died, it was stopped, a native call
      failed), not the request: the frontend migrates the request to another instance, like
      a broken stream.
    * ``BAD_REQUEST``: the request can never run on this engine: HTTP 400, never retried.
    * ``OVERLOADED``: the engine's queue is full: HTTP 503 with ``Retry-After``.

    An ``ERROR`` output without a kind is a request-specific failure: HTTP 500.
    """

    ENGINE_FAILED = "engine_failed"
    BAD_REQUEST = "bad_request"
    OVERLOADED = "overloaded"
    #: A decode worker could not get the KV of the request's handle (``protocols.disagg``):
    #: the frontend re-runs the prefill and retries; nothing was generated.
    KV_TRANSFER_FAILED = "kv_transfer_failed"


class StopConditions(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """When generation must end. Enforced by the frontend's backend operator; engines may
    enforce ``max_tokens`` and the token ids too (cheaper), never the strings."""

    max_tokens: int | None = None
    #: Stop strings; matched text is hidden from the output (OpenAI semantics).
    stop: list[str] | None = None
    #: Token ids that end generation; the token itself is not emitted as text.
    stop_token_ids_hidden: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False


class SamplingOptions(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None


class OutputOptions(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True


class StructuredOutput(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """A constraint on what the model may write, enforced by the engine while sampling.

    ``kind`` is what the client asked for (``json_object``, ``json_schema``, ``regex``,
    ``choice``, ``grammar``); ``grammar`` is that, compiled by the frontend into one lark
    grammar in llguidance's dialect (``%llguidance {}`` header; ``%json {...}`` for JSON
    schemas), which llama.cpp, vLLM and SGLang all take through llguidance. The frontend has
    already checked that it compiles.
    """

    kind: str
    grammar: str


class PreprocessedRequest(
    msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """A request after templating and tokenization: what a Tokens-input worker receives."""

    model: str
    token_ids: list[int]
    stop_conditions: StopConditions = msgspec.field(default_factory=StopConditions)
    sampling_options: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    output_options: OutputOptions = msgspec.field(default_factory=OutputOptions)
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    lora_name: str | None = None
    #: The tenant's cache partition (vLLM's ``cache_salt``): it seeds the block hashes, so
    #: requests with different salts never share cached blocks, on the worker or in a router.
    cache_salt: str | None = None
    #: Routing hint (``x-session-id``): turns of one conversation prefer the worker of the
    #: previous turn. Engines ignore it.
    session_id: str | None = None
    #: Set by the client (``nvext.backend_instance_id``) or the router: the instance to use.
    backend_instance_id: int | None = None
    #: The model card checksum the frontend built this request against.
    mdc_sum: str | None = None
    extra_args: dict[str, Any] | None = None
    #: Set on a request that continues a migrated one: how many leading ``token_ids`` are the
    #: client's prompt (the rest were generated before the move). An engine with a
    #: deterministic sampler uses it to go on exactly as the interrupted run would have.
    original_prompt_len: int | None = None
    #: Seconds the whole request may take (``nvext.request_timeout``); enforced by the
    #: frontend's migration operator, across migrations. None: the frontend's default.
    request_timeout: float | None = None
    #: Set by the frontend's prefill router on the two stages of a disaggregated request.
    disagg: DisaggParams | None = None
    #: What the output must match (``response_format``, ``guided_*``, a forced tool call).
    structured: StructuredOutput | None = None

    def continued(self, generated: list[int]) -> PreprocessedRequest:
        """The request that goes on after ``generated`` tokens (on another worker, after a
        migration or a prefill stage): they join the prompt, the token limits shrink."""
        stop = self.stop_conditions
        done = len(generated)
        new_stop = msgspec.structs.replace(
            stop,
            max_tokens=None if stop.max_tokens is None else max(stop.max_tokens - done, 1),
            min_tokens=None if stop.min_tokens is None else max(stop.min_tokens - done, 0),
        )
        original = self.original_prompt_len
        return msgspec.structs.replace(
            self,
            token_ids=[*self.token_ids, *generated],
            stop_conditions=new_stop,
            original_prompt_len=len(self.token_ids) if original is None else original,
        )


class CompletionUsage(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None


class LLMEngineOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One step of a worker's stream."""

    token_ids: list[int] = msgspec.field(default_factory=list)
    #: Optional text for ``token_ids``, when the engine detokenizes itself.
    text: str | None = None
    finish_reason: FinishReason | None = None
    #: A human-readable reason when ``finish_reason`` is ``ERROR``.
    error: str | None = None
    #: With ``ERROR``: an ``ErrorKind`` value (None: a failure of this request alone).
    error_kind: str | None = None
    cum_log_probs: float | None = None
    log_probs: list[float] | None = None
    #: Per token of ``token_ids``: the most likely alternatives as ``(id, log prob)``, most
    #: likely first (``OutputOptions.logprobs`` of them), when the request asked.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: Engine-reported usage, normally on the last output only.
    usage: CompletionUsage | None = None
    #: Engine-specific metadata (e.g. the worker id, routing notes).
    extra: dict[str, Any] | None = None
    #: On a prefill-stage answer: where its KV waits for the decode worker.
    kv_handle: KvHandle | None = None


class Annotated(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An out-of-band event in a stream (e.g. ``request_id``, ``worker_instance``)."""

    event: str
    data: Any = None
