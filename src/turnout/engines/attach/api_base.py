"""What every token-in/token-out server API shares: the server's description, what a request
may ask of it, and the stream of its answer as turnout outputs.

One ``TokensApi`` per engine (``llamacpp_api``, ``vllm_api``, ``sglang_api``) says:

* ``describe``: the served name, context length, KV block size and capacity, from what the
  server answers (``ServerInfo``);
* ``refusal`` / ``make_body``: the request in the engine's own fields, or why it cannot be
  honoured (every option the API has no field for is refused, never dropped);
* ``decoder``: a ``ChunkDecoder`` that turns each event of the stream into ``Piece``s;
* ``tokenize`` and ``load``: the tokenizer probe and the load numbers.

``TokenStream`` is the part common to all: stop token ids (the request's hidden stop ids,
and its EOS ids unless ``ignore_eos``) end the stream at the first one, whatever the engine
does after it; usage is counted; the final output carries the finish reason and usage.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Final, TypeVar

import msgspec

from turnout.protocols.llm import (
    CompletionUsage,
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
)
from turnout.protocols.model import ModelCapabilities

from .upstream import Upstream, UpstreamGarbage

_T = TypeVar("_T")

#: Most alternatives per token any attached engine is asked for (OpenAI's limit).
MAX_TOP_LOGPROBS: Final = 20

#: The text the tokenizer check encodes on both sides: ASCII, digits, punctuation, accents,
#: CJK, an emoji, tabs and newlines, so that a different vocabulary, normalizer or
#: pre-tokenizer shows.
PROBE_TEXT: Final = (
    "Hello, world! turnout attach probe 12345 67.89 -- naïve café, Ünïcödé; "
    "日本語のテキスト 🙂\n\tdone.  <b>x</b>"
)


class Refused(Exception):
    """A request this API cannot honour (the worker answers ``bad_request``)."""


@dataclass(slots=True)
class ServerInfo:
    """What a server says about itself."""

    api: str
    #: The model name the server serves (its ``/v1/models`` id).
    served_name: str
    #: Longest prompt + output one request may have.
    context_length: int | None = None
    #: Tokens per KV block (None: the engine did not say).
    block_size: int | None = None
    total_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    version: str | None = None
    #: A local path the server loaded its model (or tokenizer) from, when it says so.
    model_path: str | None = None
    #: Who its ``GET /v1/models`` says owns the model: the server's kind (``vllm``,
    #: ``sglang``, ``llamacpp``) for those that say it.
    owned_by: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class LoadNumbers:
    """A server's load, as its metrics say."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    total_kv_blocks: int = 0


