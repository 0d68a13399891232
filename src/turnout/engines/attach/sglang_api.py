"""SGLang's server (``sglang.launch_server``) as a token-in/token-out engine.

Read from SGLang's ``python/sglang/srt/managers/io_struct.py`` (``GenerateReqInput``),
``sampling/sampling_params.py`` (``SamplingParams``) and ``managers/tokenizer_manager.py``
(``_handle_batch_output``: what a streamed ``/generate`` event holds):

Request: ``POST /generate`` with ``input_ids``, ``stream: true``, ``rid``, ``return_logprob``
and ``top_logprobs_num`` (with ``logprob_start_len: -1``: output tokens only), and
``sampling_params``: ``max_new_tokens`` (always sent: the default is 128),
``min_new_tokens``, ``ignore_eos``, ``stop_token_ids``, ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``sampling_seed``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``.

Stream: ``data: {"text", "output_ids", "meta_info": {"finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens", "output_token_logprobs": [[logprob, id, text], ...],
"output_top_logprobs": [[[logprob, id, text], ...], ...]}}`` events, then ``data: [DONE]``.
``output_ids`` and the logprob lists are *cumulative* by default and *deltas* with the
server's ``--incremental-streaming-output``: an event whose ``output_ids`` is as long as its
``completion_tokens`` is cumulative (the first event reads the same either way).
``finish_reason``: ``{"type": "stop", "matched": id}`` (an EOS or stop id), ``{"type":
"length"}``, ``{"type": "abort", "message", "status_code"}``. A failure mid-stream is
``data: {"error": {...}}``.

Refused: ``cache_salt`` (``/generate`` has no per-request cache partition).

Description: ``GET /v1/models`` (``id``, ``max_model_len``) and ``GET /get_server_info``
(``page_size``: the KV block size; ``max_total_num_tokens``, ``max_running_requests``;
older servers name it ``/server_info``). Load: ``sglang:num_running_reqs``,
``sglang:num_queue_reqs``, ``sglang:token_usage``. Tokenizer probe: ``POST /v1/tokenize``
``{"prompt", "add_special_tokens": false}`` -> ``{"tokens"}`` (``/tokenize`` on others).
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
    require_dict,
    token_list,
)
from .prometheus import parse_samples
from .upstream import Upstream, UpstreamStatus

#: ``SamplingOptions`` field -> SGLang's sampling parameter.
_SAMPLING = (
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("seed", "sampling_seed"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("repetition_penalty", "repetition_penalty"),
)


class _Meta(msgspec.Struct):
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    output_token_logprobs: list[list[Any]] | None = None
    output_top_logprobs: list[list[list[Any]] | None] | None = None


class _Event(msgspec.Struct):
    output_ids: list[int] = []
    meta_info: _Meta | None = None
    error: ErrorBody | str | None = None
    object: str | None = None
    message: str | None = None


_event_decoder = msgspec.json.Decoder(_Event)


class _Decoder(ChunkDecoder):
    __slots__ = ("_url", "_want_logprobs", "_want_top", "seen")

    def __init__(self, url: str, request: PreprocessedRequest) -> None:
        self._url = url
        self._want_logprobs = request.output_options.logprobs is not None
        self._want_top = request.output_options.logprobs or 0
        self.seen = 0

    def feed(self, field: str, payload: bytes) -> Piece | None:
        if payload == b"[DONE]":
            return Piece(last=True)
        event = decode_event(_event_decoder, self._url, payload)
        if field == "error" or event.error is not None or event.object == "error":
            err = event.error
            if not isinstance(err, ErrorBody):
                err = ErrorBody(message=err or event.message or "")
            return Piece(error=(f"SGLang: {err.message or 'error'}", error_kind(err)))
        meta = event.meta_info or _Meta()
        ids = event.output_ids
        cumulative = meta.completion_tokens is not None and len(ids) == meta.completion_tokens
        start = self.seen if cumulative else 0
        new = ids[start:]
        self.seen += len(new)
        piece = Piece(
            token_ids=list(new),
            prompt_tokens=meta.prompt_tokens,
            cached_tokens=meta.cached_tokens,
        )
        if self._want_logprobs and new:
            entries = (meta.output_token_logprobs or [])[start : start + len(new)]
            piece.log_probs = [_logprob(e) for e in entries]
            piece.log_probs += [math.nan] * (len(new) - len(piece.log_probs))
            if self._want_top:
                rows = (meta.output_top_logprobs or [])[start : start + len(new)]
                piece.top_logprobs = [_alternatives(row, self._want_top) for row in rows]
                piece.top_logprobs += [[] for _ in range(len(new) - len(rows))]
        finish = meta.finish_reason
        if finish is not None:
            piece.completion_tokens = meta.completion_tokens
            piece.last = True
            kind = finish.get("type")
            if kind == "length":
                piece.finish = FinishReason.LENGTH
            elif kind == "stop":
                piece.finish = (
                    FinishReason.STOP
                    if isinstance(finish.get("matched"), str)
                    else (FinishReason.EOS)
                )
            else:
                status = finish.get("status_code")
                bad = isinstance(status, int) and 400 <= status < 500
                message = finish.get("message") or kind or "aborted"
                piece.error = (
                    f"SGLang ended the request: {message}",
                    ErrorKind.BAD_REQUEST if bad else ErrorKind.ENGINE_FAILED,
                )
        return piece


def _logprob(entry: Any) -> float:
    if isinstance(entry, list) and entry and isinstance(entry[0], int | float):
        return float(entry[0])
    return math.nan


def _alternatives(row: list[list[Any]] | None, k: int) -> list[tuple[int, float]]:
    alts = [
        (int(e[1]), float(e[0]))
        for e in row or []
        if isinstance(e, list) and len(e) >= 2 and isinstance(e[1], int) and e[0] is not None
    ]
    alts.sort(key=lambda a: -a[1])
    return alts[:k]


class SglangApi(TokensApi):
    name = "sglang"
    label = "SGLang"
    generate_path = "/generate"
    health_path = "/health"

    def __init__(self, url: str) -> None:
        self.url = url
        self._tokenize_path = "/v1/tokenize"

    def capabilities(self) -> ModelCapabilities:
        # No ``cache_salt``: the frontend refuses salted requests (a tenant's among them)
        # before routing, ``own_refusal`` those that arrive anyway.
        return ModelCapabilities(
            logprobs=True, max_top_logprobs=MAX_TOP_LOGPROBS, min_tokens=True, cache_salt=False
        )

    async def describe(self, upstream: Upstream) -> ServerInfo:
        model = first_model(upstream.base_url, await upstream.get_json("/v1/models"))
        info = ServerInfo(api=self.name, served_name=str(model.get("id") or "model"))
        max_len = model.get("max_model_len")
        if isinstance(max_len, int) and max_len > 0:
            info.context_length = max_len
        server: dict[str, object] = {}
        for path in ("/get_server_info", "/server_info"):
            try:
                server = require_dict(upstream.base_url, path, await upstream.get_json(path))
                break
            except UpstreamStatus:
                continue
        states = server.get("internal_states")
        if isinstance(states, list) and states and isinstance(states[0], dict):
            server = {**states[0], **server}
        page = server.get("page_size")
        if isinstance(page, int) and page > 0:
            info.block_size = page
        total = server.get("max_total_num_tokens")
        if isinstance(total, int) and total > 0:
            info.total_kv_blocks = max(1, total // (info.block_size or 1))
        running = server.get("max_running_requests")
        if isinstance(running, int) and running > 0:
            info.max_num_seqs = running
        if info.context_length is None:
            ctx = server.get("context_length")
            if isinstance(ctx, int) and ctx > 0:
                info.context_length = ctx
        version = server.get("version")
        info.version = version if isinstance(version, str) else None
        model_path = server.get("tokenizer_path") or server.get("model_path")
        info.model_path = model_path if isinstance(model_path, str) else None
        return info

    def own_refusal(self, request: PreprocessedRequest) -> str | None:
        if request.cache_salt:
            return "cache_salt: SGLang's /generate has no per-request cache partition"
        return None

    def make_body(
        self, request: PreprocessedRequest, *, served_name: str, max_tokens: int, rid: str
    ) -> dict[str, object]:
        sc = request.stop_conditions
        params: dict[str, Any] = {"max_new_tokens": max_tokens}
        if sc.min_tokens:
            params["min_new_tokens"] = sc.min_tokens
        if sc.ignore_eos:
            params["ignore_eos"] = True
        if sc.stop_token_ids_hidden:
            params["stop_token_ids"] = list(sc.stop_token_ids_hidden)
        so = request.sampling_options
        for ours, theirs in _SAMPLING:
            value = getattr(so, ours)
            if value is not None:
                params[theirs] = value
        body: dict[str, Any] = {
            "input_ids": request.token_ids,
            "sampling_params": params,
            "stream": True,
            "rid": rid,
        }
        logprobs = request.output_options.logprobs
        if logprobs is not None:
            body["return_logprob"] = True
            body["logprob_start_len"] = -1
            body["top_logprobs_num"] = logprobs
        return body

    def decoder(self, request: PreprocessedRequest) -> ChunkDecoder:
        return _Decoder(self.url, request)

    async def tokenize(self, upstream: Upstream, text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False}
        try:
            answer = await upstream.post_json(self._tokenize_path, body)
        except UpstreamStatus as exc:
            if exc.status != 404 or self._tokenize_path == "/tokenize":
                raise
            self._tokenize_path = "/tokenize"
            answer = await upstream.post_json(self._tokenize_path, body)
        return token_list(upstream.base_url, f"POST {self._tokenize_path}", answer)

    async def load(self, upstream: Upstream) -> LoadNumbers:
        samples = parse_samples(
            await upstream.get_text("/metrics"),
            ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
        )
        return LoadNumbers(
            num_running=int(samples.total("sglang:num_running_reqs") or 0),
            num_waiting=int(samples.total("sglang:num_queue_reqs") or 0),
            kv_usage=min(1.0, max(0.0, samples.mean("sglang:token_usage") or 0.0)),
        )


__all__ = ["SglangApi"]
