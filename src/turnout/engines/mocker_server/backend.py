"""One generation on the mocker engine, as both HTTP faces need it.

A face decodes its request into ``GenerateParams`` (token ids and sampling settings), and
``MockerBackend.start`` checks them against the model (ids in the vocabulary, prompt and
output within ``max_model_len``: the 400s vLLM and SGLang answer) and runs them on the
engine. ``start`` returns once the engine has said something: an immediate refusal (queue
full, prompt too long for the pool) becomes an ``HttpError`` before any response is sent;
otherwise the first output is held in the returned ``Generation``, which the face iterates.

Every generation is counted in the server's ``ServerMetrics`` as it goes: time to first
token, inter-token gaps, tokens, and how it ended.

Cancellation: the face closes the ``Generation`` (``aclose``, or leaving
``async with generation``), which closes the engine's stream, which aborts the mocker's
request and frees its KV blocks and batch slot at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType

from turnout.engines.mocker import MockerEngine
from turnout.engines.mocker_server.metrics import ServerMetrics
from turnout.engines.mocker_server.model import ServedModel
from turnout.frontend.http.errors import SERVER_ERROR, HttpError, unavailable
from turnout.protocols.llm import (
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from turnout.runtime.context import RequestContext

#: Most ``stop_token_ids`` one request may name.
MAX_STOP_TOKEN_IDS = 256
#: Most alternatives per token (``logprobs``), as vLLM's default ``--max-logprobs``.
MAX_LOGPROBS = 20
_INT64 = (-(2**63), 2**63 - 1)


@dataclass(slots=True, kw_only=True)
class GenerateParams:
    """One generation as a face decoded it: the prompt's ids and how to sample after it."""

    token_ids: list[int]
    #: None: the mocker's own rule (it "decides" to stop with an EOS, as a model would).
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    #: Alternatives to report per token (0: the token's own log probability only); None:
    #: no log probabilities.
    logprobs: int | None = None
    skip_special_tokens: bool = True
    lora_name: str | None = None
    cache_salt: str | None = None