@dataclass(slots=True)
class Piece:
    """What one event of a stream says (fields left empty when it says nothing of them)."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish: FinishReason | None = None
    #: ``(message, kind)`` when the event reports a failure.
    error: tuple[str, ErrorKind | None] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    #: The stream carries nothing more that matters after this event.
    last: bool = False


class ChunkDecoder(abc.ABC):
    """Turns the lines of one stream into ``Piece``s (one engine's wire format)."""

    @abc.abstractmethod
    def feed(self, field: str, payload: bytes) -> Piece | None:
        """The piece of one SSE line (``field`` is ``data`` or ``error``); None for lines
        that say nothing (keep-alives, ``[DONE]`` before the end). Raises
        ``UpstreamGarbage`` for a line that is not the API's."""


class TokensApi(abc.ABC):
    """One engine's token-in/token-out HTTP API (see the module doc)."""

    #: ``--api`` value and the engine's name in messages.
    name: str
    label: str
    #: The streaming route, the health route, the tokenize route.
    generate_path: str
    health_path: str = "/health"

    @abc.abstractmethod
    async def describe(self, upstream: Upstream) -> ServerInfo: ...

    @abc.abstractmethod
    def capabilities(self) -> ModelCapabilities:
        """What the card announces (the frontend refuses requests asking for more)."""

    def refusal(self, request: PreprocessedRequest) -> str | None:
        """Why ``request`` cannot run on this API (None: it can). Shared refusals first."""
        # ``sampling_options.n`` is not read: the frontend sends one request per choice.
        oo = request.output_options
        if request.structured is not None:
            return f"{request.structured.kind} output is not enforced through turnout attach"
        if oo.prompt_logprobs is not None:
            return "prompt_logprobs are not relayed by turnout attach"
        if request.lora_name:
            return f"LoRA adapter {request.lora_name!r}: turnout attach serves base models only"
        if request.disagg is not None:
            return "disaggregated serving is not available through turnout attach"
        if oo.logprobs is not None and oo.logprobs > MAX_TOP_LOGPROBS:
            return f"at most {MAX_TOP_LOGPROBS} alternatives per token, not {oo.logprobs}"
        if not request.token_ids:
            return "the prompt is empty"
        return self.own_refusal(request)

    def own_refusal(self, request: PreprocessedRequest) -> str | None:
        """Refusals of this API alone."""
        return None

    @abc.abstractmethod
    def make_body(
        self, request: PreprocessedRequest, *, served_name: str, max_tokens: int, rid: str
    ) -> dict[str, object]:
        """The request body; ``max_tokens`` is already resolved (the request's, or what the
        context leaves)."""

    @abc.abstractmethod
    def decoder(self, request: PreprocessedRequest) -> ChunkDecoder: ...

    @abc.abstractmethod
    async def tokenize(self, upstream: Upstream, text: str) -> list[int]:
        """The server's token ids for ``text``, without special tokens added."""

    @abc.abstractmethod
    async def load(self, upstream: Upstream) -> LoadNumbers: ...


class TokenStream:
    """One request's stream as turnout outputs: applies stop ids, counts usage, builds the
    final output. ``push(piece)`` returns the outputs to yield; ``finished`` once the final
    one was returned."""

    __slots__ = (
        "_cached",
        "_completion",
        "_eos",
        "_prompt",
        "_stop",
        "finished",
        "num_tokens",
        "pending_finish",
    )

    def __init__(self, request: PreprocessedRequest) -> None:
        sc = request.stop_conditions
        self._eos = frozenset(() if sc.ignore_eos else request.eos_token_ids)
        self._stop = self._eos | frozenset(sc.stop_token_ids_hidden or ())
        self._prompt = len(request.token_ids)
        self._completion: int | None = None
        self._cached: int | None = None
        self.num_tokens = 0
        self.finished = False
        #: A finish reason the engine gave before its usage (vLLM sends usage after it).
        self.pending_finish: FinishReason | None = None

    def usage(self) -> CompletionUsage:
        return CompletionUsage(
            prompt_tokens=self._prompt,
            completion_tokens=max(self.num_tokens, self._completion or 0),
            cached_tokens=self._cached,
        )

    def push(self, piece: Piece) -> list[LLMEngineOutput]:
        if self.finished:
            return []
        if piece.prompt_tokens:
            self._prompt = piece.prompt_tokens
        if piece.completion_tokens is not None:
            self._completion = piece.completion_tokens
        if piece.cached_tokens is not None:
            self._cached = piece.cached_tokens
        if piece.error is not None:
            message, kind = piece.error
            self.finished = True
            return [
                LLMEngineOutput(
                    finish_reason=FinishReason.ERROR,
                    error=message,
                    error_kind=kind.value if kind is not None else None,
                    usage=self.usage(),
                )
            ]
        ids, lps, tops = piece.token_ids, piece.log_probs, piece.top_logprobs
        finish: FinishReason | None = None
        if ids and self._stop:
            for i, token_id in enumerate(ids):
                if token_id in self._stop:
                    finish = FinishReason.EOS if token_id in self._eos else FinishReason.STOP
                    # The stop token itself is kept: the frontend hides it, as it does for
                    # turnout's own engines.
                    ids = ids[: i + 1]
                    lps = lps[: i + 1] if lps is not None else None
                    tops = tops[: i + 1] if tops is not None else None
                    self._completion = None
                    break
        self.num_tokens += len(ids)
        if finish is None:
            if piece.finish is not None and not piece.last:
                # vLLM names the finish reason before its usage: wait for the last event.
                self.pending_finish = piece.finish
            elif piece.last:
                finish = piece.finish or self.pending_finish
                if finish is None:
                    self.finished = True
                    return [
                        LLMEngineOutput(
                            token_ids=ids,
                            finish_reason=FinishReason.ERROR,
                            error="the server ended the stream without a finish reason",
                            error_kind=ErrorKind.ENGINE_FAILED.value,
                            usage=self.usage(),
                        )
                    ]
        if finish is None:
            if not ids:
                return []
            return [LLMEngineOutput(token_ids=ids, log_probs=lps, top_logprobs=tops)]
        self.finished = True
        return [
            LLMEngineOutput(
                token_ids=ids,
                log_probs=lps,
                top_logprobs=tops,
                finish_reason=finish,
                usage=self.usage(),
            )
        ]


class ErrorBody(msgspec.Struct):
    """An error object inside a stream event (``{"error": {...}}``) or a bare one."""

    message: str = ""
    type: str | None = None
    code: int | str | None = None


def error_kind(err: ErrorBody) -> ErrorKind:
    """``bad_request`` for the client's errors (a 4xx code, an ``invalid_request`` type),
    else ``engine_failed`` (the frontend tries another instance)."""
    code = err.code
    if isinstance(code, int) and 400 <= code < 500:
        return ErrorKind.BAD_REQUEST
    if err.type and ("invalid" in err.type or "exceed" in err.type or "not_supported" in err.type):
        return ErrorKind.BAD_REQUEST
    return ErrorKind.ENGINE_FAILED


def decode_event(decoder: msgspec.json.Decoder[_T], url: str, payload: bytes) -> _T:
    """``decoder.decode(payload)``, with a malformed event as ``UpstreamGarbage``."""
    try:
        return decoder.decode(payload)
    except msgspec.DecodeError as exc:
        quoted = payload[:120].decode("utf-8", "replace")
        raise UpstreamGarbage(url, f"a stream event does not decode ({exc}): {quoted!r}") from exc


def require_dict(url: str, what: str, value: object) -> dict[str, object]:
    if not isinstance(value, dict):
        raise UpstreamGarbage(url, f"{what} is not a JSON object")
    return value


def served_id(url: str, answer: object) -> str | None:
    """The first model id of a ``GET /v1/models`` answer."""
    data = require_dict(url, "GET /v1/models", answer).get("data")
    if isinstance(data, list) and data and isinstance(data[0], dict):
        model_id = data[0].get("id")
        if isinstance(model_id, str) and model_id:
            return model_id
    return None


def first_model(url: str, answer: object) -> dict[str, object]:
    """The first entry of a ``GET /v1/models`` answer."""
    data = require_dict(url, "GET /v1/models", answer).get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise UpstreamGarbage(url, "GET /v1/models lists no model")
    return data[0]


def token_list(url: str, what: str, answer: object) -> list[int]:
    """The ``tokens`` of a tokenize answer."""
    tokens = require_dict(url, what, answer).get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise UpstreamGarbage(url, f"{what}: 'tokens' is not a list of ids")
    return tokens
