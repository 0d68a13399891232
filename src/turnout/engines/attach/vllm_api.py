"""vLLM's OpenAI server (``vllm serve``) as a token-in/token-out engine.

Read from vLLM's ``vllm/entrypoints/openai/completion/protocol.py`` (``CompletionRequest``,
``CompletionResponseStreamChoice``, ``CompletionStreamResponse``) and ``serving.py``
(``completion_stream_generator``, ``_create_completion_logprobs``):

Request: ``POST /v1/completions`` with ``prompt`` (a list of token ids: never re-tokenized),
``stream: true``, ``stream_options: {"include_usage": true}``, ``return_token_ids: true``
(each streamed choice carries its delta ``token_ids``), ``max_tokens`` (always sent: vLLM's
default is 16), ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt``, the
samplers ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``presence_penalty``,
``frequency_penalty``, ``repetition_penalty``, and for log probabilities ``logprobs: k`` with
``return_tokens_as_token_ids: true`` (tokens and ``top_logprobs`` keys as ``token_id:N``).

Stream: ``data: {"choices": [{"index", "text", "token_ids", "finish_reason", "stop_reason",
"logprobs": {"tokens", "token_logprobs", "top_logprobs"}}]}`` events, then (with
``include_usage``) ``{"choices": [], "usage": {"prompt_tokens", "completion_tokens",
"prompt_tokens_details": {"cached_tokens"}}}``, then ``data: [DONE]``. ``finish_reason``
``stop`` with an integer ``stop_reason`` is a stop token, with none EOS; ``length``;
``abort`` (the engine dropped it). A failure mid-stream is ``data: {"error": {...}}``.

Description: ``GET /v1/models`` (``id``, ``max_model_len``), ``GET /version``, and the KV
geometry from ``GET /metrics``: ``vllm:cache_config_info`` carries ``block_size`` and
``num_gpu_blocks`` as labels. Load: ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc``
before 0.9), summed over engines. Tokenizer probe: ``POST /tokenize`` ``{"prompt",
"add_special_tokens": false}`` -> ``{"tokens"}``.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from turnout.protocols.llm import ErrorKind, FinishReason, PreprocessedRequest
from turnout.protocols.model import ModelCapabilities

from .api_base import (
    MAX_TOP_LOGPROBS,
    ChunkDecoder,
    ErrorBody,
    LoadNumbers,
    Piece,
    ServerInfo,
    TokensApi,
    decode_event,
    error_kind,
    first_model,
    token_list,
)
from .prometheus import parse_samples
from .upstream import Upstream, UpstreamError

_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_RUNNING = ("vllm:num_requests_running",)
_WAITING = ("vllm:num_requests_waiting",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_CACHE_INFO = "vllm:cache_config_info"


class _Logprobs(msgspec.Struct):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []


class _Choice(msgspec.Struct):
    index: int = 0
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: _Logprobs | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Event(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: ErrorBody | None = None
    #: vLLM's older error shape: ``{"object": "error", "message", "type", "code"}``.
    object: str | None = None
    message: str | None = None
    type: str | None = None
    code: int | str | None = None


_event_decoder = msgspec.json.Decoder(_Event)


def token_id_key(key: str) -> int | None:
    """The id of a ``token_id:N`` token string (``return_tokens_as_token_ids``)."""
    if key.startswith("token_id:"):
        try:
            return int(key[9:])
        except ValueError:
            return None
    return None


class _Decoder(ChunkDecoder):
    __slots__ = ("_url", "_want_top")

    def __init__(self, url: str, request: PreprocessedRequest) -> None:
        self._url = url
        self._want_top = request.output_options.logprobs or 0

    def feed(self, field: str, payload: bytes) -> Piece | None:
        if payload == b"[DONE]":
            return Piece(last=True)
        event = decode_event(_event_decoder, self._url, payload)
        if field == "error" or event.error is not None or event.object == "error":
            err = event.error or ErrorBody(
                message=event.message or "", type=event.type, code=event.code
            )
            return Piece(error=(f"vLLM: {err.message or 'error'}", error_kind(err)))
        if event.usage is not None:
            details = event.usage.prompt_tokens_details
            return Piece(
                prompt_tokens=event.usage.prompt_tokens,
                completion_tokens=event.usage.completion_tokens,
                cached_tokens=details.cached_tokens if details is not None else None,
                token_ids=self._ids(event),
                last=not event.choices,
            )
        if not event.choices:
            return None
        choice = event.choices[0]
        ids = list(choice.token_ids or [])
        piece = Piece(token_ids=ids)
        if choice.logprobs is not None and ids:
            lp = choice.logprobs
            piece.log_probs = [math.nan if v is None else v for v in lp.token_logprobs[: len(ids)]]
            piece.log_probs += [math.nan] * (len(ids) - len(piece.log_probs))
            if self._want_top:
                tops: list[list[tuple[int, float]]] = []
                for entry in lp.top_logprobs[: len(ids)]:
                    alts = [
                        (tid, v)
                        for key, v in (entry or {}).items()
                        if (tid := token_id_key(key)) is not None
                    ]
                    alts.sort(key=lambda a: -a[1])
                    tops.append(alts[: self._want_top])
                tops += [[] for _ in range(len(ids) - len(tops))]
                piece.top_logprobs = tops
        reason = choice.finish_reason
        if reason is not None:
            if reason == "length":
                piece.finish = FinishReason.LENGTH
            elif reason == "stop":
                stop = choice.stop_reason
                piece.finish = FinishReason.STOP if isinstance(stop, int) else FinishReason.EOS
            else:  # "abort", "error": the engine dropped the request
                piece.error = (f"vLLM ended the request ({reason})", ErrorKind.ENGINE_FAILED)
        return piece

    @staticmethod
    def _ids(event: _Event) -> list[int]:
        return [t for c in event.choices for t in (c.token_ids or [])]


class VllmApi(TokensApi):
    name = "vllm"
    label = "vLLM"
    generate_path = "/v1/completions"
    health_path = "/health"

    def __init__(self, url: str) -> None:
        self.url = url

    def capabilities(self) -> ModelCapabilities:
        # vLLM partitions its prefix cache by ``cache_salt`` (it seeds the first block's hash).
        return ModelCapabilities(
            logprobs=True, max_top_logprobs=MAX_TOP_LOGPROBS, min_tokens=True, cache_salt=True
        )

    async def describe(self, upstream: Upstream) -> ServerInfo:
        model = first_model(upstream.base_url, await upstream.get_json("/v1/models"))
        info = ServerInfo(api=self.name, served_name=str(model.get("id") or "model"))
        max_len = model.get("max_model_len")
        if isinstance(max_len, int) and max_len > 0:
            info.context_length = max_len
        root = model.get("root")
        if isinstance(root, str):
            info.model_path = root
        try:
            version = await upstream.get_json("/version")
            if isinstance(version, dict) and isinstance(version.get("version"), str):
                info.version = version["version"]
        except UpstreamError:
            pass
        try:
            samples = parse_samples(await upstream.get_text("/metrics"), (_CACHE_INFO,))
        except UpstreamError as exc:
            info.notes.append(f"no metrics ({exc.detail})")
            return info
        for labels in samples.labels(_CACHE_INFO):
            block = _int(labels.get("block_size"))
            blocks = _int(labels.get("num_gpu_blocks"))
            if block:
                info.block_size = block
            if blocks:
                info.total_kv_blocks = blocks
            break
        return info

    def make_body(
        self, request: PreprocessedRequest, *, served_name: str, max_tokens: int, rid: str
    ) -> dict[str, object]:
        sc = request.stop_conditions
        body: dict[str, Any] = {
            "model": served_name,
            "prompt": request.token_ids,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "max_tokens": max_tokens,
            "request_id": rid,
        }
        if sc.min_tokens:
            body["min_tokens"] = sc.min_tokens
        if sc.ignore_eos:
            body["ignore_eos"] = True
        stop_ids = list(sc.stop_token_ids_hidden or ())
        if stop_ids:
            body["stop_token_ids"] = stop_ids
        if request.cache_salt:
            body["cache_salt"] = request.cache_salt
        logprobs = request.output_options.logprobs
        if logprobs is not None:
            body["logprobs"] = logprobs
            body["return_tokens_as_token_ids"] = True
        so = request.sampling_options
        for name in _SAMPLING:
            value = getattr(so, name)
            if value is not None:
                body[name] = value
        return body

    def decoder(self, request: PreprocessedRequest) -> ChunkDecoder:
        return _Decoder(self.url, request)

    async def tokenize(self, upstream: Upstream, text: str) -> list[int]:
        answer = await upstream.post_json(
            "/tokenize", {"prompt": text, "add_special_tokens": False}
        )
        return token_list(upstream.base_url, "POST /tokenize", answer)

    async def load(self, upstream: Upstream) -> LoadNumbers:
        samples = parse_samples(
            await upstream.get_text("/metrics"), (*_RUNNING, *_WAITING, *_KV_USAGE, _CACHE_INFO)
        )
        blocks = 0
        for labels in samples.labels(_CACHE_INFO):
            blocks = _int(labels.get("num_gpu_blocks")) or 0
            break
        return LoadNumbers(
            num_running=int(samples.total(*_RUNNING) or 0),
            num_waiting=int(samples.total(*_WAITING) or 0),
            kv_usage=min(1.0, max(0.0, samples.mean(*_KV_USAGE) or 0.0)),
            total_kv_blocks=blocks,
        )


def _int(text: str | None) -> int | None:
    try:
        value = int(float(text)) if text else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None


__all__ = ["VllmApi", "token_id_key"]