class MockerBackend:
    """The engine, the model around it and the server's metrics, shared by every route."""

    def __init__(self, engine: MockerEngine, model: ServedModel, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model = model
        self.metrics = metrics

    def check(self, params: GenerateParams, *, prompt_param: str = "prompt") -> None:
        """Raise the 400 a real server answers for ``params``, naming the field."""
        model = self.model
        ids = params.token_ids
        vocab = model.vocab_size
        if not ids:
            raise HttpError(400, "the prompt is empty", param=prompt_param)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise HttpError(
                400, f"token id {bad} is out of vocabulary (size {vocab})", param=prompt_param
            )
        limit = model.max_model_len
        if len(ids) > limit:
            raise HttpError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {len(ids)} input tokens. Please reduce the length of the "
                "input messages.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if params.max_tokens is not None:
            if params.max_tokens < 1:
                raise HttpError(400, "max_tokens must be at least 1", param="max_tokens")
            if len(ids) + params.max_tokens > limit:
                raise HttpError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the "
                    f"prompt, {params.max_tokens} for the completion). Please reduce the "
                    "length of the prompt or completion.",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
        if params.min_tokens < 0:
            raise HttpError(400, "min_tokens must be >= 0", param="min_tokens")
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise HttpError(
                400, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", param="stop_token_ids"
            )
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise HttpError(
                400, f"stop token id {bad} is out of vocabulary", param="stop_token_ids"
            )
        if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
            raise HttpError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")
        if params.seed is not None and not _INT64[0] <= params.seed <= _INT64[1]:
            raise HttpError(400, "seed must fit in a 64-bit integer", param="seed")

    def to_request(self, params: GenerateParams) -> PreprocessedRequest:
        return PreprocessedRequest(
            model=self.model.name,
            token_ids=params.token_ids,
            stop_conditions=StopConditions(
                max_tokens=params.max_tokens,
                stop_token_ids_hidden=params.stop_token_ids or None,
                min_tokens=params.min_tokens or None,
                ignore_eos=params.ignore_eos,
            ),
            sampling_options=SamplingOptions(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=params.seed,
            ),
            output_options=OutputOptions(
                logprobs=params.logprobs, skip_special_tokens=params.skip_special_tokens
            ),
            eos_token_ids=list(self.model.eos_token_ids),
            lora_name=params.lora_name,
            cache_salt=params.cache_salt,
        )

    async def start(
        self, params: GenerateParams, ctx: RequestContext, *, prompt_param: str = "prompt"
    ) -> Generation:
        """Check ``params``, run them, and wait for the engine's first word (see the module
        docstring); an immediate refusal raises its ``HttpError``."""
        self.check(params, prompt_param=prompt_param)
        generation = Generation(self, params, ctx)
        try:
            await generation.prime()
        except BaseException:
            await generation.aclose()
            raise
        return generation


class Generation:
    """One running generation: an async iterator of the engine's outputs (one token each,
    the last with its ``finish_reason``), closed with ``aclose`` (or ``async with``). Only
    its face's task uses it."""

    __slots__ = (
        "_backend",
        "_done",
        "_first",
        "_last_token_at",
        "_outputs",
        "_started_at",
        "cached_tokens",
        "finish_reason",
        "num_output_tokens",
        "params",
    )

    def __init__(self, backend: MockerBackend, params: GenerateParams, ctx: RequestContext) -> None:
        self._backend = backend
        self.params = params
        self._outputs = backend.engine.generate(backend.to_request(params), ctx)
        self._first: LLMEngineOutput | None = None
        self._done = False
        self._started_at = time.monotonic()
        self._last_token_at: float | None = None
        self.num_output_tokens = 0
        #: Prompt tokens served from the prefix cache (known when the generation ends).
        self.cached_tokens = 0
        #: How the generation ended (None while it runs, or when its consumer left).
        self.finish_reason: FinishReason | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.params.token_ids)

    async def prime(self) -> None:
        """Wait for the first output; raise the ``HttpError`` of a refusal."""
        try:
            first = await anext(self._outputs)
        except StopAsyncIteration:
            raise HttpError(
                500,
                "the engine ended the stream without output",
                type=SERVER_ERROR,
                code="internal_error",
            ) from None
        if first.finish_reason is FinishReason.ERROR:
            self.finish_reason = FinishReason.ERROR
            self._backend.metrics.on_refused()
            raise engine_error(first)
        self._first = first

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> LLMEngineOutput:
        if self._done:
            raise StopAsyncIteration
        out = self._first
        if out is not None:
            self._first = None
        else:
            out = await anext(self._outputs)
        self._observe(out)
        if out.finish_reason is not None:
            self._done = True
        return out

    def _observe(self, out: LLMEngineOutput) -> None:
        metrics = self._backend.metrics
        n = len(out.token_ids)
        if n:
            now = time.monotonic()
            if self._last_token_at is None:
                metrics.on_first_token(now - self._started_at, self.num_prompt_tokens)
            else:
                metrics.on_tokens(n, now - self._last_token_at)
            self._last_token_at = now
            self.num_output_tokens += n
            metrics.on_generated(n)
        reason = out.finish_reason
        if reason is None:
            return
        self.finish_reason = reason
        usage = out.usage
        if usage is not None and usage.cached_tokens:
            self.cached_tokens = usage.cached_tokens
        if reason is FinishReason.ERROR:
            metrics.on_finished("error", self, time.monotonic() - self._started_at)
        elif reason is not FinishReason.CANCELLED:
            metrics.on_finished(
                "length" if reason is FinishReason.LENGTH else "stop",
                self,
                time.monotonic() - self._started_at,
            )

    def stopped_early(self) -> None:
        """The face ended the generation itself (a stop string matched): count it as a stop,
        as the engine would have."""
        if self.finish_reason is None:
            self.finish_reason = FinishReason.STOP
            metrics = self._backend.metrics
            metrics.on_finished("stop", self, time.monotonic() - self._started_at)

    async def aclose(self) -> None:
        """Abort the generation if it still runs (its blocks and slot are freed at once)."""
        if self.finish_reason is None:
            self.finish_reason = FinishReason.CANCELLED
            self._backend.metrics.on_finished("abort", self, time.monotonic() - self._started_at)
        await self._outputs.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def engine_error(out: LLMEngineOutput) -> HttpError:
    """The HTTP error of an ERROR output (``ErrorKind``: 400, 503, else 500)."""
    message = out.error or "the engine failed the request"
    kind = out.error_kind
    if kind == ErrorKind.BAD_REQUEST.value:
        return HttpError(400, message)
    if kind == ErrorKind.OVERLOADED.value:
        return unavailable(message)
    return HttpError(500, message, type=SERVER_ERROR, code="engine_error")
